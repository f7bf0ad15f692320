"""The RAG benchmark (`kvmem eval --suite rag`): documents reused at new positions (CacheBlend, infoflow) on
multi-document QA built offline (`runner`, which also writes its report)."""
