"""Non-prefix chunk reuse (kvmem.reuse.blend): moved keys, the limits of the recompute ratio, what CacheBlend
recomputes, infoflow's selection, sliding windows, bad inputs. Tiny random models, one check on SmolLM2."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from kvmem.cache import KVCache
from kvmem.errors import KVMemError
from kvmem.forward import feed
from kvmem.models import LoadedModel
from kvmem.reuse.blend import assemble_and_answer, precompute
from kvmem.rope import move, rope_frequencies



def _lm(model, name: str = "tiny", max_context: int = 512) -> LoadedModel:
    return LoadedModel(name, model, None, name, max_context)


@pytest.fixture(scope="module")
def tiny_llama4():
    """Four layers, so that some come after CacheBlend's check layer (1)."""
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return _lm(AutoModelForCausalLM.from_config(cfg, attn_implementation="kvmem", dtype=torch.float32).eval(), "tiny4")


def _prompt(seed: int = 1, sizes=(12, 9, 15)):
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, 128, (n,), generator=g).tolist()  # noqa: E731
    return ids(5), [ids(n) for n in sizes], ids(6)


def _setup(lm, seed: int = 1, sizes=(12, 9, 15)):
    head, docs, q = _prompt(seed, sizes)
    return head, docs, q, [precompute(lm, d, head) for d in docs]


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]


def _rows(cache: KVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lay = cache.layers[layer]
    return torch.stack(lay.head_keys), torch.stack(lay.head_values), lay.head_positions[0]


@pytest.mark.parametrize("kind", ["tiny_llama", "tiny_gemma"])
def test_moved_keys_are_the_keys_at_the_new_position(kind, request):
    lm = _lm(request.getfixturevalue(kind))
    head, docs, q, pre = _setup(lm)
    full = KVCache(lm.model.config)
    feed(lm, full, head + docs[0] + docs[1] + q)
    n0 = len(head) + len(docs[0])
    for layer, lay in enumerate(full.layers):
        if lay.is_sliding:
            continue  # the full cache keeps only the window there; DocKV keeps every row
        k, v, _ = _rows(full, layer)
        stored = pre[0].layers[layer].heads
        # the first document directly after the head is exactly what a full prefill computes
        assert torch.allclose(torch.stack([h["keys"] for h in stored]), k[:, len(head):n0], atol=1e-6)
        assert torch.allclose(torch.stack([h["values"] for h in stored]), v[:, len(head):n0], atol=1e-6)
    # the second document, computed after the head only, moved to its place: at layer 0 (where keys depend on the
    # token and its position only) the moved keys are the keys a full prefill computes there
    full = KVCache(lm.model.config)
    feed(lm, full, head + docs[0] + docs[1])
    k, _, held = _rows(full, 0)  # a sliding layer 0 (Gemma) holds the last window - 1 positions: compare those
    rows = pre[1].layers[0].heads
    new_pos = torch.arange(n0, n0 + len(docs[1]))
    moved = move(torch.stack([h["keys"] for h in rows]), rows[0]["positions"], new_pos, rope_frequencies(lm.model, 0))
    both = held >= n0
    assert both.sum() >= 5
    assert torch.allclose(moved[:, held[both].long() - n0], k[:, both], atol=1e-5)
    assert not torch.allclose(torch.stack([h["keys"] for h in rows]), moved, atol=1e-3)  # it did move


@pytest.mark.parametrize("kind", ["tiny_llama", "tiny_gemma"])
def test_ratio_one_is_full_prefill_and_zero_is_none(kind, request):
    lm = _lm(request.getfixturevalue(kind))
    head, docs, q, pre = _setup(lm)  # documents longer than Gemma's window (8): sliding layers matter
    ref = _logits(lm.model, head + sum(docs, []) + q)
    full = assemble_and_answer(lm, head, pre, q, "full", max_new_tokens=0)
    blend1 = assemble_and_answer(lm, head, pre, q, "cacheblend", 1.0, max_new_tokens=0)
    assert torch.allclose(full.logits, ref, atol=1e-4) and torch.allclose(blend1.logits, ref, atol=1e-4)
    assert blend1.compute_fraction == 1.0 and full.compute_fraction == 1.0
    flow1 = assemble_and_answer(lm, head, pre, q, "infoflow", 1.0, max_new_tokens=0)
    assert sorted(flow1.order) == [0, 1, 2]  # a full prefill of the reordered documents
    assert torch.allclose(flow1.logits, _logits(lm.model, head + sum((docs[i] for i in flow1.order), []) + q), atol=1e-4)
    none = assemble_and_answer(lm, head, pre, q, "none", max_new_tokens=0)
    blend0 = assemble_and_answer(lm, head, pre, q, "cacheblend", 0.0, max_new_tokens=0)
    assert torch.allclose(blend0.logits, none.logits, atol=1e-4)
    assert not torch.allclose(none.logits, ref, atol=1e-3)  # reuse without repair does lose something here
    n_layers = lm.model.config.num_hidden_layers
    assert none.token_layers == n_layers * len(q) and blend0.selected.numel() == 0
    # the cache continues decoding as the full prefill's does (sliding layers hold their last window - 1 rows)
    extra = [3, 7]
    for layer, lay in enumerate(blend1.cache.layers):
        n = blend1.cache.get_seq_length()
        assert lay.head_positions[0].tolist() == list(range(max(n - lay.sliding_window + 1, 0) if lay.is_sliding else 0, n))
    assert torch.allclose(feed(lm, blend1.cache, extra), feed(lm, full.cache, extra), atol=1e-4)


def test_cacheblend_recomputes_only_the_selected_tokens(tiny_llama4):
    lm = tiny_llama4
    head, docs, q, pre = _setup(lm)
    n_docs, ratio = sum(map(len, docs)), 0.25
    res = assemble_and_answer(lm, head, pre, q, "cacheblend", ratio, max_new_tokens=0, check_layer=1)
    none = assemble_and_answer(lm, head, pre, q, "none", max_new_tokens=0)
    k = round(ratio * n_docs)
    assert res.selected.numel() == k
    assert res.layer_tokens == [n_docs + len(q)] * 2 + [k + len(q)] * 2
    assert res.token_layers == sum(res.layer_tokens) and res.full_token_layers == 4 * (n_docs + len(q))
    doc_pos = torch.arange(len(head), len(head) + n_docs)
    chosen = torch.isin(doc_pos, res.selected)
    first_doc = doc_pos < len(head) + len(docs[0])
    assert not chosen[first_doc].any()  # the first document deviates by nothing: its KV is what full prefill has
    for layer in range(1, 4):  # from the check layer on, unselected rows are the cached (moved) ones, untouched
        k_b, v_b, _ = _rows(res.cache, layer)
        k_n, v_n, _ = _rows(none.cache, layer)
        rest = doc_pos[~chosen]
        assert torch.equal(k_b[:, rest], k_n[:, rest]) and torch.equal(v_b[:, rest], v_n[:, rest])
        assert not torch.allclose(v_b[:, res.selected], v_n[:, res.selected], atol=1e-6)


def test_infoflow_selects_by_the_question_and_reorders(tiny_llama4):
    lm = tiny_llama4
    head, docs, q, pre = _setup(lm, seed=3, sizes=(20, 14, 18, 10))
    flow = assemble_and_answer(lm, head, pre, q, "infoflow", 0.2, max_new_tokens=0)
    blend = assemble_and_answer(lm, head, pre, q, "cacheblend", 0.2, max_new_tokens=0)
    assert sorted(flow.order) == [0, 1, 2, 3] and blend.order == [0, 1, 2, 3]
    assert flow.selected.numel() == blend.selected.numel() == round(0.2 * 62)
    assert set(flow.selected.tolist()) != set(blend.selected.tolist())
    reordered = flow.order != [0, 1, 2, 3]
    assert flow.layer_tokens == [flow.selected.numel() + len(q)] * 4
    assert flow.token_layers == sum(flow.layer_tokens) + (2 if reordered else 1) * 4 * len(q)
    assert [len(s) for s in flow.spans] == [len(docs[i]) for i in flow.order]
    ids = head + sum((docs[i] for i in flow.order), []) + q
    assert torch.allclose(assemble_and_answer(lm, head, pre, q, "infoflow", 1.0, max_new_tokens=0).logits,
                          _logits(lm.model, ids), atol=1e-4)


def test_bad_inputs_are_clear_errors(tiny_llama):
    lm = _lm(tiny_llama)
    head, docs, q, pre = _setup(lm)
    for ratio in (-0.1, 1.5):
        with pytest.raises(KVMemError, match="recompute ratio must be in"):
            assemble_and_answer(lm, head, pre, q, "cacheblend", ratio)
    with pytest.raises(KVMemError, match="at least one document"):
        assemble_and_answer(lm, head, [], q)
    with pytest.raises(KVMemError, match="no tokens"):
        precompute(lm, [], head)
    with pytest.raises(KVMemError, match="question has no tokens"):
        assemble_and_answer(lm, head, pre, [])
    with pytest.raises(KVMemError, match="unknown reuse method"):
        assemble_and_answer(lm, head, pre, q, "prefix")
    with pytest.raises(KVMemError, match="another head"):
        assemble_and_answer(lm, head[1:], pre, q)
    with pytest.raises(KVMemError, match="context too long"):
        assemble_and_answer(_lm(tiny_llama, max_context=50), head, pre, q, max_new_tokens=8)
    with pytest.raises(KVMemError, match="context too long"):
        precompute(_lm(tiny_llama, max_context=10), docs[0], head)
    with pytest.raises(KVMemError, match="check_layer"):
        assemble_and_answer(lm, head, pre, q, check_layer=5)


def test_smollm2_repair_at_ratio_one_answers_as_full_prefill(smollm2):
    from kvmem_bench.rag.runner import make_sample, prompt_ids
    import random

    sample = make_sample("cross-doc", random.Random("blend-test"), k=3)
    head, doc_ids, q = prompt_ids(smollm2.tokenizer, sample)
    doc_ids = [d[:60] for d in doc_ids]  # short, to keep the test fast
    pre = [precompute(smollm2, d, head) for d in doc_ids]
    full = assemble_and_answer(smollm2, head, pre, q, "full", max_new_tokens=4)
    blend = assemble_and_answer(smollm2, head, pre, q, "cacheblend", 1.0, max_new_tokens=4)
    assert torch.allclose(blend.logits, full.logits, atol=1e-3)
    assert blend.tokens == full.tokens
    part = assemble_and_answer(smollm2, head, pre, q, "cacheblend", 0.15, max_new_tokens=0)
    assert 0.1 < part.compute_fraction < 0.4  # 2 of 30 layers in full, then 15 % of the documents + the question


def test_rag_samples_and_report(tmp_path):
    from kvmem_bench.rag import runner as rag

    samples = rag.make_samples(3, seed=0)
    assert samples == rag.make_samples(3, seed=0) and {s.kind for s in samples} == set(rag.KINDS)
    for s in samples:
        assert len(s.docs) == 5 and sum(s.answers[0] in d for d in s.docs) == 1
        if s.kind == "cross-doc":  # the statement runs over the boundary of two neighbouring chunks
            a, b = s.fact_docs
            person = s.answer_prefix.removesuffix("'s office is in room")
            assert b == a + 1 and s.docs[a].endswith(f" project is led by {person}.")
            assert s.docs[b].startswith("The project leader's office is in room " + s.answers[0])
    recs = [dict(model="m", kind=k, sample=i, method=m, recompute_ratio=r, score=float((i + len(m)) % 2),
                 compute_fraction=1.0 if m == "full" else 0.2, wall_s=1.0)
            for k in rag.KINDS for i in range(6) for m, r in [("full", None), ("none", None), ("cacheblend", 0.15)]]
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    rag.write_summary(tmp_path)
    rows = json.loads((tmp_path / "summary.json").read_text())
    blend = next(r for r in rows if r["method"] == "cacheblend" and r["questions"] == "all")
    assert blend["n"] == 12 and "vs_none" in blend and "vs_full" in blend
    assert "| cacheblend r=0.15 |" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "score_vs_compute.png").stat().st_size > 0
    with pytest.raises(KVMemError, match="unknown reuse methods"):
        rag.run_rag(methods=["prefix"], out=tmp_path)


def test_documents_are_kept_in_the_store_and_verified(tiny_llama4):
    import warnings

    from kvmem.reuse.blend import document_key, load_document, precomputed
    from kvmem.store import ChunkStore, StoreWarning

    class Vocab:
        def get_vocab(self):
            return {str(i): i for i in range(128)}

    lm = LoadedModel("tiny4", tiny_llama4.model, Vocab(), "tiny4", 512)
    head, docs, question = _prompt()
    store = ChunkStore("memory", chunk_size=16)
    first = [precomputed(store, lm, d, head) for d in docs]
    again = [load_document(store, lm, d, head) for d in docs]
    assert all(a is not None and all(torch.equal(x["keys"], y["keys"]) for r, q in zip(a.layers, f.layers)
                                     for x, y in zip(r.heads, q.heads)) for a, f in zip(again, first))
    assert load_document(store, lm, docs[0], head[:-1]) is None  # another head: another key
    ref = assemble_and_answer(lm, head, first, question, "cacheblend", 0.3, max_new_tokens=0)
    got = assemble_and_answer(lm, head, again, question, "cacheblend", 0.3, max_new_tokens=0)
    assert torch.equal(ref.logits, got.logits)
    key = document_key(store, lm, docs[1], head)
    blob = bytearray(store.tiers[0].get(key))
    blob[-5] ^= 0x10
    store.tiers[0].put(key, bytes(blob))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert load_document(store, lm, docs[1], head) is None
    assert any(issubclass(w.category, StoreWarning) for w in seen)
