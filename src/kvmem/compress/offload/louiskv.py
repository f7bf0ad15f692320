"""`louiskv`: semantic-aware retrieval, triggered only at semantic boundaries, over fine-grained key clusters.

"LouisKV: Efficient KV Cache Retrieval for Long Input-Output Sequences" (2025; abstract in the seeds): critical
KVs show strong temporal locality while decoding, so retrieval is triggered only at semantic boundaries (when the
query moves), not every token; retrieval units are built with a decoupled, fine-grained scheme that matches
attention: the input is clustered by key semantics, the output is managed in segments. Here: each KV head's
offloaded input rows are clustered by k-means over their keys (about `cluster` rows per cluster; the centroids stay
resident, counted in the resident bytes); a forward retrieves only when, for some KV head, the cosine similarity of
its mean query to the one at that head's last retrieval is below `threshold` (a boundary), and then every head ranks
its clusters by its queries' best logit against the centroid and takes them while they fit the buffer. Output rows
(the answer) stay resident in the recent rows (our short answers need no output segments: that half of the paper's
scheme is not exercised here). Threshold value and k-means details are our choices; the abstract gives neither.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvmem.compress.offload.base import OffloadMethod, fill
from kvmem.errors import KVMemError

KMEANS_STEPS = 8


def kmeans(x: Tensor, k: int, steps: int = KMEANS_STEPS) -> Tensor:
    """Cluster of each row of x (T, D) among k, cosine k-means seeded with evenly spaced rows (deterministic)."""
    x = torch.nn.functional.normalize(x.float(), dim=-1)
    centroids = x[torch.linspace(0, x.shape[0] - 1, k).round().long()]
    for _ in range(steps):
        assign = (x @ centroids.T).argmax(1)
        sums = torch.zeros_like(centroids).index_add_(0, assign, x)
        filled = torch.bincount(assign, minlength=k) > 0
        centroids = torch.where(filled[:, None], torch.nn.functional.normalize(sums, dim=-1), centroids)
    return (x @ centroids.T).argmax(1)


class LouisKV(OffloadMethod):
    name = "louiskv"

    def __init__(self, sink: int = 4, recent: int = 32, tier: str = "int8", cluster: int = 16, threshold: float = 0.9):
        super().__init__(sink, recent, tier)
        if cluster < 1:
            raise KVMemError(f"louiskv: cluster must be >= 1 (got {cluster})")
        if not 0.0 <= threshold <= 1.0:
            raise KVMemError(f"louiskv: threshold is a cosine similarity in [0, 1] (got {threshold})")
        self.cluster, self.threshold = cluster, threshold

    def build_index(self, keys: Tensor, positions: Tensor, ids, layer) -> dict:
        k = max(1, keys.shape[1] // self.cluster)
        assign = torch.stack([kmeans(keys[h], k) for h in range(keys.shape[0])])  # (H, T)
        sums = torch.zeros((keys.shape[0], k, keys.shape[-1])).scatter_add_(
            1, assign[:, :, None].expand(-1, -1, keys.shape[-1]), keys.float())
        counts = torch.stack([torch.bincount(a, minlength=k) for a in assign])  # (H, k)
        centroids = (sums / counts.clamp_min(1)[:, :, None]).to(keys.dtype)  # the clusters' mean keys (logits' scale)
        members = [[(a == c).nonzero()[:, 0] for c in range(k)] for a in assign]
        return {"resident": [centroids], "state": [assign], "centroids": centroids, "counts": counts, "members": members}

    def retrieve(self, rows, queries: list[Tensor], scaling: float) -> list[Tensor] | None:
        probes = [torch.nn.functional.normalize(q.float().mean((0, 1)), dim=-1) for q in queries]
        last = rows.state.get("probes")
        if last is not None and all(float(p @ l) >= self.threshold for p, l in zip(probes, last)):
            return None  # no semantic boundary: the rows retrieved last still serve
        rows.state["probes"] = probes
        centroids, counts, members = rows.index["centroids"], rows.index["counts"], rows.index["members"]
        chosen = []
        for h, q in enumerate(queries):
            best = (q.float() @ centroids[h].float().T * scaling).amax((0, 1))  # (clusters,)
            units = fill(best.argsort(descending=True), counts[h], rows.capacity)
            chosen.append(torch.cat([members[h][u] for u in units.tolist()]) if units.numel()
                          else torch.empty(0, dtype=torch.long))
        return chosen
