"""The chunk store: keys, tiers (memory, disk, a real Redis), the verified frame, failures that degrade to
recompute, concurrency across processes, and a property test that a store returns what was put or nothing."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import tiny_model
from kvmem.cache import KVCache
from kvmem.errors import KVMemError
from kvmem.models import LoadedModel
from kvmem.reuse import prefill
from kvmem.store import ChunkStore, StoreWarning, chunk, get_codec
from kvmem.store.keys import chunk_keys, namespace
from kvmem.store.store import READ_AHEAD
from kvmem.store.tiers import DiskTier, MemoryTier, RedisTier, parse_stack

torch.set_num_threads(1)


class Vocab:
    def __init__(self, n: int = 128, shift: int = 0):
        self.n, self.shift = n, shift

    def get_vocab(self):
        return {f"t{i + self.shift}": i for i in range(self.n)}


def tiny_lm(kind: str = "llama", fingerprint: str | None = None, vocab_shift: int = 0) -> LoadedModel:
    return LoadedModel(f"tiny-{kind}", tiny_model(kind), Vocab(shift=vocab_shift), fingerprint or f"tiny-{kind}", 512)


@pytest.fixture(scope="module")
def lm():
    return tiny_lm()


IDS = torch.randint(1, 128, (90,), generator=torch.Generator().manual_seed(1)).tolist()


def run(lm, store, ids=IDS):
    cache = KVCache(lm.model.config)
    logits, report = prefill(lm, cache, ids, store)
    return logits, report, cache


# -- keys ----------------------------------------------------------------------------------------------
def test_keys_chain_over_the_whole_prefix_and_agree_across_processes():
    ns = namespace("m", "raw", 1, None, 16)
    a = chunk_keys(IDS, 16, ns)
    assert len(a) == 90 // 16
    changed = chunk_keys(IDS[:40] + [0] + IDS[41:], 16, ns)  # token 40 lies in chunk 2
    assert changed[:2] == a[:2] and all(x != y for x, y in zip(changed[2:], a[2:]))
    for other in (namespace("m2", "raw", 1, None, 16), namespace("m", "raw", 2, None, 16), namespace("m", "quant:kivi-8", 1, None, 16),
                  namespace("m", "raw", 1, "snapkv@0.5", 16)):
        assert not set(chunk_keys(IDS, 16, other)) & set(a)
    code = f"from kvmem.store.keys import chunk_keys, namespace; print(chunk_keys({IDS!r}, 16, namespace('m', 'raw', 1, None, 16))[-1])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ | {"PYTHONHASHSEED": "123"})
    assert out.stdout.strip() == a[-1]


# -- reuse is exact, and a damaged chunk is recomputed -----------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_raw_reuse_is_bit_identical(kind):
    lm = tiny_lm(kind)
    store = ChunkStore("memory", chunk_size=16)
    cold, r0, c0 = run(lm, store)
    warm, r1, c1 = run(lm, store)
    assert r0.reused_tokens == 0 and r0.chunks_saved == 5
    assert r1.reused_tokens == 80 and r1.computed_tokens == 10
    assert torch.equal(cold, warm)
    for a, b in zip(c0.layers, c1.layers):  # sliding layers (gemma) hold the same window
        assert a.lengths() == b.lengths() and a.compressed == b.compressed == False  # noqa: E712
        assert all(torch.equal(x, y) for x, y in zip(a.head_keys, b.head_keys))
    longer, r2, _ = run(lm, store, IDS + [3, 4, 5])
    _, _, c3 = run(lm, None, IDS + [3, 4, 5])
    assert r2.reused_tokens == 80
    ref = KVCache(lm.model.config)
    ref_logits, _ = prefill(lm, ref, IDS + [3, 4, 5], ChunkStore("memory", chunk_size=16))
    assert torch.equal(longer, ref_logits)


def _damage(kind: str, lm, store: ChunkStore, key: str) -> None:
    tier = store.tiers[0]
    blob = tier.get(key)
    if kind == "truncated":
        blob = blob[:len(blob) // 2]
    elif kind == "flipped byte":
        blob = bytearray(blob)
        blob[len(blob) - 100] ^= 0x01
        blob = bytes(blob)
    elif kind in ("other model", "other tokenizer", "old codec version"):
        other = tiny_lm(fingerprint="another-model" if kind == "other model" else lm.fingerprint,
                        vocab_shift=1 if kind == "other tokenizer" else 0)
        other_store = ChunkStore([MemoryTier()], chunk_size=16)
        if kind == "old codec version":
            other_store.codec = type(store.codec)()
            other_store.codec.version = 0
        _, _, cache = run(other, other_store)
        from kvmem.reuse.prefix import chunk_rows

        tensors, meta = other_store.codec.encode(chunk_rows(cache, 0, 16))
        header = other_store._header(other, key, 0, 16, None) | {"codec_meta": meta}
        blob = chunk.pack(tensors, header)  # a well-formed chunk, but not this model's / tokenizer's / codec's
    elif kind == "wrong rows":
        tensors, header = chunk.unpack(blob)
        tensors["0.keys"] = tensors["0.keys"][:, :-1].clone()  # layer 0's heads, stacked (raw codec version 2)
        blob = chunk.pack(tensors, header)  # checksum fine, rows short
    tier.put(key, blob)


def _reframed(payload_edit) -> bytes:
    """A frame around a payload edited after serialisation, with a checksum that matches: what a wrong writer makes."""
    import json as _json

    import xxhash

    blob = chunk.pack({"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.arange(4, dtype=torch.int32)},
                      {"key": "k"})
    payload = bytearray(blob[chunk.HEADER:])
    n = int.from_bytes(payload[:8], "little")
    entries = _json.loads(payload[8:8 + n])
    payload = bytes(payload_edit(payload, entries, n))
    head = min(8 + int.from_bytes(payload[:8], "little"), len(payload))  # the frame's digest covers the header
    return chunk.MAGIC + xxhash.xxh3_128_digest(payload[:head]) + payload


def _with_header(entries: dict, payload: bytearray, n: int) -> bytearray:
    import json as _json

    head = _json.dumps(entries, separators=(",", ":")).encode().ljust(n)
    assert len(head) == n
    return payload[:8] + head + payload[8 + n:]


@pytest.mark.parametrize("lie", ["header length", "offsets past the end", "shape larger than its bytes", "dtype"])
def test_a_frame_whose_checksum_matches_but_whose_payload_lies_is_refused(lie):
    def edit(payload, entries, n):
        if lie == "header length":
            return (len(payload) + 1).to_bytes(8, "little") + payload[8:]
        if lie == "offsets past the end":
            entries["a"]["data_offsets"] = [0, 10_000]
        elif lie == "shape larger than its bytes":
            entries["a"]["shape"] = [3, 3]
        else:
            entries["b"]["dtype"] = "Q9"
        return _with_header(entries, payload, n)

    with pytest.raises(chunk.CorruptChunk, match="does not parse" if lie != "header length" else "header length"):
        chunk.unpack(_reframed(edit))


def test_each_group_of_tensors_is_verified_on_its_own():
    """A frame's header is verified when it is opened, each layer's tensors (`l.*`) when they are read: a byte altered
    in layer 1 leaves layer 0 readable and layer 1 refused, and `unpack` (every group) refuses the chunk."""
    tensors = {f"{l}.{f}": torch.randn(3, 8) for l in range(3) for f in ("keys", "values")}
    blob = bytearray(chunk.pack(tensors, {"x": 1}))
    frame = chunk.open_frame(bytes(blob))
    assert frame.groups == ["0", "1", "2"] and torch.equal(frame.tensors["1.values"], tensors["1.values"])
    at = bytes(blob).index(tensors["1.values"].numpy().tobytes())  # a byte of layer 1's data, not of its header
    blob[at + 5] ^= 0x10
    frame = chunk.open_frame(bytes(blob))
    frame.verify("0")
    frame.verify("2")
    with pytest.raises(chunk.CorruptChunk, match=r"tensors 1\.\*"):
        frame.verify("1")
    with pytest.raises(chunk.CorruptChunk, match=r"tensors 1\.\*"):
        chunk.unpack(bytes(blob))
    header = bytearray(chunk.pack(tensors, {"x": 1}))
    header[chunk.HEADER + 20] ^= 0x01  # inside the safetensors header (its JSON)
    with pytest.raises(chunk.CorruptChunk, match="header checksum"):
        chunk.open_frame(bytes(header))


def test_a_frame_of_an_earlier_format_or_with_an_unhashed_tensor_is_refused():
    """A KVMEMCK2 frame (one digest for the whole payload) is not read as this format; a frame whose header lists a
    tensor that no digest covers (a wrong writer) is refused before any tensor is read."""
    import json as _json

    import xxhash

    blob = chunk.pack({"0.keys": torch.randn(2, 4)}, {"x": 1})
    with pytest.raises(chunk.CorruptChunk, match="not a kvmem chunk"):
        chunk.open_frame(b"KVMEMCK2" + blob[8:])

    def drop_digest(payload, entries, n):
        entries["__metadata__"]["digests"] = _json.dumps({})
        return _with_header(entries, payload, n)

    payload = bytearray(blob[chunk.HEADER:])
    n = int.from_bytes(payload[:8], "little")
    edited = bytes(drop_digest(payload, _json.loads(payload[8:8 + n]), n))
    with pytest.raises(chunk.CorruptChunk, match="covered by no digest"):
        chunk.open_frame(chunk.MAGIC + xxhash.xxh3_128_digest(edited[:8 + n]) + edited)


def test_unpacked_tensors_are_the_packed_ones_and_never_alias_the_stored_bytes():
    blob = chunk.pack({"k": torch.randn(5, 4), "p": torch.arange(5, dtype=torch.int32), "e": torch.empty(0, 4)}, {"x": 1})
    tensors, header = chunk.unpack(blob)
    assert header == {"x": 1} and tensors["e"].shape == (0, 4)
    tensors["k"].zero_()  # a cache that writes into imported rows must not change what the store holds
    again, _ = chunk.unpack(blob)
    assert again["k"].abs().sum() > 0 and torch.equal(again["p"], torch.arange(5, dtype=torch.int32))


def test_views_read_the_stored_bytes_in_place_and_the_prefix_loader_never_writes_them():
    """`unpack(views=True)` (the prefix loader's reads): the same tensors, in the blob's own memory (no copy); a warm
    prefill through a memory tier leaves every stored chunk byte for byte as it was written."""
    import numpy as np

    blob = chunk.pack({"k": torch.randn(5, 4), "p": torch.arange(5, dtype=torch.int32)}, {"x": 1})
    start = np.frombuffer(blob, dtype=np.uint8).ctypes.data
    viewed, header = chunk.unpack(blob, views=True)
    copied, _ = chunk.unpack(blob)
    assert header == {"x": 1} and all(torch.equal(viewed[k], copied[k]) for k in copied)
    assert all(start <= t.data_ptr() < start + len(blob) for t in viewed.values())
    assert not any(start <= t.data_ptr() < start + len(blob) for t in copied.values())
    lm = tiny_lm("llama")
    tier = MemoryTier()
    store = ChunkStore([tier], chunk_size=16)
    run(lm, store)
    before = {k: bytearray(v) for k, v in tier._items.items()}  # copies: the blobs themselves are what is viewed
    cold, _, _ = run(lm, None)
    warm, report, _ = run(lm, store)
    assert report.reused_tokens == 80 and torch.equal(cold, warm)
    assert {k: bytearray(v) for k, v in tier._items.items()} == before  # the same bytes under the same keys


@pytest.mark.parametrize("kind", ["truncated", "flipped byte", "other model", "other tokenizer", "old codec version", "wrong rows"])
def test_a_damaged_chunk_is_detected_and_recomputed(lm, kind):
    reference, _, _ = run(lm, ChunkStore("memory", chunk_size=16))
    store = ChunkStore("memory", chunk_size=16)
    run(lm, store)
    key = store.keys(lm, IDS)[2]
    _damage(kind, lm, store, key)
    with pytest.warns(StoreWarning, match="discarded"):
        logits, report, _ = run(lm, store)
    assert store.stats["corrupt"] == 1
    assert report.reused_tokens == 32  # chunks 0 and 1; chunk 2 was recomputed (and stored again)
    assert torch.equal(logits, reference)
    _, again, _ = run(lm, store)
    assert again.reused_tokens == 80


# -- failures degrade to recompute ---------------------------------------------------------------------
def test_unreachable_redis_degrades_to_recompute(lm):
    reference, _, _ = run(lm, None)
    store = ChunkStore("redis://127.0.0.1:1/0", chunk_size=16)  # nothing listens on port 1
    with pytest.warns(StoreWarning, match="failed"):
        logits, report, _ = run(lm, store)
    assert report.reused_tokens == 0 and store.stats["unavailable"] >= 1
    assert torch.allclose(logits, reference, atol=1e-5)


def test_full_and_read_only_tiers_degrade(lm, tmp_path):
    store = ChunkStore([MemoryTier(max_bytes=1000), DiskTier(tmp_path, readonly=True)], chunk_size=16)
    with pytest.warns(StoreWarning):
        _, report, _ = run(lm, store)
    assert store.stats["full"] == 5 and store.stats["read-only"] == 5 and report.chunks_saved == 0
    small = MemoryTier(max_bytes=3 * 10000)
    store = ChunkStore([small], chunk_size=16)
    run(lm, store)
    assert small.nbytes <= small.max_bytes and 0 < len(small) < 5  # the LRU kept what fits


def test_redis_killed_in_the_middle_of_a_run(lm, redis_server):
    reference, _, _ = run(lm, ChunkStore("memory", chunk_size=16))
    store = ChunkStore(f"memory,{redis_server.url}", chunk_size=16)
    run(lm, store)
    fresh = ChunkStore(redis_server.url, chunk_size=16)  # another process's view: everything comes from Redis
    logits, report, _ = run(lm, fresh)
    assert report.reused_tokens == 80 and torch.equal(logits, reference)
    redis_server.kill()
    try:
        with pytest.warns(StoreWarning, match="failed"):
            logits, report, _ = run(lm, ChunkStore(redis_server.url, chunk_size=16))
        assert report.reused_tokens == 0 and torch.equal(logits, reference)
        longer = IDS + list(range(1, 21))  # one more full chunk to write: the write to Redis fails, memory takes it
        expected, _, _ = run(lm, ChunkStore("memory", chunk_size=16), longer)
        with pytest.warns(StoreWarning, match="failed"):
            logits, report, _ = run(lm, store, longer)
        assert report.reused_tokens == 80 and report.chunks_saved == 1 and torch.equal(logits, expected)
    finally:
        redis_server.start()


def test_bad_store_specs_are_named_errors():
    for spec, match in (("ftp://x", "unknown store tier"), ("disk://", "names no folder"), ("memory?max=lots", "not a size"),
                        ("memory?size=1", "unknown option"), ("disk:///proc/no/such", "cannot create the folder")):
        with pytest.raises(KVMemError, match=match):
            parse_stack(spec)
    with pytest.raises(KVMemError, match="unknown codec"):
        get_codec("zip")
    with pytest.raises(KVMemError, match="chunk size"):
        ChunkStore("memory", chunk_size=0)
    with pytest.raises(KVMemError, match="not a multiple of quant:kivi-8's group of 32"):
        ChunkStore("memory", codec="quant:kivi-8", chunk_size=48)


def test_quant_codec_reuse_is_close_and_smaller(lm):
    raw, kivi = ChunkStore("memory", chunk_size=32), ChunkStore("memory", codec="quant:kivi-8:group=16", chunk_size=32)
    reference, _, _ = run(lm, raw)
    run(lm, kivi)
    logits, report, _ = run(lm, kivi)
    assert report.reused_tokens == 64
    assert not torch.equal(logits, reference) and torch.allclose(logits, reference, atol=0.05)
    assert kivi.tiers[0].nbytes < 0.6 * raw.tiers[0].nbytes  # 8 bits, and a scale and zero-point per 16 values


# -- concurrency across processes ----------------------------------------------------------------------
def _writer(root: str, key: str, n: int, seed: int) -> None:
    tier = DiskTier(root)
    for i in range(n):
        payload = torch.full((1000 + 97 * ((seed + i) % 7),), seed, dtype=torch.int32)
        tier.put(key, chunk.pack({"x": payload}, {"writer": seed}))


def _reader(root: str, key: str, n: int, queue) -> None:
    _read_while_written(DiskTier(root), key, n, queue)


def _read_while_written(tier, key: str, n: int, queue) -> None:
    """Read until `n` chunks were seen (writers start later than readers) or 60 s; count any that is not whole."""
    import time

    bad, seen, deadline = 0, 0, time.monotonic() + 60
    while seen < n and time.monotonic() < deadline:
        blob = tier.get(key)
        if blob is None:
            continue
        seen += 1
        try:
            tensors, header = chunk.unpack(blob)
            bad += int(not bool((tensors["x"] == header["writer"]).all()))
        except KVMemError:
            bad += 1
    queue.put((seen, bad))


@pytest.mark.parametrize("backend", ["disk", "redis"])
def test_concurrent_writers_and_readers_see_whole_chunks(tmp_path, backend, redis_server):
    key = "ab" * 20
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    if backend == "disk":
        writers = [ctx.Process(target=_writer, args=(str(tmp_path), key, 60, s)) for s in range(3)]
        readers = [ctx.Process(target=_reader, args=(str(tmp_path), key, 100, queue)) for _ in range(2)]
    else:
        writers = [ctx.Process(target=_redis_writer, args=(redis_server.url, key, 60, s)) for s in range(3)]
        readers = [ctx.Process(target=_redis_reader, args=(redis_server.url, key, 100, queue)) for _ in range(2)]
    for p in writers + readers:
        p.start()
    for p in writers + readers:
        p.join(120)
        assert p.exitcode == 0
    results = [queue.get(timeout=10) for _ in readers]
    assert sum(seen for seen, _ in results) > 0 and sum(bad for _, bad in results) == 0
    if backend == "disk":
        assert not list(tmp_path.glob("**/*.tmp"))  # no temporary file left behind


def _redis_writer(url, key, n, seed):
    tier = RedisTier(url)
    for i in range(n):
        payload = torch.full((1000 + 97 * ((seed + i) % 7),), seed, dtype=torch.int32)
        tier.put(key, chunk.pack({"x": payload}, {"writer": seed}))


def _redis_reader(url, key, n, queue):
    _read_while_written(RedisTier(url), key, n, queue)


# -- property: a stack returns what was put, or nothing --------------------------------------------------
KEYS = [f"{i:02x}" * 20 for i in range(6)]
OPS = st.lists(st.tuples(st.sampled_from(["put", "get", "delete", "evict-memory"]), st.sampled_from(KEYS),
                         st.binary(min_size=0, max_size=3000)), min_size=1, max_size=40)


def apply_store_ops(store: ChunkStore, memory: MemoryTier, ops, every_write_kept: bool) -> None:
    """Run `ops` on `store` (whose first tier is `memory`): every read returns the bytes last put under its key or,
    unless `every_write_kept` (a lower tier holds every write), a miss."""
    latest: dict[str, bytes] = {}
    for op, key, blob in ops:
        if op == "put":
            assert store.put_bytes(key, blob) or not every_write_kept
            latest[key] = blob
        elif op == "delete":
            store.discard(key)
            latest.pop(key, None)
        elif op == "evict-memory":
            memory.delete(key)
        else:
            got, _ = store.get_bytes(key)
            assert got == latest.get(key) or (got is None and not every_write_kept)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, write=st.sampled_from(["through", "memory"]))
def test_any_sequence_of_operations_returns_the_bytes_put_or_a_miss(tmp_path_factory, redis_server, ops, write):
    import redis

    redis.Redis.from_url(redis_server.url).flushdb()
    memory = MemoryTier(max_bytes=5000)  # small: the LRU evicts as it goes
    tiers = [memory, DiskTier(tmp_path_factory.mktemp("disk"), max_bytes=8000), RedisTier(redis_server.url)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoreWarning)
        apply_store_ops(ChunkStore(tiers, write=write), memory, ops, every_write_kept=False)


def test_reads_promote_and_writes_follow_the_policy(lm, tmp_path):
    memory, disk = MemoryTier(), DiskTier(tmp_path / "d")
    run(lm, ChunkStore([disk], chunk_size=16))  # only on disk
    store = ChunkStore([memory, disk], chunk_size=16)
    _, report, _ = run(lm, store)
    assert report.tiers == {disk.name: 5} and len(memory) == 5  # read from disk, promoted to memory
    _, report, _ = run(lm, store)
    assert report.tiers == {"memory": 5}
    memory_only = ChunkStore([MemoryTier(), DiskTier(tmp_path / "e")], chunk_size=16, write="memory")
    run(lm, memory_only)
    assert len(memory_only.tiers[0]) == 5 and not list((tmp_path / "e").glob("**/*.kvc"))


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_a_context_tail_is_reused_for_another_question(kind):
    lm = tiny_lm(kind)
    doc, q1, q2 = IDS[:70], [5, 6, 7, 8], [9, 10, 11]  # 70 = 4 chunks of 16 + a tail of 6
    store = ChunkStore("memory", chunk_size=16)
    _, first = prefill(lm, KVCache(lm.model.config), doc + q1, store, context_end=len(doc))
    assert first.chunks_saved == 5  # 4 chunks and the context's tail
    warm, second = prefill(lm, KVCache(lm.model.config), doc + q2, store, context_end=len(doc))
    assert second.reused_tokens == 70 and second.computed_tokens == 3
    cold, _ = prefill(lm, KVCache(lm.model.config), doc + q2, ChunkStore("memory", chunk_size=16), context_end=len(doc))
    assert torch.equal(warm, cold)  # the same pieces computed: bit-identical
    # another context with the same first 64 tokens: its full chunks are found, its tail is not
    _, other = prefill(lm, KVCache(lm.model.config), doc[:66] + [1, 2, 3, 4] + q2, store, context_end=70)
    assert other.reused_tokens == 64
    # a damaged tail is detected and recomputed
    key = store.span_key(lm, doc, "context-tail")
    blob = bytearray(store.tiers[0].get(key))
    blob[-10] ^= 0xFF
    store.tiers[0].put(key, bytes(blob))
    with pytest.warns(StoreWarning, match="discarded"):
        again, third = prefill(lm, KVCache(lm.model.config), doc + q2, store, context_end=len(doc))
    assert third.reused_tokens == 64 and torch.equal(again, cold)


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_a_context_tail_is_found_when_the_prompt_goes_on_past_the_context_end(kind):
    """A long question completes a chunk past the context's end: that chunk (context and question) misses for
    another question, and the context's partial last chunk is still found."""
    lm = tiny_lm(kind)
    doc, q1, q2 = IDS[:70], list(range(20, 50)), list(range(60, 90))  # the prompts' chunk 4 holds 6 + 10 question tokens
    store = ChunkStore("memory", chunk_size=16)
    prefill(lm, KVCache(lm.model.config), doc + q1, store, context_end=len(doc))
    warm, second = prefill(lm, KVCache(lm.model.config), doc + q2, store, context_end=len(doc))
    assert second.reused_tokens == 70 and second.computed_tokens == 30
    cold, _ = prefill(lm, KVCache(lm.model.config), doc + q2, ChunkStore("memory", chunk_size=16), context_end=len(doc))
    assert torch.equal(warm, cold)


class CountingTier(MemoryTier):
    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def get(self, key):
        self.reads.append(key)
        return super().get(key)


def test_a_run_of_loads_reads_one_ahead_and_stops_at_the_first_miss():
    """`open_run` gives what `load` gives, piece by piece, and after a miss reads nothing more (a verification
    failure costs at most the pieces read ahead)."""
    lm = tiny_lm("llama")
    tier = CountingTier()
    store = ChunkStore([tier], chunk_size=16)
    run(lm, store)
    keys = store.keys(lm, IDS)
    pieces = [(k, i * 16, 16, None, None) for i, k in enumerate(keys)]
    one_by_one = [store.load(lm, k, s, t) for k, s, t, _, _ in pieces]
    tier.reads.clear()
    together = [o.decoded() for o in store.open_run(lm, pieces)]
    assert sorted(tier.reads) == sorted(keys) and len(together) == len(one_by_one) == 5
    for a, b in zip(together, one_by_one):
        assert all(torch.equal(x["keys"], y["keys"]) for la, lb in zip(a.layers, b.layers) for x, y in zip(la.heads, lb.heads))
    tier.delete(keys[2])
    tier.reads.clear()
    got = list(store.open_run(lm, pieces))
    assert [g is not None for g in got] == [True, True, False]
    assert sorted(tier.reads) == sorted(keys[:2 + READ_AHEAD])  # the miss's piece and those read ahead of it
