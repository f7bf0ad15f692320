"""The batching benchmark's `steps` part: one decode step timed in-process, packed rows against padded ones, and
quantized or evicted rows with and without the decode kernel."""

from __future__ import annotations

import time

STEP_SCHEMES = ("kivi-8", "kivi-4", "kivi-2", "kvquant-3", "rotatekv-4")
EVICTED_STEP = "snapkv:budget=adaptive"  # the steps part's ragged full-precision rows


def step_times(model: str, threads: int, length: int = 1024, rows: tuple[int, ...] = (1, 4, 16),
               schemes: tuple[str, ...] = STEP_SCHEMES, steps: int = 8, log=print) -> dict:
    """In-process, one model: ms per decode step of a batch of `rows` sequences of `length` tokens (a) with every row
    attending its own cache in place (`RowBatch`, what the scheduler runs) against the same rows copied into one
    padded batch (`BatchedCache`), rows of equal lengths and of four lengths (1, 1/2, 1/4, 1/8 of the tokens, by
    streaming-llm; one position, which `BatchedCache` needs); (b) with every row's cache held by each quantization
    scheme, against full precision, and evicted to heads of different lengths (`EVICTED_STEP` at 0.25), read by the
    kernel or by SDPA. Rows are clones of one prefill; the order of the variants alternates over two rounds."""
    import torch

    from kvmem.batch import BatchedCache, RowBatch
    from unittest.mock import patch

    from kvmem.cache import KVCache
    from kvmem.compress import compress, get_method
    from kvmem.forward import feed, step
    from kvmem.layer import KVLayer
    from kvmem.models import load_model
    from kvmem.quant import get_scheme

    torch.set_num_threads(threads)
    lm = load_model(model)
    base = KVCache(lm.model.config)
    feed(lm, base, torch.randint(0, lm.tokenizer.vocab_size, (length,), generator=torch.Generator().manual_seed(0)).tolist())
    evicted = base.clone()  # heads of different lengths, as kvzip's or an adaptive budget's: full precision, ragged
    compress(evicted, get_method(EVICTED_STEP), 0.25)
    evicted.drop_observations()
    base.drop_observations()

    def packed(caches):
        batch = RowBatch(lm.model.config, caches)
        return lambda: step(lm, batch, [[5]] * len(caches))

    def padded(caches):
        batch, position = BatchedCache(caches), [base.get_seq_length()]

        def one():
            ids = torch.full((len(caches), 1), 5)
            lm.model(input_ids=ids, cache=batch, position_ids=torch.full((len(caches), 1), position[0]), use_cache=True,
                     logits_to_keep=1)
            position[0] += 1
        return one

    def timed(fn) -> float:
        fn()  # the first step allocates
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        return (time.perf_counter() - t) / steps * 1000

    def ragged(b: int) -> list:
        """b rows of different lengths at one position: streaming-llm at keep ratios 1, 1/2, 1/4, 1/8 in turn."""
        out = []
        for i in range(b):
            c = base.clone()
            if i % 4:
                compress(c, get_method("streaming-llm"), 0.5 ** (i % 4))
            out.append(c)
        return out

    out: dict = dict(length=length, steps=steps, threads=threads, padding=[], quant=[])
    for round_ in range(2):
        for b in rows:
            for lengths in ("equal", "ragged"):
                for kind, make in (("packed", packed), ("padded", padded))[::1 if round_ == 0 else -1]:
                    caches = ragged(b) if lengths == "ragged" else [base.clone() for _ in range(b)]
                    ms = timed(make(caches))
                    out["padding"].append(dict(rows=b, lengths=lengths, kind=kind, round=round_, ms=ms,
                                               tokens=[c.layers[0].lengths()[0] for c in caches]))
                    log(f"  {b:>2} rows ({lengths} lengths), {kind}: {ms:.1f} ms a step")
        # a scheme with a decode kernel also without it (decoded into a buffer, then SDPA): what the kernel buys
        # and evicted rows of different lengths per head, read by the kernel and by SDPA head by head
        head_dim = base.layers[0].rows.kv_tensors()[0].shape[-1]
        variants = [("full", None, True)] + [(s, s, True) for s in schemes] + [
            (f"{s}, decoded then SDPA", s, False) for s in schemes if get_scheme(s, lm).has_decode_kernel(head_dim)] + [
            (f"{EVICTED_STEP}@0.25", "evicted", True), (f"{EVICTED_STEP}@0.25, SDPA head by head", "evicted", False)]
        for label, spec, kernel in variants[::1 if round_ == 0 else -1]:
            caches = [(evicted if spec == "evicted" else base).clone() for _ in range(rows[-1])]
            if spec not in (None, "evicted"):
                scheme = get_scheme(spec, lm)
                caches = [c.quantize(scheme) for c in caches]
            kv = sum(c.kv_bytes() for c in caches)
            with patch.object(KVLayer, "_decodes_in_place", KVLayer._decodes_in_place if kernel else lambda *a: False):
                ms = timed(packed(caches))
            out["quant"].append(dict(rows=rows[-1], scheme=label, round=round_, ms=ms, kv_bytes=kv))
            log(f"  {rows[-1]} rows, {label}: {ms:.1f} ms a step, {kv / 2**20:.0f} MiB of KV")
    return out
