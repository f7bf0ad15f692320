"""The one exception type kvmem raises for bad input; the CLI prints its message as one line."""


class KVMemError(ValueError):
    """A problem with what the user asked for (bad argument, unsupported model, corrupt file...)."""
