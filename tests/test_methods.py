"""Each method scores what its paper says, checked against attention weights that transformers' own
eager attention computes on the real SmolLM2 (an independent path from kvmem's), and each method's
selection rule. A method quietly turning into another one fails here."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from kvmem.cache import KVCache
from kvmem.compress import METHODS, ModelContext, compress, get_method
from kvmem.compress.evict import head_views
from kvmem.errors import KVMemError
from kvmem.forward import feed
from kvmem.models import cache_dir

N_CTX = 150
GROUPS = 3  # SmolLM2: 9 query heads share 3 KV heads
LAYERS = (0, 7, 29)


@pytest.fixture(scope="module")
def prefilled(smollm2):
    ids = smollm2.tokenizer(open(__file__).read()).input_ids[:N_CTX]
    cache = KVCache(smollm2.model.config, observe_window=64, track_attention=True)
    feed(smollm2, cache, ids)
    eager = AutoModelForCausalLM.from_pretrained(cache_dir() / "models" / "smollm2-135m", attn_implementation="eager")
    with torch.no_grad():
        attentions = eager(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    return cache, [a[0] for a in attentions]  # per layer (query heads, T, T)


def group(attn, h):
    return attn[h * GROUPS:(h + 1) * GROUPS]


def test_h2o_scores_are_accumulated_attention(prefilled):
    cache, attn = prefilled
    for layer in LAYERS:
        for view in head_views(cache.layers[layer], layer):
            expected = group(attn[layer], view.head).sum(dim=1).mean(dim=0)  # column sums over all queries
            torch.testing.assert_close(get_method("h2o").score(view), expected, atol=2e-4, rtol=1e-3)


def test_snapkv_scores_are_pooled_window_votes(prefilled):
    cache, attn = prefilled
    for layer in LAYERS:
        for view in head_views(cache.layers[layer], layer):
            votes = group(attn[layer], view.head)[:, -32:, :].sum(dim=1).mean(dim=0)[:-32]
            expected = F.max_pool1d(votes[None, None], 7, stride=1, padding=3)[0, 0]
            score = get_method("snapkv").score(view)
            torch.testing.assert_close(score[:-32], expected, atol=2e-4, rtol=1e-3)
            assert torch.isinf(score[-32:]).all()  # the observation window is always kept


def test_tova_scores_are_last_token_attention_averaged_over_the_layers_heads(prefilled):
    cache, attn = prefilled
    for layer in LAYERS:
        scores = get_method("tova").score_layer(head_views(cache.layers[layer], layer))
        expected = attn[layer][:, -1, :].mean(dim=0)
        for s in scores:
            torch.testing.assert_close(s, expected, atol=2e-5, rtol=1e-3)


def test_knorm_keeps_the_lowest_key_norms(prefilled):
    cache = prefilled[0].clone()
    norms = [[k.norm(dim=-1) for k in layer.head_keys] for layer in cache.layers]
    positions = [[p.clone() for p in layer.head_positions] for layer in cache.layers]
    compress(cache, get_method("knorm"), 0.3)
    for li, layer in enumerate(cache.layers):
        for h, kept in enumerate(layer.head_positions):
            is_kept = torch.isin(positions[li][h], kept)
            assert norms[li][h][is_kept].max() <= norms[li][h][~is_kept].min()


def test_streaming_llm_keeps_sinks_and_recent(prefilled):
    cache = prefilled[0].clone()
    compress(cache, get_method("streaming-llm"), 0.2)
    n_keep = math.ceil(0.2 * N_CTX)
    expected = list(range(4)) + list(range(N_CTX - (n_keep - 4), N_CTX))
    for layer in cache.layers:
        for p in layer.head_positions:
            assert p.tolist() == expected


def test_h2o_keeps_recent_half_plus_heavy_hitters(prefilled):
    cache = prefilled[0].clone()
    heavy_scores = [get_method("h2o").score(v) for v in head_views(cache.layers[7], 7)]
    compress(cache, get_method("h2o"), 0.2)
    n_keep = math.ceil(0.2 * N_CTX)
    n_recent = n_keep // 2
    for h, kept in enumerate(cache.layers[7].head_positions):
        assert kept[-n_recent:].tolist() == list(range(N_CTX - n_recent, N_CTX))
        older = heavy_scores[h][: N_CTX - n_recent]
        assert sorted(kept[:-n_recent].tolist()) == sorted(older.topk(n_keep - n_recent).indices.tolist())


def test_random_is_seeded_and_not_another_method(prefilled):
    a, b = prefilled[0].clone(), prefilled[0].clone()
    compress(a, get_method("random"), 0.3)
    compress(b, get_method("random"), 0.3)
    s = prefilled[0].clone()
    compress(s, get_method("streaming-llm"), 0.3)
    assert a.layers[3].head_positions[0].tolist() == b.layers[3].head_positions[0].tolist()
    assert a.layers[3].head_positions[0].tolist() != s.layers[3].head_positions[0].tolist()
    assert a.layers[3].head_positions[0].tolist() != a.layers[3].head_positions[1].tolist()


def kept_positions(cache, spec: str, ratio: float, context=None) -> list[list[list[int]]]:
    c = cache.clone()
    compress(c, get_method(spec), ratio, context=context)
    return [[p.tolist() for p in layer.head_positions] for layer in c.layers]


def test_keydiff_keeps_the_keys_least_like_the_mean_direction(prefilled):
    cache = prefilled[0]
    for layer in LAYERS:
        for view in head_views(cache.layers[layer], layer):
            keys = view.keys
            mean = (keys / keys.norm(dim=-1, keepdim=True)).mean(dim=0)
            expected = -(keys @ mean) / (keys.norm(dim=-1) * mean.norm())
            torch.testing.assert_close(get_method("keydiff").score(view), expected, atol=1e-5, rtol=1e-4)
    keydiff = kept_positions(cache, "keydiff", 0.3)
    assert keydiff != kept_positions(cache, "random", 0.3) and keydiff != kept_positions(cache, "knorm", 0.3)


def test_keydiff_kernel_size_pools_the_scores_so_neighbours_come_along(prefilled):
    """kernel_size max-pools keydiff's scores (SnapKV's pooling): a row scores the best of its neighbourhood, so
    the kept rows come in runs around distinctive keys; kernel 1 is the paper's scorer."""
    cache = prefilled[0]
    view = head_views(cache.layers[LAYERS[0]], LAYERS[0])[0]
    plain, pooled = get_method("keydiff").score(view), get_method("keydiff:kernel_size=9").score(view)
    torch.testing.assert_close(get_method("keydiff:kernel_size=1").score(view), plain)
    torch.testing.assert_close(pooled, F.max_pool1d(plain[None, None], 9, stride=1, padding=4)[0, 0])
    best = int(plain.argmax())
    assert (pooled[max(0, best - 4):best + 5] == plain[best]).all()  # the best key's neighbours score as it does
    kept = kept_positions(cache, "keydiff:kernel_size=9", 0.3)
    assert kept != kept_positions(cache, "keydiff", 0.3) and kept != kept_positions(cache, "random", 0.3)
    with pytest.raises(KVMemError, match="odd kernel_size"):
        get_method("keydiff:kernel_size=8")


def test_curdkv_scores_are_windowed_key_times_value_leverage(prefilled):
    cache = prefilled[0]
    view = head_views(cache.layers[7], 7)[1]
    k2, v2 = view.keys.pow(2).sum(-1), view.values.pow(2).sum(-1)
    local = lambda x: torch.cat([w / w.sum() for w in x.split(16)])  # noqa: E731
    expected = local(k2) * local(v2)
    score = get_method("curdkv").score(view)
    assert torch.isinf(score[:4]).all()  # sinks
    torch.testing.assert_close(score[4:], expected[4:], atol=1e-6, rtol=1e-4)
    curdkv = kept_positions(cache, "curdkv", 0.3)
    assert curdkv != kept_positions(cache, "random", 0.3) and curdkv != kept_positions(cache, "knorm", 0.3)
    assert curdkv != kept_positions(cache, "curdkv:rank=20", 0.3)  # the random projection is an option, not the default


def test_kvzip_scores_are_max_attention_while_reconstructing(smollm2, prefilled):
    """One chunk covers this context, so KVzip's softmax (over sink, chunk and repeat tokens) is attention
    over the whole sequence: eager attention of context + repeat prompt + context, max over each KV
    head's queries in the repeat, is the score."""
    from kvmem.compress.kvzip import REPEAT_FIRST, KVzip
    from kvmem.prompts import user_turn_end

    cache, _ = prefilled
    ids = smollm2.tokenizer(open(__file__).read()).input_ids[:N_CTX]
    tok = smollm2.tokenizer
    repeat = tok(REPEAT_FIRST, add_special_tokens=False).input_ids + user_turn_end(tok) + ids
    eager = AutoModelForCausalLM.from_pretrained(cache_dir() / "models" / "smollm2-135m", attn_implementation="eager")
    with torch.no_grad():
        attn = eager(input_ids=torch.tensor([ids + repeat]), output_attentions=True).attentions
    scores = KVzip().pair_scores(cache, ModelContext(smollm2, ids))
    for layer in LAYERS:
        for h in range(3):
            expected = group(attn[layer][0], h)[:, N_CTX:, :N_CTX].amax(dim=(0, 1))
            torch.testing.assert_close(scores[layer][h], expected, atol=2e-5, rtol=1e-3)
    context = ModelContext(smollm2, ids)
    kvzip = kept_positions(cache, "kvzip", 0.3, context)
    heads = [len(p) for layer in kvzip for p in layer]
    assert len(set(heads)) > 1 and abs(sum(heads) - 90 * math.ceil(0.3 * N_CTX)) <= 90  # global budget, same total
    assert kvzip != kept_positions(cache, "h2o:budget=global", 0.3) and kvzip != kept_positions(cache, "random", 0.3)
    assert kvzip != kept_positions(cache, "kvzip:budget=uniform", 0.3, context)


def test_kvzip_says_what_chunk_fits_when_the_context_is_nearly_full(smollm2, prefilled):
    from kvmem.errors import KVMemError

    cache, _ = prefilled
    ids = smollm2.tokenizer(open(__file__).read()).input_ids[:N_CTX]
    with pytest.raises(KVMemError, match="use a chunk of at most 10 tokens"):
        kvzip_on_a_model_ending_after(smollm2, cache, ids, room=10)
    with pytest.raises(KVMemError, match="no chunk fits"):
        kvzip_on_a_model_ending_after(smollm2, cache, ids, room=-5)


def kvzip_on_a_model_ending_after(lm, cache, ids, room: int):
    """KVzip on a model whose context ends `room` tokens after the repeat prompt of the cached context."""
    import dataclasses

    from kvmem.compress.kvzip import REPEAT_FIRST, KVzip
    from kvmem.prompts import user_turn_end

    prompt = len(lm.tokenizer(REPEAT_FIRST, add_special_tokens=False).input_ids + user_turn_end(lm.tokenizer))
    small = dataclasses.replace(lm, max_context=cache.get_seq_length() + prompt + room)
    return KVzip().pair_scores(cache, ModelContext(small, ids))


def test_expected_attention_from_pre_rope_query_statistics(smollm2, prefilled):
    """Independent path: pre-RoPE queries straight from q_proj, the future rotations from the model's own
    rotary embedding (kvmem de-rotates its stored queries with the frequencies instead)."""
    cache, _ = prefilled
    ids = smollm2.tokenizer(open(__file__).read()).input_ids[:N_CTX]
    model, layer = smollm2.model, 7
    captured = {}
    hook = model.model.layers[layer].self_attn.q_proj.register_forward_hook(lambda m, i, o: captured.update(q=o))
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    hook.remove()
    d = 64
    q = captured["q"][0].view(N_CTX, 9, d).transpose(0, 1)[:, -64:]  # (heads, window, D) before RoPE
    cos, sin = model.model.rotary_emb(q, torch.arange(N_CTX, N_CTX + 512)[None])
    eye = torch.eye(d)
    rot_half = torch.cat([-eye[d // 2:], eye[:d // 2]])  # rotate_half as a matrix: P @ x
    rot = (cos[0][:, :, None] * eye + sin[0][:, :, None] * rot_half).mean(0)
    mu = q.mean(1) @ rot.T
    cov = torch.stack([rot @ torch.cov(h.T, correction=0) @ rot.T for h in q])
    method = get_method("expected-attention")
    scores = method.score_cache({layer: head_views(cache.layers[layer], layer)}, cache, ModelContext(smollm2, ids))[layer]
    for view, score in zip(head_views(cache.layers[layer], layer), scores):
        g = slice(view.head * GROUPS, (view.head + 1) * GROUPS)
        k = view.keys
        logits = k @ mu[g].T / 8 + torch.einsum("ti,gij,tj->tg", k, cov[g], k) / 64 / 2
        expected = logits.softmax(0).mean(1) * view.values.norm(dim=-1)
        assert torch.isinf(score[:4]).all()
        torch.testing.assert_close(score[4:], expected[4:], atol=1e-6, rtol=2e-3)
    context = ModelContext(smollm2, ids)
    ea = kept_positions(cache, "expected-attention", 0.3, context)
    assert ea != kept_positions(cache, "random", 0.3) and ea != kept_positions(cache, "snapkv", 0.3)
    assert ea != kept_positions(cache, "expected-attention:covariance=false", 0.3, context)


def test_calibration_artefacts_are_refitted_when_the_fingerprint_or_params_change(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from kvmem import calibration

    monkeypatch.setenv("KVMEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "_LOADED", {})
    fits = []

    def fit():
        fits.append(1)
        return {"w": torch.full((2,), float(len(fits)))}

    lm = SimpleNamespace(name="m", fingerprint="aaa")
    assert calibration.load_or_fit(lm, "probe", {"n": 1}, fit)["w"].tolist() == [1.0, 1.0]
    calibration._LOADED.clear()
    assert calibration.load_or_fit(lm, "probe", {"n": 1}, fit)["w"].tolist() == [1.0, 1.0]  # read from disk
    calibration._LOADED.clear()
    other = SimpleNamespace(name="m", fingerprint="bbb")  # same model name, other weights
    assert calibration.load_or_fit(other, "probe", {"n": 1}, fit)["w"].tolist() == [2.0, 2.0]
    calibration._LOADED.clear()
    assert calibration.load_or_fit(other, "probe", {"n": 2}, fit)["w"].tolist() == [3.0, 3.0]
    calibration.artefact_path("probe", "m", {"n": 2}).write_bytes(b"corrupt")
    calibration._LOADED.clear()
    assert calibration.load_or_fit(other, "probe", {"n": 2}, fit)["w"].tolist() == [4.0, 4.0]


def test_q_filters_are_the_signed_dominant_query_direction(smollm2, prefilled, tmp_path, monkeypatch):
    from kvmem import calibration
    from kvmem.compress.q_filters import fit_filters

    monkeypatch.setenv("KVMEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "_LOADED", {})
    filters = fit_filters(smollm2, sequences=1, length=256, samples=256, seed=0)
    cache, _ = prefilled
    q = cache.layers[7].observation.recent_queries  # 64 post-RoPE queries of other text, per query head
    for h in range(3):
        proj = q[h * GROUPS:(h + 1) * GROUPS] @ filters["layer.7"][h]
        assert (proj < 0).float().mean() > 0.8  # the filter points away from typical queries, as in the paper
    method = get_method("q-filters:sequences=1:length=256:samples=256")
    context = ModelContext(smollm2, [])
    view = head_views(cache.layers[7], 7)[2]
    torch.testing.assert_close(method.score_cache({7: [view]}, cache, context)[7][0], -(view.keys @ filters["layer.7"][2]))
    qf = kept_positions(cache, "q-filters:sequences=1:length=256:samples=256", 0.3, context)
    assert qf != kept_positions(cache, "random", 0.3) and qf != kept_positions(cache, "knorm", 0.3)


def test_kvzip_head_keeps_whole_heads_ranked_by_their_best_pair_score(smollm2, prefilled, tmp_path, monkeypatch):
    from kvmem import calibration

    monkeypatch.setenv("KVMEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "_LOADED", {})
    cache, _ = prefilled
    spec = "kvzip-head:sequences=1:length=200"
    context = ModelContext(smollm2, [])
    ranking = get_method(spec).head_scores(smollm2)
    kept = kept_positions(cache, spec, 0.3, context)
    full = {(i, h) for i, layer in enumerate(kept) for h, p in enumerate(layer) if len(p) == N_CTX}
    assert 20 <= len(full) <= 27  # 30 % of 90 heads' tokens, in whole heads (plus one partial head)
    flat = sorted(((float(ranking[f"layer.{i}"][h]), (i, h)) for i in range(30) for h in range(3)), reverse=True)
    assert {lh for _, lh in flat[:len(full)]} == full  # exactly the best-ranked heads
    ids = smollm2.tokenizer(open(__file__).read()).input_ids[:N_CTX]
    assert kept != kept_positions(cache, "kvzip", 0.3, ModelContext(smollm2, ids))  # its pair-level sibling
    assert kept != kept_positions(cache, "random", 0.3)


def test_retrieval_head_probes_find_a_few_heads(smollm2):
    from kvmem.compress.retrieval_heads import echo_induction_scores, needle_copy_scores

    for scores in (needle_copy_scores(smollm2, samples=2, length=400, seed=1),
                   echo_induction_scores(smollm2, length=100, repeats=3, seed=1)):
        flat = torch.cat([scores[f"layer.{i}"] for i in range(30)])
        assert flat.max() > 0.5  # some heads do it most of the time
        assert (flat > 0.3).sum() <= 20  # and most heads do not


def test_duo_budget_keeps_the_probed_retrieval_heads_whole(smollm2, prefilled):
    cache, _ = prefilled
    context = ModelContext(smollm2, [])
    kept = kept_positions(cache, "streaming-llm:budget=duo", 0.5, context)
    lengths = [len(p) for layer in kept for p in layer]
    assert N_CTX in lengths and len(set(lengths)) == 2  # retrieval heads whole, streaming heads equal
    streaming = next(p for layer in kept for p in layer if len(p) < N_CTX)
    assert streaming[:4] == [0, 1, 2, 3] and streaming[-1] == N_CTX - 1  # sinks + recent, from the scorer
    assert kept != kept_positions(cache, "streaming-llm", 0.5)


def test_razor_budget_compensates_what_each_streaming_head_dropped(smollm2, prefilled):
    cache, _ = prefilled
    context = ModelContext(smollm2, [])
    c = cache.clone()
    compress(c, get_method("streaming-llm:budget=razor"), 0.5, context=context)
    streaming = 0
    for layer in c.layers:
        weights = layer.log_weights or [torch.zeros(n) for n in layer.lengths()]
        for p, w in zip(layer.head_positions, weights):
            if len(p) == N_CTX:  # a retrieval head: everything, nothing weighted
                assert not w.any()
                continue
            streaming += 1
            (row,) = w.nonzero()[:, 0].tolist()  # one compensation row, standing for every dropped token
            n_dropped = N_CTX - (len(p) - 1)
            assert w[row].item() == pytest.approx(math.log(n_dropped))
            kept = set(p.tolist()) - {int(p[row])}
            assert int(p[row]) == max(set(range(N_CTX)) - kept)  # at the last dropped position
    assert streaming > 0
    assert kept_positions(cache, "streaming-llm:budget=razor", 0.5, context) != \
        kept_positions(cache, "streaming-llm:budget=duo", 0.5, context)  # another probe ranks the heads
    logits = feed(smollm2, c, smollm2.tokenizer(" and", add_special_tokens=False).input_ids)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", ["smollm2", "qwen", "gemma3"])
def test_every_method_frees_memory_and_still_generates(name, request):
    lm = request.getfixturevalue(name)
    ids = lm.tokenizer("The quick brown fox jumps over the lazy dog. " * 25).input_ids
    base = KVCache(lm.model.config, observe_window=64, track_attention=True)
    feed(lm, base, ids)
    context = ModelContext(lm, ids)
    for method in METHODS:
        if method == "full":
            continue
        if METHODS[method].decode_phase:  # keeps the prompt whole: compresses the rows generated after it
            _decode_phase_frees_memory_and_still_generates(lm, ids, get_method(method))
            continue
        cache = base.clone()
        result = compress(cache, get_method(method), 0.5, context=context)
        assert 0.45 < result.fraction_kept < 0.56, method
        assert cache.kv_bytes() == result.kv_bytes_after < base.kv_bytes()
        logits = feed(lm, cache, lm.tokenizer(" The quick", add_special_tokens=False).input_ids)
        assert torch.isfinite(logits).all()


def _decode_phase_frees_memory_and_still_generates(lm, ids: list[int], method) -> None:
    from kvmem.generate import new_cache

    cache = new_cache(lm, method)
    feed(lm, cache, ids)
    generated = lm.tokenizer(" The quick brown fox jumps over the lazy dog." * 2, add_special_tokens=False).input_ids
    for t in generated:
        feed(lm, cache, [t])
    before = cache.kv_bytes()
    result = compress(cache, method, 0.5)
    assert cache.kv_bytes() == result.kv_bytes_after < before
    kept = len(ids) + math.ceil(0.5 * len(generated))
    assert all(n == kept for layer in cache.tokens_held() for n in layer), method.name
    logits = feed(lm, cache, lm.tokenizer(" The quick", add_special_tokens=False).input_ids)
    assert torch.isfinite(logits).all()
