"""`vatp`: Value-Aware Token Pruning, attention score x l1 norm of the value.

Guo, Kamigaito and Watanabe 2024, "Attention Score is not All You Need for Token Importance Indicator in KV
Cache Reduction: Value Also Matters" (EMNLP 2024, arXiv 2406.12335; reference code github.com/guozhiyu/vatp,
`utils_hh/modify_llama.py`). A token's importance is its base method's attention score times the l1 norm of
its value vector, I_k = S_k * ||v_k||_1, per head (no normalisation). The first `n_sink` tokens are always kept
(their value norms are tiny though attention sinks matter; the reference runs `--sink_len 20`). With GQA the
score is averaged over the query heads sharing a KV head, as kvmem's h2o does; the value norm is the KV head's.

`source` picks the base method, as the reference's `--h2o` switch does:
* `accumulated` (default, "H2O w/ VATP"): S_k is H2O's attention accumulated over every query so far; the
  budget is split half recent window, half heavy hitters by score (heavy_ratio = recent_ratio), as in h2o.
* `window` ("Scissorhands w/ VATP"): S_k is the mean attention of the last `window` queries (the reference
  averages the last 400 prompt queries); the 10 most recent tokens are kept and the rest of the budget goes to
  the top scores. The reference keeps adding decode-time attention x norm to that prefill score; kvmem scores
  from the last `window` queries whenever it compresses (`Compressor(every=N)` rescoring included).
"""

from __future__ import annotations

from torch import Tensor

from kvmem.compress.base import HeadView, Method, keep_recent_and_top
from kvmem.errors import KVMemError

SOURCES = ("accumulated", "window")
WINDOW_RECENT = 10  # the reference's Scissorhands setting keeps 10 recent tokens


class VATP(Method):
    name = "vatp"
    needs_attention = True

    def __init__(self, source: str = "accumulated", window: int = 400, n_sink: int = 20):
        if source not in SOURCES:
            raise KVMemError(f"vatp's source must be {' or '.join(SOURCES)} (the attention score the value norm "
                             f"multiplies); got source={source!r}")
        if window < 1 or n_sink < 0:
            raise KVMemError(f"vatp needs window >= 1 and n_sink >= 0; got window={window}, n_sink={n_sink}")
        self.source, self.window, self.n_sink = source, window, n_sink
        self.needs_attention = source == "accumulated"  # per instance: only H2O's score needs tracked attention
        self.observe_window = window if source == "window" else 0

    def score(self, head: HeadView) -> Tensor:
        if self.source == "accumulated":
            attention = head.attention.mean(dim=0)
        else:
            attention = head.query_attention(last=self.window).mean(dim=1).mean(dim=0)
        score = attention * head.values.float().abs().sum(dim=-1)
        score[head.positions < self.n_sink] = float("inf")  # attention sinks, kept whatever their value norm
        return score

    def select(self, head: HeadView, score: Tensor, n_keep: int) -> Tensor:
        return keep_recent_and_top(head, score, n_keep, WINDOW_RECENT if self.source == "window" else n_keep // 2)
