"""The continuous-batching benchmark (`kvmem eval --suite batching`): served throughput against concurrency, the
memory-bound case and decode steps (`runner`), and the report (`report`)."""
