"""Long outputs: compression while a model writes hundreds of tokens (issue 35's decode-phase benchmark).

Eviction benchmarks elsewhere compress a prompt and ask for a short answer; decode-phase methods (H2O, TOVA,
Moment-KV) matter when the output is long and the cache grows as it is written. Each method runs inside the
cache (`Compressor(method, keep_ratio, every=N)`): the prompt is compressed when it is read, and every N tokens
decoded each layer is brought back to its budget. Two parts:

* `copy`: the prompt holds a numbered list of `ITEMS` random entries ("17. windy honey: 7890"), and the model is
  asked to copy it, in order. The list is 278-288 tokens on the registry's tokenizers; its check needs no reference text, only the prompt: the
  score is the fraction of entries (name and number) that appear as a line of the output. Also recorded: how
  much of the output is the same as the full cache's (longest common subsequence of tokens over the full cache's
  length) and the fraction of repeated 4-grams (degenerate loops, the usual failure).
* `ppl`: perplexity of a held-out continuation (the abstracts that follow a context in the shipped text, none of
  them in it), fed one token at a time through the compressing cache, so each token is predicted from what the
  method kept of the context and of the continuation so far (StreamingLLM's and H2O's streaming evaluation).

Records hold the bytes the cache held (measured from its tensors) after each part, averaged over the decode steps,
so methods are compared at the memory they actually used.
"""

ITEMS = 24  # entries of the copy list (about 280-290 tokens: the output is at least 256)
PARTS = ("copy", "ppl")
FULL = "full"
