"""`moment-kv`: decode-time eviction by momentum of attention; the prompt's rows are never evicted.

Jana, Nishad and Singh 2026, "Moment-KV: Momentum-Based Decode-Time KV Cache Compression for Long Generation"
(arXiv 2605.29873). Compressing the prefill cache corrupts critical context, so the prefill is kept whole and only
the rows generated while decoding are compressed. A token's importance is a state updated at every decoding step
with decay (the paper's Eq. 5): I_i(t) = alpha * I_i(t-1) + a_i(t), a_i(t) the attention step t's query gives token
i; the decoded tokens of lowest importance are evicted.

What kvmem does:
* the momentum is tracked by the cache as the model runs (`observe.py`, `KVCache(attention_decay=decay)`, set by
  `new_cache(lm, method)` or by a `Compressor` of this method): every query is one step, including each prompt
  query, so the state after the prefill is sum_s decay^(t-s) a_s and each decode step multiplies it by `decay` and
  adds its own attention. The state follows the rows through eviction, as H2O's sum does. With GQA a KV head's
  score is the mean over its query group (as kvmem's h2o averages), per KV head.
* the prompt is what the cache's first forward held (`Observation.prompt_end`): its rows are never evicted and
  never count against the budget.
* budget, in `Compressor(get_method("moment-kv"), keep_ratio, every=N)` (in `model.generate`): the prefill is not
  compressed; every N forwards each head keeps ceil(keep_ratio x tokens generated so far) generated rows (prompt
  rows + that are held, plus at most N-1 rows between rounds). With `moment-kv:decode_budget=B` each head keeps at
  most B generated rows instead (a fixed decode cache, as in decode-phase methods' evaluations); keep_ratio must
  then be 1.0. `compress(cache, method, r)` on a cache that has decoded keeps ceil(r x generated rows held) per
  head (or B); on a cache holding only its prompt it has nothing to evict. The API's one-call `answer`, the CLI and
  the server compress once, after the prefill, and do not compress while decoding: there moment-kv keeps
  everything (it is a decode-time method).
* selection: the top-scoring generated rows per head (kvmem's uniform per-head budget unless `budget=` says).

Where this departs from the paper, and why: only the abstract, Eq. 5 and summaries of the paper were available to
us (no reference code was found): the default decay 0.9 is ours, not the paper's value; whether a_i is averaged
over all heads of a layer or per KV head, and whether a recent window or attention sinks are kept apart, could not
be checked. kvmem scores per KV head with no recent window by default (the abstract argues against rigid recency
windows). `recent=N` keeps each head's N newest generated rows whatever their momentum, within the budget: a row's
first step of attention is one term against the decayed sums of older rows, so without it the token just generated
is often evicted at once (the long-output benchmark measures both, `results/longgen`).
"""

from __future__ import annotations

import math

from torch import Tensor

from kvmem.compress.base import HeadView, Method, keep_recent_and_top
from kvmem.errors import KVMemError


class MomentKV(Method):
    name = "moment-kv"
    needs_attention = True
    decode_phase = True

    def __init__(self, decay: float = 0.9, decode_budget: int | None = None, recent: int = 0):
        bad = []
        if not isinstance(decay, (int, float)) or isinstance(decay, bool) or not math.isfinite(decay) \
                or not 0.0 < decay <= 1.0:
            bad.append(f"decay={decay!r} (in (0, 1]: how much of a token's importance survives a step)")
        if decode_budget is not None and (not isinstance(decode_budget, int) or isinstance(decode_budget, bool)
                                          or decode_budget < 1):
            bad.append(f"decode_budget={decode_budget!r} (an integer >= 1: generated rows kept per head)")
        if not isinstance(recent, int) or isinstance(recent, bool) or recent < 0:
            bad.append(f"recent={recent!r} (an integer >= 0: newest generated rows always kept per head)")
        if bad:
            raise KVMemError(f"moment-kv: bad option {'; '.join(bad)}")
        self.attention_decay = float(decay)
        self.decode_budget = decode_budget
        self.recent = recent

    def score(self, head: HeadView) -> Tensor:
        return head.attention.mean(dim=0)  # the momentum state, averaged over the query group

    def select(self, head: HeadView, score: Tensor, n_keep: int) -> Tensor:
        return keep_recent_and_top(head, score, n_keep, self.recent)
