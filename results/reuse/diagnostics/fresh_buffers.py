# Diagnostic behind a number in the README (reuse, layer-wise pipelining). Run: PYTHONPATH=bench .venv/bin/python results/reuse/diagnostics/fresh_buffers.py
import mmap, time, torch
torch.set_num_threads(1)
src = torch.randn(3, 8400, 64).to(torch.bfloat16)
n = src.numel() * 2
def plain():
    return [torch.empty_like(src) for _ in range(120)]
def huge():
    out = []
    for _ in range(120):
        m = mmap.mmap(-1, n); m.madvise(mmap.MADV_HUGEPAGE)
        out.append(torch.frombuffer(m, dtype=torch.bfloat16).view(src.shape))
    return out
for f in (plain, huge, plain, huge):
    t = time.perf_counter(); bufs = f()
    for b in bufs: b.copy_(src)
    print(f.__name__, round(time.perf_counter() - t, 3)); del bufs
