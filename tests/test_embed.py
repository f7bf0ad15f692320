"""kvmem.embed and the retrieval benchmark: shapes, pooling correctness, batching, quantization, metrics."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from kvmem.embed import (EMBEDDERS, bytes_per_vector, get_embedder, hamming_scores, int8_scales, int8_scores,
                         quantize_embeddings)
from kvmem.errors import KVMemError
from kvmem_bench.retrieval.runner import metrics, ranks, run_retrieval, score
from kvmem_bench.retrieval.sets import load_set

LM_METHODS = ("mean", "last", "prompteol", "echo", "token-prepending", "kv-embedding")
OPTIONS = {"kv-embedding": {"layers": range(8, 15)}}  # explicit: the ID rule's calibration takes ~90 s
TEXTS = ["The cat sat on the mat.", "Quantum computers use qubits to solve some problems much faster.",
         "Paris is the capital of France.", "A very long sentence about key-value caches, attention sinks, "
         "and the many ways a small language model can be made to remember less while losing little."]


@pytest.fixture(scope="module")
def embedded(smollm2):
    return {m: get_embedder(m, smollm2, **OPTIONS.get(m, {})).encode(TEXTS, batch_size=4) for m in LM_METHODS}


def _hidden(lm, text: str, layer: int) -> torch.Tensor:
    ids = lm.tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        return lm.model(input_ids=ids, output_hidden_states=True).hidden_states[layer][0]


def test_registry_names():
    assert set(EMBEDDERS) == {"mean", "last", "prompteol", "echo", "token-prepending", "kv-embedding", "minilm", "tfidf"}


def test_shapes_single_string_and_normalisation(smollm2, embedded):
    dim = smollm2.config.hidden_size
    for m, e in embedded.items():
        assert e.shape == (len(TEXTS), dim) and e.dtype == np.float32, m
        assert np.isfinite(e).all()
    emb = get_embedder("last", smollm2)
    one = emb.encode(TEXTS[0])
    assert one.shape == (dim,)
    np.testing.assert_allclose(one, embedded["last"][0], atol=1e-4)
    normed = emb.encode(TEXTS, normalize_embeddings=True)
    np.testing.assert_allclose(np.linalg.norm(normed, axis=1), 1.0, atol=1e-5)
    assert not np.allclose(np.linalg.norm(embedded["last"], axis=1), 1.0, atol=1e-2)


def test_deterministic_and_batch_independent(smollm2, embedded):
    for m in LM_METHODS:
        emb = get_embedder(m, smollm2, **OPTIONS.get(m, {}))
        again = emb.encode(TEXTS, batch_size=4)
        np.testing.assert_array_equal(again, embedded[m])
        alone = np.stack([emb.encode([t], batch_size=1)[0] for t in TEXTS])  # no padding at all
        scale = np.abs(alone).max()
        np.testing.assert_allclose(embedded[m], alone, atol=1e-4 * scale, err_msg=m)


def test_methods_and_layers_differ(smollm2, embedded):
    for a in LM_METHODS:
        for b in LM_METHODS:
            if a < b:
                assert not np.allclose(embedded[a], embedded[b], atol=1e-2), (a, b)
    mid = get_embedder("mean", smollm2, layer=10).encode(TEXTS)
    assert not np.allclose(mid, embedded["mean"], atol=1e-2)
    both = get_embedder("mean", smollm2).encode_layers(TEXTS, [10, 30], batch_size=3)
    np.testing.assert_allclose(both[10], mid, atol=1e-3 * np.abs(mid).max())
    np.testing.assert_allclose(both[30], embedded["mean"], atol=1e-4 * np.abs(mid).max())


def test_pooling_matches_a_manual_forward(smollm2, embedded):
    text = TEXTS[1]
    h = _hidden(smollm2, text, 30)
    np.testing.assert_allclose(embedded["mean"][1], h[1:].mean(0).numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(embedded["last"][1], h[-1].numpy(), rtol=1e-4, atol=1e-4)
    with_sink = get_embedder("mean", smollm2, layer=15, skip_first=False).encode(text)
    h15 = _hidden(smollm2, text, 15)
    np.testing.assert_allclose(with_sink, h15.mean(0).numpy(), rtol=1e-4, atol=1e-3)
    assert h15[0].norm() > 10 * h15[1:].norm(dim=-1).median()  # the attention sink the default skips
    assert len(smollm2.tokenizer("Hi").input_ids) == 1  # a one-token text keeps its token
    np.testing.assert_allclose(get_embedder("mean", smollm2).encode("Hi"), _hidden(smollm2, "Hi", 30)[0].numpy(),
                               rtol=1e-4, atol=1e-4)
    p = _hidden(smollm2, f'This sentence : "{text}" means in one word:"', 30)[-1]
    np.testing.assert_allclose(embedded["prompteol"][1], p.numpy(), rtol=1e-4, atol=1e-4)
    prefix = f"Rewrite the sentence: {text}\nRewritten sentence:"
    n_prefix = len(smollm2.tokenizer(prefix).input_ids)
    e = _hidden(smollm2, f"{prefix} {text}", 30)[n_prefix:].mean(0)
    np.testing.assert_allclose(embedded["echo"][1], e.numpy(), rtol=1e-4, atol=1e-4)


def test_int8_and_binary_round_trips():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 64)).astype(np.float32) * rng.uniform(0.1, 10, size=64).astype(np.float32)
    q = quantize_embeddings(x, "int8")
    assert q.dtype == np.int8 and q.shape == x.shape and q.nbytes == 50 * bytes_per_vector(64, "int8")
    scale = int8_scales(x)
    assert np.abs(q).max() == 127
    assert np.all(np.abs(q * scale - x) <= scale / 2 + 1e-6)  # error at most half a step per dimension
    np.testing.assert_array_equal(int8_scores(q[:3], q), q[:3].astype(np.int64) @ q.astype(np.int64).T)
    clipped = quantize_embeddings(x * 2, "int8", calibration=x)  # outside the calibration range: clipped
    assert np.abs(clipped).max() == 127 and (np.abs(clipped) == 127).sum() > (np.abs(q) == 127).sum()
    b = quantize_embeddings(x[:, :60], "binary")
    assert b.dtype == np.uint8 and b.shape == (50, 8) and bytes_per_vector(60, "binary") == 8
    np.testing.assert_array_equal(np.unpackbits(b, axis=1)[:, :60], (x[:, :60] > 0).astype(np.uint8))
    hs = hamming_scores(b, b)
    assert (np.diag(hs) == 64).all()  # 60 bits + 4 zero padding bits all match
    manual = 64 - sum(bin(int(v)).count("1") for v in np.bitwise_xor(b[0], b[1]))
    assert hs[0, 1] == manual
    assert bytes_per_vector(64, "float32") == 256


def test_encode_precisions(smollm2):
    emb = get_embedder("last", smollm2)
    f = emb.encode(TEXTS)
    q = emb.encode(TEXTS, precision="int8", calibration=f)
    np.testing.assert_array_equal(q, quantize_embeddings(f, "int8", f))
    b = emb.encode(TEXTS, precision="binary")
    assert b.shape == (len(TEXTS), smollm2.config.hidden_size // 8) and b.dtype == np.uint8


def test_bad_input_errors(smollm2):
    emb = get_embedder("mean", smollm2)
    with pytest.raises(KVMemError, match="unknown embedding method"):
        get_embedder("nope", smollm2)
    with pytest.raises(KVMemError, match="model="):
        get_embedder("echo")
    with pytest.raises(KVMemError, match="precision"):
        emb.encode(TEXTS, precision="float16")
    with pytest.raises(KVMemError, match="empty list"):
        emb.encode([])
    with pytest.raises(KVMemError, match="empty"):
        emb.encode(["fine", "  "])
    with pytest.raises(KVMemError, match="batch_size"):
        emb.encode(TEXTS, batch_size=0)
    with pytest.raises(KVMemError, match="layer 31 out of range"):
        get_embedder("last", smollm2, layer=31)
    with pytest.raises(KVMemError, match="out of range"):
        emb.encode_layers(TEXTS, [40])
    with pytest.raises(KVMemError, match="fitted"):
        get_embedder("tfidf").encode(TEXTS)
    with pytest.raises(KVMemError, match="exactly twice"):
        get_embedder("echo", smollm2, template="{text}")
    with pytest.raises(KVMemError, match="unknown retrieval set"):
        load_set("nope")


def test_tfidf_and_minilm():
    tfidf = get_embedder("tfidf").fit(TEXTS)
    e = tfidf.encode(["cats on mats", "capital city of France"])
    assert e.shape == (2, len(tfidf.vectorizer.vocabulary_))
    assert e[1] @ tfidf.encode(TEXTS[2]) > e[1] @ tfidf.encode(TEXTS[0])
    minilm = get_embedder("minilm")
    m = minilm.encode(["A kitten rests on a rug.", *TEXTS], normalize_embeddings=True)
    assert m.shape == (5, 384)
    sims = m[1:] @ m[0]
    assert sims.argmax() == 0  # the paraphrase, with no shared content word


def test_metrics_on_hand_made_rankings():
    m = metrics(np.array([1, 2, 11, 4]))
    assert m["ndcg@10"] == pytest.approx((1 + 1 / math.log2(3) + 0 + 1 / math.log2(5)) / 4)
    assert m["mrr@10"] == pytest.approx((1 + 1 / 2 + 0 + 1 / 4) / 4)
    assert m["recall@1"] == 0.25 and m["recall@10"] == 0.75
    scores = np.array([[0.9, 0.1, 0.5], [0.3, 0.3, 0.2], [0.0, 0.2, 0.1]])
    np.testing.assert_array_equal(ranks(scores, [0, 1, 2]), [1, 2, 2])  # a tie counts against the relevant doc
    q = np.array([[1.0, 0.2], [-0.3, -1.0]], dtype=np.float32)
    d = np.array([[2.0, 0.1], [-0.1, -3.0], [-1.0, 0.5]], dtype=np.float32)
    for p in ("float32", "int8", "binary"):
        np.testing.assert_array_equal(ranks(score(q, d, p), [0, 1]), [1, 1], err_msg=p)
        np.testing.assert_array_equal(ranks(score(q, d, p), [1, 0]), [2, 3] if p != "binary" else [3, 3], err_msg=p)


def test_retrieval_end_to_end(tmp_path):
    out = tmp_path / "retrieval"  # results/retrieval, as the README block reads it
    rows = run_retrieval(["smollm2-135m"], ["mean", "tfidf"], ["abstracts", "questions"], out,
                         layers=[10, -1], limit=12)
    assert len(rows) == 2 * (2 + 1) * 3  # sets x (mean at 2 layers + tfidf) x precisions
    saved = json.loads((out / "results.json").read_text())
    assert saved == rows
    assert {r["layer"] for r in rows if r["method"] == "mean"} == {10, 30}
    for r in rows:
        assert r["n_queries"] == 12 and r["n_docs"] == 12
        assert 0 <= r["recall@1"] <= r["mrr@10"] <= r["recall@10"] <= 1 and 0 <= r["ndcg@10"] <= 1
    tfidf = next(r for r in rows if (r["set"], r["method"], r["precision"]) == ("abstracts", "tfidf", "float32"))
    assert tfidf["recall@1"] >= 0.5  # openings share words with the rest of their abstract
    sizes = {r["precision"]: r["bytes_per_vector"] for r in rows if r["method"] == "mean"}
    assert sizes == {"float32": 576 * 4, "int8": 576, "binary": 72}
    report = (out / "report.md").read_text()
    assert "## abstracts" in report and "## questions" in report and (out / "ndcg_by_layer.png").exists()
    f32 = {(r["set"], r["layer"]): r["ndcg@10"] for r in rows if r["method"] == "mean" and r["precision"] == "float32"}
    chosen = max((f32[("questions", layer)], layer) for layer in (10, 30))[1]  # the questions set picks for abstracts
    assert f"| smollm2-135m | mean | {f32[('abstracts', 30)]:.3f} | {chosen} | {f32[('abstracts', chosen)]:.3f} |" in report
    again = run_retrieval(["smollm2-135m"], ["mean", "tfidf"], ["abstracts"], out, layers=[10, -1], limit=12)
    assert again == rows  # everything was in records.jsonl: nothing recomputed, nothing lost

    from kvmem_bench.readme import update_readme

    readme = tmp_path / "README.md"
    readme.write_text("a\n<!-- results: x -->\nKEPT\n<!-- /results -->\nb\n<!-- retrieval: y -->\nSTALE\n<!-- /retrieval -->\nc\n")
    assert update_readme("retrieval", readme=readme, results=tmp_path) == ["retrieval"]
    text = readme.read_text()
    assert "STALE" not in text and "KEPT" in text and text.startswith("a\n") and text.endswith("c\n")
    assert f"| mean | {f32[('abstracts', chosen)]:.3f} (layer {chosen}) |" in text
