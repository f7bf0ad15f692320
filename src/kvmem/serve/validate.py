"""What `kvmem serve` does with each field of OpenAI's chat completions, completions and embeddings requests (the
`openai` package's `CompletionCreateParams` and `EmbeddingCreateParams`), and the checks the pydantic bodies
(schemas.py) cannot express on their own. Every refusal is a 400 whose `param` names the field.

    used       read and honoured (model, messages, prompt, max_tokens, temperature, top_p, n, stop, stream, ...)
    accepted   read, type-checked and not acted on, as vLLM does: `user` (logged in the access log), `metadata`,
               `service_tier`, `parallel_tool_calls` (the calls a model writes are all returned), `safety_identifier`,
               `prompt_cache_key` / `_retention` / `_options` (kvmem reuses every prompt prefix on its own), and
               `stream_options.include_obfuscation` (OpenAI's stream padding, on by default there)
    refused    400 when set to anything but its neutral value: what kvmem cannot honour (audio, other modalities,
               predicted outputs, web search, reasoning effort, verbosity, moderation, stored completions)
    decode     logprobs, penalties, logit_bias, echo, response_format, tools: read and checked in tokens.py and
               tools.py, done in logits.py and respond.py

A field that is none of OpenAI's (nor kvmem's own `kvmem` object) is refused, as OpenAI does ("unrecognized request
argument"), so that a typo or another server's extension is not silently ignored.
"""

from __future__ import annotations

from kvmem.serve.schemas import Accepted, ChatRequest, EmbeddingRequest, Generation, fail

INT64 = (-2**63, 2**63 - 1)  # the seed's range (vLLM's, and what torch.Generator takes)

_ACCEPTED = set(Accepted.model_fields)
_DECODE = {"logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "echo",
           "response_format", "tools", "tool_choice", "functions", "function_call", "best_of", "suffix"}
# refused unless neutral: the field, then the values that ask for nothing
REFUSED = {"audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "web_search_options": (None, {}),
           "reasoning_effort": (None, "none"), "verbosity": (None,), "moderation": (None,), "store": (None, False)}
_WHY = {"audio": "kvmem serve answers in text only", "modalities": "kvmem serve answers in text only",
        "prediction": "predicted outputs are not implemented", "web_search_options": "kvmem serve does not search",
        "reasoning_effort": "the served models do not reason", "verbosity": "the served models take no verbosity",
        "moderation": "kvmem serve runs no moderation",
        "store": "kvmem serve keeps no completions to retrieve later"}

CHAT_FIELDS = ({"messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
                "stream", "stream_options", "seed", "kvmem"} | _ACCEPTED | (_DECODE - {"echo", "best_of", "suffix"})
               | set(REFUSED))
COMPLETION_FIELDS = {"prompt", "model", "max_tokens", "temperature", "top_p", "n", "stop", "stream",
                     "stream_options", "seed", "user", "kvmem", "logprobs", "presence_penalty", "frequency_penalty",
                     "logit_bias", "echo", "best_of", "suffix"}
EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions", "user", "kvmem"}


def check_fields(body: Generation | EmbeddingRequest, allowed: set[str], endpoint: str) -> None:
    """Refuse fields this endpoint does not have (or has only in another endpoint), and the refused ones unless
    neutral."""
    given = set(body.model_extra or {}) | {f for f in body.model_fields_set if getattr(body, f) is not None}
    for name in sorted(given):
        if name not in allowed:
            fail(400, f"unrecognized request argument {name!r} for {endpoint}", param=name,
                 code="unrecognized_argument")
        value = getattr(body, name, None) if name in type(body).model_fields else body.model_extra[name]
        if name in REFUSED and value not in REFUSED[name]:
            fail(400, f"{name}={value!r} is not supported by kvmem serve: {_WHY[name]}", param=name,
                 code="unsupported_parameter")


def check_generation(body: Generation) -> None:
    """The fields shared by chat and text completions, beyond their types."""
    check_fields(body, CHAT_FIELDS if isinstance(body, ChatRequest) else COMPLETION_FIELDS,
                 "/v1/chat/completions" if isinstance(body, ChatRequest) else "/v1/completions")
    if body.seed is not None and not INT64[0] <= body.seed <= INT64[1]:
        fail(400, f"seed must be a 64-bit integer, in [{INT64[0]}, {INT64[1]}]; got {body.seed}", param="seed")
    if body.stream_options is not None:
        if not body.stream:
            fail(400, "stream_options goes with stream=true", param="stream_options")
        unknown = set(body.stream_options) - {"include_usage", "include_obfuscation"}
        if unknown:
            fail(400, f"stream_options has include_usage and include_obfuscation, not {', '.join(sorted(unknown))}",
                 param="stream_options")
        for key, value in body.stream_options.items():
            if not isinstance(value, bool):
                fail(400, f"stream_options.{key} must be true or false, got {value!r}", param=f"stream_options.{key}")


def message_texts(body: ChatRequest) -> list[str]:
    """Each message's text: content parts joined, each part checked; only an assistant message may have no content
    (a tool call's)."""
    texts = []
    for i, m in enumerate(body.messages):
        content, where = m.content, f"messages.{i}.content"
        if content is None and m.role != "assistant":
            fail(400, f"a {m.role} message needs content (a string or a list of text parts)", param=where)
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.get("type") != "text":
                    fail(400, f"only text content parts are supported (got type {part.get('type')!r})",
                         param=f"{where}.{j}.type")
                if not isinstance(part.get("text"), str):
                    fail(400, "a text content part needs a string 'text'", param=f"{where}.{j}.text")
            content = "".join(p["text"] for p in content)
        texts.append(content or "")
    return texts


def completion_limit(lm, prompt_tokens: int, asked: int | None, field: str, default: int, prompt_field: str) -> int:
    """The completion tokens this request may generate. Prompt plus an asked-for `max_tokens` past the model's context
    is refused, naming the numbers (as vLLM does); without one, the default is cut to what the context leaves."""
    room = lm.max_context - prompt_tokens
    if room <= 0:
        fail(400, f"This model's maximum context length is {lm.max_context} tokens; the prompt alone is "
                  f"{prompt_tokens} tokens, which leaves no room for a completion. Shorten the prompt.",
             param=prompt_field, code="context_length_exceeded")
    if asked is not None and asked > room:
        fail(400, f"{field}={asked} is too large: this model's maximum context length is {lm.max_context} tokens "
                  f"and the request has {prompt_tokens} prompt tokens ({asked} > {lm.max_context} - {prompt_tokens}). "
                  f"Lower {field} or shorten the prompt.", param=field, code="context_length_exceeded")
    return asked if asked is not None else min(default, room)
