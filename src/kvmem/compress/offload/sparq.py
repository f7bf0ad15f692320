"""`sparq`: retrieval by approximate attention from a few key channels, no resident index.

"SparQ Attention: Bandwidth-Efficient LLM Inference" (Ribar et al., ICML 2024; not in the seeds, added because the
seeds' policies rank rows by summaries that miss what attention needs: results/offload/README.md). Per query:
1. the `r` largest-magnitude components of the query pick `r` channels; only those channels of every offloaded key
   are read (the tier holds the keys a second time, channel-major, so that read is contiguous: the paper's layout)
   and approximate scores ŝ = softmax(q[i] · K[:, i] / sqrt(d · ||q[i]||₁ / ||q||₁)) are formed (the temperature
   corrects for the channels left out);
2. the `k` rows with the largest ŝ are fetched whole (keys and values) and attended;
3. the output is interpolated with the mean value, y = α · y_topk + (1 - α) · v̄, where α is the approximate
   attention mass the fetched rows hold: what the rows not fetched would have added, in expectation.
Here `k` is the resident buffer (`rows.capacity`), rows resident anyway (sinks, recent rows, question, answer) take
part in α and v̄ as the fetched ones do, and one KV head serves its query group, so it fetches the rows with the
largest ŝ any query of the group gives (the union, as `exact-topk` does). `r` is `channels` x head_dim (the paper's
r = d/4 .. d/8 settings). Held resident beside the rows: the offloaded values' sum, one vector per KV head (for v̄;
the resident rows' values are added when it is used).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvmem.compress.offload.base import OffloadMethod
from kvmem.compress.offload.rows import TIER_GROUP, head_rows
from kvmem.errors import KVMemError
from kvmem.quant import pack


class SparQ(OffloadMethod):
    name = "sparq"

    def __init__(self, sink: int = 4, recent: int = 32, tier: str = "int8", channels: float = 0.25,
                 mean_value: bool = True):
        super().__init__(sink, recent, tier)
        if not 0.0 < channels <= 1.0:
            raise KVMemError(f"sparq: channels is the share of the head dim read per query, in (0, 1] (got {channels})")
        self.channels, self.mean_value = channels, bool(mean_value)

    def build_index(self, keys: Tensor, positions: Tensor, ids, layer) -> dict:
        t = keys.shape[1]
        by_channel = keys.transpose(1, 2)  # (H, D, T): one channel of every row is contiguous
        if self.tier == "raw":
            by_channel = by_channel.contiguous()
            offline = [by_channel]
        else:  # quantized in groups of rows along each channel (KIVI's key layout), padded to whole groups
            by_channel = pack.quantize(torch.nn.functional.pad(by_channel, (0, -t % TIER_GROUP)), int(self.tier[3:]),
                                       TIER_GROUP)
            offline = by_channel.tensors()
        _, values, held = layer.rows.stacked()  # the offloaded rows' values, for the mean value (step 3)
        start = int((held[0] < positions[0, 0]).sum())
        value_sum = values[:, start:start + t].float().sum(1).to(keys.dtype)  # (H, D)
        return {"resident": [value_sum], "offline": offline, "state": [], "by_channel": by_channel, "rows": t,
                "value_sum": value_sum}

    def channels_of(self, by_channel, head: int, channels: Tensor, rows: int) -> Tensor:
        """Channels `channels` of every offloaded key of `head`: (len(channels), rows), decoded."""
        if isinstance(by_channel, Tensor):
            return by_channel[head].index_select(0, channels)
        return pack.dequantize(head_rows(by_channel, head, channels))[:, :rows]

    def retrieve(self, rows, queries: list[Tensor], scaling: float) -> list[Tensor]:
        index = rows.index
        r = max(1, round(self.channels * queries[0].shape[-1]))
        chosen, alpha_parts = [], []
        for h, q in enumerate(queries):
            x = q.float().reshape(-1, q.shape[-1])  # (group * Q, D)
            top = x.abs().topk(r, dim=-1).indices
            keep = torch.zeros_like(x, dtype=torch.bool).scatter_(1, top, True)
            read = keep.any(0).nonzero()[:, 0]  # the channels some query of the group needs, read once
            part = self.channels_of(index["by_channel"], h, read, index["rows"]).float()  # (|read|, T)
            masked = torch.where(keep, x, 0.0)[:, read]
            share = masked.abs().sum(-1) / x.abs().sum(-1).clamp_min(1e-30)
            logits = masked @ part * (scaling / share.clamp_min(1e-30).sqrt())[:, None]  # (group * Q, T)
            rows.state.setdefault("channels_read", []).append(int(read.numel()))  # per head and forward: bandwidth
            weight = logits.softmax(-1).amax(0)
            pick = weight.topk(min(rows.capacity, weight.numel())).indices.sort().values
            chosen.append(pick)
            alpha_parts.append((logits, pick, masked, read, share))
        rows.state["approx"] = alpha_parts
        return chosen

    def interpolate(self, rows, head: int, query: Tensor, out: Tensor, new_pos: Tensor, scaling: float) -> Tensor:
        """Step 3 for KV head `head`: `out` (1, Q, group, D) is its query group's attention over the resident rows."""
        if not self.mean_value:
            return out
        logits, pick, masked, read, share = rows.state["approx"][head]
        k, v, p = rows.fixed.heads()[head]
        group, q_len = query.shape[1], query.shape[2]
        visible = p[None, :] <= new_pos[:, None]  # (Q, F): the rows appended after the context are causal
        fixed = masked @ k.float()[:, read].T * (scaling / share.clamp_min(1e-30).sqrt())[:, None]  # (group * Q, F)
        fixed = fixed.masked_fill(~visible.repeat(group, 1), float("-inf"))
        top = torch.maximum(logits.amax(-1), fixed.amax(-1))[:, None]
        held = (logits[:, pick] - top).exp().sum(-1) + (fixed - top).exp().sum(-1)
        alpha = held / ((logits - top).exp().sum(-1) + (fixed - top).exp().sum(-1))  # (group * Q,)
        alpha = alpha.reshape(group, q_len).T[None, :, :, None]  # (1, Q, group, 1), as `out`
        seen = visible.float()
        mean = (rows.index["value_sum"][head].float() + seen @ v.float()) / (rows.index["rows"] + seen.sum(-1))[:, None]
        return (alpha * out.float() + (1 - alpha) * mean[None, :, None, :]).to(out.dtype)
