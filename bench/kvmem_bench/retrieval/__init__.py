"""The offline retrieval benchmark of `kvmem.embed` (`kvmem eval --suite retrieval`): two sets built from shipped
text (`sets`), every embedder at every layer and precision (`runner`), and its report (`report`)."""

# What `make bench-retrieval` runs (the report prints it; keep in sync with the Makefile)
LM_BENCH_METHODS = "mean,last,prompteol,echo,token-prepending,kv-embedding,kv-embedding:layers=none"
# kv-embedding's re-routing in other layer windows than its ID rule picks (early / late / all), per model
KV_WINDOWS = {"smollm2-135m": "kv-embedding:layers=1-7,kv-embedding:layers=20-26,kv-embedding:layers=all",
              "gemma3-270m": "kv-embedding:layers=1-3,kv-embedding:layers=14-16,kv-embedding:layers=all"}
BENCH_COMMANDS = (  # keep in sync with the Makefile's bench target
    f"kvmem eval --suite retrieval --models smollm2-135m --methods {LM_BENCH_METHODS},{KV_WINDOWS['smollm2-135m']},"
    "minilm,tfidf --layers all --threads 1 --out results/retrieval",
    f"kvmem eval --suite retrieval --models gemma3-270m --methods {LM_BENCH_METHODS},{KV_WINDOWS['gemma3-270m']} "
    "--layers all --threads 1 --out results/retrieval",
)
