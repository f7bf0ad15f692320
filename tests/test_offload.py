"""Offload-and-retrieve (compress/offload/): every policy on both families (SmolLM2's Llama GQA, Gemma-3's sliding
window + global layers): the policies retrieve different rows, retrieved rows are the tier's rows decoded (bit for
bit), resident bytes stay within the keep ratio (measured), rows really move, and bad options are refused by name."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvmem.cache import KVCache, storage_bytes
from kvmem.compress import OFFLOAD, Compressor, ModelContext, compress, get_method
from kvmem.compress.offload import OffloadedRows
from kvmem.errors import KVMemError
from kvmem.forward import feed

POLICIES = list(OFFLOAD)
FACTS = ["The red key opens the north gate.", "Mara planted seven olive trees in March.",
         "The lighthouse keeper is called Tobias Wren.", "Our train leaves from platform nineteen.",
         "The museum closes at half past four!", "Is the bridge made of granite? It is.",
         "Copper wire carries the signal to the valley.", "The festival lasts for eleven days.",
         "Ada keeps her notes in a green folder.", "The reservoir holds rain from the winter storms."]
CONTEXT = " ".join(FACTS * 3)
QUESTION = " Question: who is the lighthouse keeper? Answer:"
RATIO = 0.3


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def prefilled(request):
    """A family's model and a cache holding the context, prefilled once (every test works on copies)."""
    lm = request.getfixturevalue(request.param)
    ids = lm.tokenizer(CONTEXT).input_ids
    question = lm.tokenizer(QUESTION, add_special_tokens=False).input_ids
    base = KVCache(lm.model.config)
    feed(lm, base, ids)
    return lm, ids, question, base


def offloaded(prefilled, spec: str, ratio: float = RATIO) -> tuple[KVCache, list]:
    lm, ids, question, base = prefilled
    cache = base.clone()
    compress(cache, get_method(spec), ratio, context=ModelContext(lm, ids))
    return cache, feed(lm, cache, question)


def offloaded_layers(cache: KVCache) -> dict[int, OffloadedRows]:
    return {i: layer.rows for i, layer in enumerate(cache.layers) if isinstance(layer.rows, OffloadedRows)}


def test_global_layers_are_offloaded_and_sliding_ones_left_whole(prefilled):
    lm, ids, question, base = prefilled
    cache = base.clone()
    compress(cache, get_method("sentencekv"), RATIO, context=ModelContext(lm, ids))
    for i, layer in enumerate(cache.layers):
        if layer.is_sliding:  # its window bounds it already: the rows transformers' own layer would hold
            assert layer.rows.stacked()[2].tolist() == base.layers[i].rows.stacked()[2].tolist()
    assert torch.isfinite(feed(lm, cache, question)).all()
    layers = offloaded_layers(cache)
    assert set(layers) == {i for i, layer in enumerate(cache.layers) if not layer.is_sliding}
    for rows in layers.values():  # every context row is somewhere: in the tier or resident (sinks, recent)
        fixed_context = sum(int((p < len(ids)).sum()) for p in rows.fixed.positions()[:1])
        assert rows.tier.rows + fixed_context == len(ids)


def test_every_policy_retrieves_rows_of_its_own(prefilled):
    """No policy is another in disguise: on one input, every pair retrieves different rows somewhere."""
    chosen = {}
    for policy in POLICIES:
        cache, _ = offloaded(prefilled, policy)
        chosen[policy] = {(i, h): idx.tolist() for i, rows in offloaded_layers(cache).items()
                          for h, idx in enumerate(rows.ridx)}
        assert any(chosen[policy].values()), f"{policy} retrieved nothing"
    for a, b in itertools.combinations(POLICIES, 2):
        assert chosen[a] != chosen[b], f"{a} and {b} retrieved the same rows"


@pytest.mark.parametrize("policy", POLICIES)
def test_retrieved_rows_are_the_offloaded_rows_decoded(prefilled, policy):
    """tier=raw: the retrieved rows are the prefill's rows, bit for bit; int8: they are the tier's codes decoded, bit
    for bit, within the 8-bit step of the prefill's."""
    _, _, _, base = prefilled
    for tier in ("raw", "int8"):
        cache, _ = offloaded(prefilled, f"{policy}:tier={tier}")
        for i, rows in offloaded_layers(cache).items():
            original_k, original_v, _ = base.layers[i].rows.stacked()
            for h, idx in enumerate(rows.ridx):
                assert idx.numel() <= rows.capacity
                assert torch.equal(rows.rp[h], rows.tier.positions[h][idx])
                k, v = rows.tier.decode(h, idx)
                assert torch.equal(rows.rk[h], k) and torch.equal(rows.rv[h], v)
                want_k, want_v = original_k[h, rows.rp[h].long()], original_v[h, rows.rp[h].long()]
                if tier == "raw":
                    assert torch.equal(rows.rk[h], want_k) and torch.equal(rows.rv[h], want_v)
                else:
                    step = (want_k.amax() - want_k.amin()) / 255
                    assert 0 < (rows.rk[h] - want_k).abs().max() <= step


@pytest.mark.parametrize("policy", POLICIES)
def test_resident_bytes_stay_within_the_keep_ratio(prefilled, policy):
    """Measured: per offloaded layer, the context rows resident (sinks, recent, the retrieved rows at their peak) and the
    resident index hold at most the keep ratio of the layer's context bytes, through a question and decoding; the tier
    holds the rest packed (int8: under a third of the full bytes; sparq's tier holds the keys twice, row- and
    channel-major as its paper does: under half), and no full-precision copy is kept."""
    lm, ids, _, base = prefilled
    cache, logits = offloaded(prefilled, policy)
    for _ in range(4):
        logits = feed(lm, cache, [int(logits.argmax())])
    for i, rows in offloaded_layers(cache).items():
        full = storage_bytes(base.layers[i].kv_tensors())
        context = [(k[p < len(ids)], v[p < len(ids)]) for k, v, p in rows.fixed.heads()]
        fixed_bytes = sum(k.nbytes + v.nbytes for k, v in context)
        index_bytes = storage_bytes(rows.index.get("resident", []))
        assert rows.peak_retrieved_bytes > 0
        assert fixed_bytes + index_bytes + rows.peak_retrieved_bytes <= RATIO * full, (policy, i)
        assert storage_bytes(rows.offloaded_tensors()) < full / (2 if policy == "sparq" else 3)
        assert storage_bytes(rows.kv_tensors()) + storage_bytes(rows.offloaded_tensors()) < full
    assert cache.offloaded_bytes() > 0 and cache.retrieved_peak_bytes() > 0


def test_retrieval_moves_only_the_rows_not_yet_resident(prefilled):
    cache, _ = offloaded(prefilled, "sentencekv")
    rows = next(iter(offloaded_layers(cache).values()))
    held = [i.clone() for i in rows.ridx]
    keys = [k.clone() for k in rows.rk]
    before = rows.decoded_rows
    grown = [torch.cat([i[1:], torch.tensor([j for j in range(rows.tier.rows) if j not in set(i.tolist())][:1])])
             for i in held]  # one row out, one new row in, per head
    rows.load(grown)
    assert rows.decoded_rows - before == len(held)  # only the new row of each head came out of the tier
    for h, (old, new) in enumerate(zip(held, rows.ridx)):
        stay = torch.isin(new, old)
        assert torch.equal(rows.rk[h][stay], keys[h][torch.isin(old, new)])
        assert int((~torch.isin(old, new)).sum()) == 1  # the dropped row is gone from the buffer
    with pytest.raises(KVMemError, match="resident buffer holds"):
        rows.load([torch.arange(rows.capacity + 1)] * len(held))


def test_louiskv_retrieves_only_when_the_query_moves(prefilled):
    lm = prefilled[0]
    counts = {}
    for threshold in (0.0, 1.0):  # 0: every query is "close" (no boundary after the first); 1: every step is one
        cache, logits = offloaded(prefilled, f"louiskv:threshold={threshold}")
        for _ in range(3):
            logits = feed(lm, cache, [int(logits.argmax())])
        counts[threshold] = [rows.retrievals for rows in offloaded_layers(cache).values()]
    assert all(n == 1 for n in counts[0.0]) and all(n == 4 for n in counts[1.0])


def test_actqkv_cuts_off_by_information_density(prefilled):
    """A small mass keeps only the blocks the probe is sure of: fewer rows than the buffer takes (which mass=1 fills)."""
    full, _ = offloaded(prefilled, "actqkv:block=8:mass=1.0", 0.6)
    cut, _ = offloaded(prefilled, "actqkv:block=8:mass=0.05", 0.6)
    for (_, a), (_, b) in zip(offloaded_layers(full).items(), offloaded_layers(cut).items()):
        assert sum(i.numel() for i in b.ridx) < sum(i.numel() for i in a.ridx)


def test_sparq_reading_every_channel_retrieves_what_exact_topk_does(prefilled):
    """With every channel read (channels=1) its approximate scores are the exact ones, so on the same queries it
    fetches exact-topk's rows; with a quarter of them (the default) it fetches others."""
    from kvmem.compress.offload import ExactTopK, SparQ

    cache, _ = offloaded(prefilled, "sparq:tier=raw")
    rows = next(iter(offloaded_layers(cache).values()))
    torch.manual_seed(0)
    d = rows.rk[0].shape[-1]
    queries = [torch.randn(2, 3, d) * 4 for _ in rows.rk]
    exact = ExactTopK(tier="raw").retrieve(rows, queries, d ** -0.5)
    every = SparQ(tier="raw", channels=1.0).retrieve(rows, queries, d ** -0.5)
    quarter = SparQ(tier="raw").retrieve(rows, queries, d ** -0.5)
    assert [i.tolist() for i in every] == [i.tolist() for i in exact]
    assert [i.tolist() for i in quarter] != [i.tolist() for i in exact]


def test_sparq_reads_its_channels_from_a_channel_major_copy_of_the_keys(prefilled):
    """The second copy of the keys in the tier (channel-major, int8 in groups of rows) decodes to the context's keys
    within one 8-bit step of each group, for any channels asked; raw, exactly."""
    _, _, _, base = prefilled
    for tier in ("int8", "raw"):
        cache, _ = offloaded(prefilled, f"sparq:tier={tier}")
        for i, rows in offloaded_layers(cache).items():
            k, _, p = base.layers[i].rows.stacked()
            for h in range(k.shape[0]):
                channels = torch.tensor([0, 5, k.shape[-1] - 1])
                got = rows.method.channels_of(rows.index["by_channel"], h, channels, rows.tier.rows)
                want = k[h][torch.isin(p[h], rows.tier.positions[h])][:, channels].T
                if tier == "raw":
                    assert torch.equal(got, want)
                else:
                    assert (got - want).abs().max() <= (want.amax() - want.amin()) / 255 + 1e-6


def test_sparq_mean_value_step(prefilled):
    """Step 3: y = a * y_resident + (1 - a) * mean value. Fetching every tier row leaves nothing out (a = 1, the output
    unchanged); tier rows the queries favour but that were not fetched pull the output to the mean value."""
    cache, _ = offloaded(prefilled, "sparq")
    rows = next(iter(offloaded_layers(cache).values()))
    method, t = rows.method, rows.tier.rows
    group = 2
    q = torch.randn(1, group, 1, rows.rk[0].shape[-1])
    _, v, pos = rows.fixed.heads()[0]
    new_pos = pos.max()[None] + 1
    out = torch.randn(1, 1, group, q.shape[-1])
    share = torch.ones(group)
    masked, read = q[0].reshape(group, -1), torch.arange(q.shape[-1])
    rows.state["approx"] = [(torch.zeros(group, t), torch.arange(t), masked, read, share)]
    assert torch.allclose(method.interpolate(rows, 0, q, out, new_pos, 1e-9), out, atol=1e-5)
    rows.state["approx"] = [(torch.full((group, t), 1e3), torch.arange(0), masked, read, share)]  # all mass unfetched
    mean = (rows.index["value_sum"][0].float() + v.float().sum(0)) / (t + v.shape[0])
    got = method.interpolate(rows, 0, q, out, new_pos, 1e-9)
    assert torch.allclose(got, mean.expand_as(got), atol=1e-4)


def test_an_offloaded_cache_answers_through_the_one_call_path(smollm2):
    """`answer` (the CLI's and the suite's path) offloads, retrieves while answering and reports the resident bytes at
    their peak: within the keep ratio of the context's bytes plus the question's and answer's rows. (Whether the answer
    is right is the benchmark's to say: results/offload/.)"""
    from kvmem.generate import answer

    context = " ".join(FACTS * 2)
    for policy in POLICIES:
        a = answer(smollm2, context, "Who is the lighthouse keeper?", policy, 0.25, max_new_tokens=4)
        assert a.tokens and a.kv_bytes <= 0.27 * a.kv_bytes_full, (policy, a.kv_bytes / a.kv_bytes_full)


def test_an_offloaded_cache_is_not_stored_and_a_store_reuses_only_the_raw_prefix(smollm2):
    """Through a chunk store (the server's default path) the raw prefix is reused, and the offloaded cache is built
    from it each time, never stored as a compressed span: the resident rows are not the context, so a stored span
    would reload as a cache that lost its tier. Twice the same answer, the second from stored raw chunks."""
    from kvmem.generate import answer
    from kvmem.prompts import build_prompt
    from kvmem.store import ChunkStore

    store = ChunkStore("memory", chunk_size=32)
    context, question = " ".join(FACTS * 2), "Who is the lighthouse keeper?"
    first = answer(smollm2, context, question, "sparq", 0.25, max_new_tokens=6, store=store)
    second = answer(smollm2, context, question, "sparq", 0.25, max_new_tokens=6, store=store)
    assert second.reuse.reused_tokens > 0 and second.tokens == first.tokens
    assert second.kv_bytes == first.kv_bytes
    prompt = build_prompt(smollm2.tokenizer, context, question)
    assert store.span_key(smollm2, prompt.context, "sparq@0.25") not in store.tiers[0]._items


@pytest.mark.parametrize("policy", POLICIES)
def test_a_short_prompt_is_answered_with_nothing_offloaded(prefilled, policy):
    """A context that fits in the sink and recent rows (resident anyway) leaves every layer as it is, and the answer
    is the full cache's, token for token, rather than an error."""
    from kvmem.generate import answer

    lm = prefilled[0]
    context = FACTS[2]  # about a dozen tokens, under sink=4 + recent=32
    full = answer(lm, context, "Who is the lighthouse keeper?", "full", 1.0, max_new_tokens=6)
    short = answer(lm, context, "Who is the lighthouse keeper?", policy, 0.1, max_new_tokens=6)
    assert short.tokens == full.tokens and short.kv_bytes == full.kv_bytes


@pytest.mark.parametrize("spec, match", [("sentencekv:tier=int3", "tier"), ("ltri:span=0", "span"),
                                         ("louiskv:threshold=2", "threshold"), ("actqkv:mass=0", "mass"),
                                         ("sentencekv:sink=-1", "sink"), ("louiskv:cluster=0", "cluster"),
                                         ("sentencekv:budget=adaptive", "budget"), ("ltri:window=3", "window"),
                                         ("sparq:channels=0", "channels"), ("sparq:channels=1.5", "channels")])
def test_bad_options_are_refused_by_name(spec, match):
    with pytest.raises(KVMemError, match=match):
        get_method(spec)


def test_misuse_is_refused_by_name(prefilled):
    lm, ids, question, base = prefilled
    with pytest.raises(KVMemError, match="no room for retrieved rows"):
        compress(base.clone(), get_method("sentencekv:recent=64"), 0.05, context=ModelContext(lm, ids))
    with pytest.raises(KVMemError, match="sliding=compress"):
        compress(base.clone(), get_method("ltri:sliding=compress"), RATIO)
    with pytest.raises(KVMemError, match="token ids"):
        compress(base.clone(), get_method("sentencekv"), RATIO)
    with pytest.raises(KVMemError, match="offloads a prefilled cache"):
        Compressor(get_method("actqkv"), RATIO)
    evicted = base.clone()
    compress(evicted, get_method("snapkv"), 0.5)
    if any(not layer.is_sliding for layer in evicted.layers):
        with pytest.raises(KVMemError, match="no eviction"):
            compress(evicted, get_method("ltri"), RATIO)
    cache, _ = offloaded(prefilled, "ltri")
    layer = next(layer for layer in cache.layers if isinstance(layer.rows, OffloadedRows))
    with pytest.raises(KVMemError, match="not exported"):
        layer.export_rows()
    from kvmem.reuse.prefix import chunk_rows

    with pytest.raises(KVMemError, match="not exported"):  # what the store saves chunks and spans with
        chunk_rows(cache, 0, len(ids))
    from kvmem.generate import answer_batch

    with pytest.raises(KVMemError, match="answered alone"):
        answer_batch(lm, [cache], question, 2)
