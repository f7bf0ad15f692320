"""The reuse benchmark (`kvmem eval --suite reuse`): TTFT with and without stored KV per tier and codec (`runner`),
semantic lookup (`semantic`), and the report (`report`)."""
