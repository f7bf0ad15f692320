"""Step 2 of the offline index comparison: on the dumps of index-dump.py, the attention mass (mean over the question's
queries) each retrieval index captures at its own buffer (the summaries' bytes taken from it), even layers: exact top-k,
SparQ's channels, product quantization, 1-2 bit keys, Quest's page bounds. Prints means overall and per 6 layers."""
import glob, torch, math, statistics as st
torch.manual_seed(0)
files = sorted(glob.glob("/tmp/off/dump-*.pt"))
def weights(q, k, s):  # (G,Q,D),(T,D) -> (G*Q, T) softmax
    return (q.float().reshape(-1, q.shape[-1]) @ k.float().T * s).softmax(-1)
def kmeans(x, k, steps=10):
    c = x[torch.randperm(x.shape[0])[:k]].clone()
    for _ in range(steps):
        a = torch.cdist(x, c).argmin(1)
        s = torch.zeros_like(c).index_add_(0, a, x); n = torch.bincount(a, minlength=k)
        c = torch.where((n > 0)[:, None], s / n.clamp_min(1)[:, None], c)
    return c, torch.cdist(x, c).argmin(1)
def pq_approx(k, M, K):
    D = k.shape[1]; d = D // M; out = torch.empty_like(k)
    for m in range(M):
        c, a = kmeans(k[:, m*d:(m+1)*d], K); out[:, m*d:(m+1)*d] = c[a]
    return out
def quant_channel(k, bits, group=128):  # per-channel over tokens (KIVI keys)
    out = torch.empty_like(k); L = 2**bits - 1
    for g in range(0, k.shape[0], group):
        x = k[g:g+group]; lo, hi = x.amin(0), x.amax(0); sc = (hi - lo).clamp_min(1e-8) / L
        out[g:g+group] = ((x - lo) / sc).round().clamp(0, L) * sc + lo
    return out
RB = 512  # bytes of a row per head (k+v fp32, D=64)
def schemes(q, k, s, cap):
    T, D = k.shape; w = weights(q, k, s); m = w.mean(0)
    def take(score, c): return score.topk(min(c, T)).indices
    res = {"exact": m[take(w.amax(0), cap)].sum()}
    qf = q.float().reshape(-1, D)
    for r in (8, 16):
        # SparQ: per query its r largest |q| channels; approx logits, temperature-corrected
        idx = qf.abs().topk(r, -1).indices
        share = torch.stack([qf[i, idx[i]].abs().sum() / qf[i].abs().sum() for i in range(qf.shape[0])])
        approx = torch.stack([qf[i, idx[i]] @ k.float()[:, idx[i]].T for i in range(qf.shape[0])]) * s / share.sqrt()[:, None]
        res[f"sparq{r}"] = m[take(approx.softmax(-1).amax(0), cap)].sum()
    for M, K in ((8, 16), (16, 16)):
        cost = math.ceil((T * M * 4 / 8 + K * D * 4) / RB)
        res[f"pq{M}x{K}(-{cost})"] = m[take(weights(q, pq_approx(k.float(), M, K), s).amax(0), cap - cost)].sum()
    for b in (1, 2):
        cost = math.ceil((T * D * b / 8 + (T // 128) * D * 2 * 2) / RB)
        res[f"key{b}bit(-{cost})"] = m[take(weights(q, quant_channel(k.float(), b), s).amax(0), cap - cost)].sum()
    # quest pages of 16, int8 min/max (cost: 2 vectors int8 per page)
    for P in (8, 16):
        pages = T // P; kk = k.float()[:pages*P].reshape(pages, P, D); lo, hi = kk.amin(1), kk.amax(1)
        cost = math.ceil(pages * 2 * D / RB)
        ub = torch.maximum(qf[:, None] * lo[None], qf[:, None] * hi[None]).sum(-1) * s  # (Q, pages)
        order = ub.amax(0).argsort(descending=True)[: (cap - cost) // P]
        rows = (order[:, None] * P + torch.arange(P)).reshape(-1)
        res[f"quest{P}(-{cost})"] = m[rows].sum()
    return {k_: float(v) for k_, v in res.items()}
agg = {}
per_layer = {}
for f in files:
    d = torch.load(f)
    for L, (qs, ks, cap, s) in d.items():
        if L % 2: continue
        for q, k in zip(qs, ks):
            r = schemes(q, k, s, cap)
            for n, v in r.items(): agg.setdefault(n, []).append(v); per_layer.setdefault((L // 6, n), []).append(v)
for n, v in agg.items(): print(f"{n:18s} {st.mean(v):.3f}")
for L in range(5):
    print(L*6, " ".join(f"{n.split('(')[0]}={st.mean(per_layer[(L, n)]):.2f}" for n in agg))
