"""KV-Direct against the full cache and eviction at the same bytes (issue 36, part B).

Two parts, for one model:

* `decode`: a long prompt (`lengths` tokens of the shipped abstracts, raw text, one offset per sample) read, then
  `new_tokens` greedy tokens. Per method: the tokens (score: token match against the full cache's greedy output, the
  paper's measure: the fraction of positions where the two agree, and the agreeing prefix), the time of each decode
  step, and the bytes held after each step (measured from the tensors; KV-Direct's resident K/V and checkpoints
  apart). Methods: `full`; `kv-direct:checkpoint=layer|tokens:window=W`; h2o, streaming-llm, snapkv and tova holding
  W rows per head from the prompt on (`Compressor(method, W / length, every=1)`: the window's K/V, what KV-Direct's
  token checkpoints hold but for 4 bytes a token).
* `growth`: a conversation fed in turns of `turn` tokens up to the longest length, bytes held after each turn by
  the full cache and both KV-Direct checkpoints (the time of each turn's forward too).
"""

PARTS = ("decode", "growth")
FULL = "full"
EVICTIONS = ("h2o", "streaming-llm", "snapkv", "tova")
