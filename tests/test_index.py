"""kvmem.embed.index.VectorIndex: exact search = numpy brute force, HNSW recall, remove, verified save/load."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmem.embed.base import PRECISIONS, hamming_scores, int8_scores, quantize_embeddings
from kvmem.embed.index import VectorIndex
from kvmem.errors import KVMemError


def brute(queries: np.ndarray, docs: np.ndarray, precision: str, calibration: np.ndarray | None = None) -> np.ndarray:
    """(nq, nd) scores by base.py's own functions; int8 codes use the index's calibration (the first add)."""
    if precision == "float32":
        return queries.astype(np.float64) @ docs.astype(np.float64).T
    if precision == "binary":
        return hamming_scores(np.packbits(queries > 0, axis=-1), np.packbits(docs > 0, axis=-1))
    cal = docs if calibration is None else calibration
    return int8_scores(quantize_embeddings(queries, "int8", cal), quantize_embeddings(docs, "int8", cal))


def assert_valid_topk(keys: np.ndarray, scores: np.ndarray, full: np.ndarray, k: int) -> None:
    """keys/scores are a top-k of `full` (doc i has key i): right scores, best first, ties in any order."""
    assert keys.shape == scores.shape == (len(full), min(k, full.shape[1]))
    best = -np.sort(-full, axis=1)[:, :keys.shape[1]]
    for row in range(len(full)):
        assert len(set(keys[row].tolist())) == keys.shape[1]
        np.testing.assert_allclose(scores[row], best[row], rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(full[row, keys[row]], scores[row], rtol=1e-5, atol=1e-4)


def make(precision: str, docs: np.ndarray, exact: bool = True) -> VectorIndex:
    index = VectorIndex(docs.shape[1], precision, exact=exact)
    index.add(np.arange(len(docs)), docs)
    return index


@pytest.mark.parametrize("precision", PRECISIONS)
def test_exact_search_equals_brute_force(precision):
    rng = np.random.default_rng(0)
    docs, queries = rng.standard_normal((500, 50), dtype=np.float32), rng.standard_normal((30, 50), dtype=np.float32)
    keys, scores = make(precision, docs).search(queries, 10)
    full = brute(queries, docs, precision)
    assert keys.dtype == np.int64 and scores.dtype == np.float32
    assert_valid_topk(keys, scores, full, 10)
    if precision == "float32":  # no ties in continuous scores: the very keys of numpy's argsort
        assert (keys == np.argsort(-full, axis=1)[:, :10]).all()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 60), dim=st.integers(1, 40), k=st.integers(1, 70),
       precision=st.sampled_from(PRECISIONS))
def test_exact_search_equals_brute_force_with_ties(seed, n, dim, k, precision):
    rng = np.random.default_rng(seed)  # small integers: many ties and zeros
    docs = rng.integers(-2, 3, (n, dim)).astype(np.float32)
    queries = rng.integers(-2, 3, (5, dim)).astype(np.float32)
    keys, scores = make(precision, docs).search(queries, k)
    assert_valid_topk(keys, scores, brute(queries, docs, precision), k)


def test_int8_scales_fixed_by_calibrate_or_first_add():
    rng = np.random.default_rng(1)
    calib, docs, more = (rng.standard_normal((n, 32), dtype=np.float32) for n in (100, 200, 50))
    queries = 2 * rng.standard_normal((10, 32), dtype=np.float32)  # beyond the calibrated range: clipped
    explicit = VectorIndex(32, "int8")
    explicit.calibrate(calib)
    explicit.add(np.arange(200), docs)
    assert_valid_topk(*explicit.search(queries, 10), brute(queries, docs, "int8", calib), 10)
    implicit = make("int8", docs)  # scales from the first add, kept for the second
    implicit.add(np.arange(200, 250), more)
    assert_valid_topk(*implicit.search(queries, 10), brute(queries, np.vstack([docs, more]), "int8", docs), 10)
    with pytest.raises(KVMemError, match="calibrate before"):
        implicit.calibrate(calib)
    with pytest.raises(KVMemError, match="int8"):
        VectorIndex(32, "binary").calibrate(calib)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_hnsw_recall_at_10(precision):
    rng = np.random.default_rng(2)
    docs, queries = rng.standard_normal((2000, 64), dtype=np.float32), rng.standard_normal((100, 64), dtype=np.float32)
    index = make(precision, docs, exact=False)
    found, _ = index.search(queries, 10)
    full = brute(queries, docs, precision)
    index.exact = True  # the same graph searched exhaustively: the brute-force top-k
    assert_valid_topk(*index.search(queries, 10), full, 10)
    tenth = -np.sort(-full, axis=1)[:, 9:10]  # a hit is a doc scoring at least the 10th best (binary has ties)
    recall = (np.take_along_axis(full, found, axis=1) >= tenth - 1e-4).mean()
    assert recall >= 0.9, f"{precision} HNSW recall@10 = {recall:.3f}"


@pytest.mark.parametrize("exact", [True, False])
def test_remove(exact):
    rng = np.random.default_rng(3)
    docs, queries = rng.standard_normal((300, 16), dtype=np.float32), rng.standard_normal((20, 16), dtype=np.float32)
    index = make("float32", docs, exact)
    gone = np.arange(0, 300, 3)
    index.remove(gone)
    assert len(index) == 200 and 0 not in index and 1 in index
    keys, _ = index.search(queries, 10)
    assert not np.isin(keys, gone).any()
    if exact:
        full = brute(queries, docs, "float32")
        full[:, gone] = -np.inf
        assert (keys == np.argsort(-full, axis=1)[:, :10]).all()
    with pytest.raises(KVMemError, match="not in the index"):
        index.remove([1, 3])
    assert 1 in index  # a failed remove removes nothing
    index.add(np.array([3]), docs[3:4])
    assert 3 in index and len(index) == 201


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("exact", [True, False])
def test_save_load_round_trip(tmp_path, precision, exact):
    rng = np.random.default_rng(4)
    docs, queries = rng.standard_normal((400, 40), dtype=np.float32), rng.standard_normal((25, 40), dtype=np.float32)
    index = make(precision, docs, exact)
    index.remove([5, 7])
    index.save(tmp_path / "v.idx")
    loaded = VectorIndex.load(tmp_path / "v.idx")
    assert (loaded.dim, loaded.precision, loaded.exact, len(loaded)) == (40, precision, exact, 398)
    assert loaded.bytes == index.bytes and 5 not in loaded and 6 in loaded
    for a, b in zip(index.search(queries, 10), loaded.search(queries, 10)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(KVMemError, match="expected 41-d"):
        VectorIndex.load(tmp_path / "v.idx", dim=41)
    with pytest.raises(KVMemError, match="cannot write"):
        index.save(tmp_path / "no-such-dir" / "v.idx")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("idx") / "ok.idx"
    make("int8", np.random.default_rng(5).standard_normal((30, 24), dtype=np.float32)).save(path)
    return path.read_bytes()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corrupt_file_raises(tmp_path, saved, data):
    path = tmp_path / "bad.idx"
    if data.draw(st.booleans()):
        at = data.draw(st.integers(0, len(saved) - 1), label="flipped byte")
        bad = saved[:at] + bytes([saved[at] ^ 0xFF]) + saved[at + 1:]
    else:
        bad = saved[:data.draw(st.integers(0, len(saved) - 1), label="truncated to")]
    path.write_bytes(bad)
    with pytest.raises(KVMemError, match="bad.idx"):
        VectorIndex.load(path)


def test_load_errors_name_the_problem(tmp_path, saved):
    path = tmp_path / "x.idx"
    with pytest.raises(KVMemError, match="cannot read"):
        VectorIndex.load(path)
    path.write_bytes(b"not an index at all")
    with pytest.raises(KVMemError, match="bad magic"):
        VectorIndex.load(path)
    path.write_bytes(saved[:-1])
    with pytest.raises(KVMemError, match="truncated"):
        VectorIndex.load(path)
    path.write_bytes(saved[:-1] + bytes([saved[-1] ^ 1]))
    with pytest.raises(KVMemError, match="checksum"):
        VectorIndex.load(path)
    path.write_bytes(saved)
    with pytest.raises(KVMemError, match="binary"):
        VectorIndex.load(path, precision="binary")


def test_bad_input_raises():
    rng = np.random.default_rng(6)
    index = make("float32", rng.standard_normal((20, 8), dtype=np.float32))
    bad_calls = {
        "shape": lambda: index.search(np.zeros((2, 9), np.float32), 3),  # wrong-dimension query
        "shape ": lambda: index.add([100], np.zeros((1, 7), np.float32)),
        "finite": lambda: index.add([100], np.full((1, 8), np.nan, np.float32)),
        "finite ": lambda: index.search(np.full(8, np.inf, np.float32), 3),
        "positive": lambda: index.search(np.zeros(8, np.float32), 0),
        "already in the index": lambda: index.add([3], np.zeros((1, 8), np.float32)),
        "duplicate": lambda: index.add([100, 100], np.zeros((2, 8), np.float32)),
        "non-negative": lambda: index.add([-1], np.zeros((1, 8), np.float32)),
        "2 keys for 1": lambda: index.add([100, 101], np.zeros((1, 8), np.float32)),
        "unknown precision": lambda: VectorIndex(8, "float16"),
        "dimension": lambda: VectorIndex(0),
    }
    for message, call in bad_calls.items():
        with pytest.raises(KVMemError, match=message.strip()):
            call()
    assert len(index) == 20 and 100 not in index


def test_search_shapes_and_empty_index():
    empty = VectorIndex(8, "binary")
    keys, scores = empty.search(np.ones((3, 8), np.float32), 5)
    assert keys.shape == scores.shape == (3, 0)
    index = make("binary", np.random.default_rng(7).standard_normal((4, 8), dtype=np.float32))
    keys, scores = index.search(np.ones(8, np.float32), 10)  # one 1-D query; k capped at len(index)
    assert keys.shape == (1, 4) and sorted(keys[0].tolist()) == [0, 1, 2, 3] and (np.diff(scores[0]) <= 0).all()
