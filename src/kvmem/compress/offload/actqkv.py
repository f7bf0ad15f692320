"""`actqkv`: an activation-aware probe query, and a dynamic cut-off by information density.

ActQKV, "Activation-aware Probe-Query: Effective Key-Value Retrieval for Long-Context LLMs Inference" (2025;
abstract in the seeds): in each window, a token-level indicator, the
Activation Bias, picks the representative tokens from which a probe query is built to retrieve the relevant KV
pairs; a dynamic KV cut-off guided by information density decides how many are recalled per layer. Here: the window
is this forward's queries (the question's tokens, then each generated one) of a KV head's query group; a query's
activation bias is its distance from the window's mean query, and the probe is the queries' mean weighted by it
(with one query, the query itself). Units are blocks of `block` offloaded rows summarized by their mean key (resident,
counted); the probe's softmax over the blocks is its information density, and the cut-off keeps the fewest best
blocks holding `mass` of it (at most the buffer): a layer whose probe is sure recalls less. Bias and density
formulas are our reading; the abstract does not give them.
"""

from __future__ import annotations

from torch import Tensor

from kvmem.compress.offload.base import OffloadMethod, fill, fixed_spans, span_means, span_rows
from kvmem.errors import KVMemError


def probe_query(q: Tensor) -> Tensor:
    """The window's queries (group, Q, D) into one probe (D,): the mean weighted by each query's activation bias."""
    x = q.float().reshape(-1, q.shape[-1])
    bias = (x - x.mean(0)).norm(dim=-1)
    if float(bias.sum()) == 0.0:
        return x.mean(0)
    return (bias / bias.sum()) @ x


class ActQKV(OffloadMethod):
    name = "actqkv"

    def __init__(self, sink: int = 4, recent: int = 32, tier: str = "int8", block: int = 32, mass: float = 0.9):
        super().__init__(sink, recent, tier)
        if block < 1:
            raise KVMemError(f"actqkv: block must be >= 1 (got {block})")
        if not 0.0 < mass <= 1.0:
            raise KVMemError(f"actqkv: mass is a share of the probe's attention in (0, 1] (got {mass})")
        self.block, self.mass = block, mass

    def build_index(self, keys: Tensor, positions: Tensor, ids, layer) -> dict:
        starts, ends = fixed_spans(keys.shape[1], self.block)
        return {"resident": [span_means(keys, starts, ends)], "state": [starts, ends], "starts": starts, "ends": ends}

    def retrieve(self, rows, queries: list[Tensor], scaling: float) -> list[Tensor]:
        means, starts, ends = rows.index["resident"][0], rows.index["starts"], rows.index["ends"]
        chosen = []
        for h, q in enumerate(queries):
            density = (means[h].float() @ probe_query(q) * scaling).softmax(-1)
            order = density.argsort(descending=True)
            needed = int((density[order].cumsum(0) < self.mass).sum()) + 1  # the fewest blocks holding `mass`
            chosen.append(span_rows(starts, ends, fill(order[:needed], ends - starts, rows.capacity)))
        return chosen
