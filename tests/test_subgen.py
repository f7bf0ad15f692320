"""`subgen` (compress/subgen.py): SubGen's estimator N^/D^ (l2-sampled values, clustered keys) stored as weighted rows:
checked against the estimator computed directly from the same samples, for unbiasedness over seeds, and on the real
SmolLM2 (its own rows, memory freed, generation, refusals, the one-call API and the CLI)."""

from __future__ import annotations

import math

import pytest
import torch
from typer.testing import CliRunner

from kvmem.cache import KVCache
from kvmem.cli import load_plugins
from kvmem.compress import METHODS, Compressor, compress, get_method
from kvmem.compress.base import HeadView
from kvmem.compress.subgen import SubGen
from kvmem.errors import KVMemError
from kvmem.forward import feed

T, D, KEEP = 300, 16, 80
TEXT = ("The history of the city begins with a small fishing village on the river. Merchants arrived, built "
        "warehouses, and a market grew around the old stone bridge. ") * 12


def synthetic(seed: int = 0, log_weights: bool = False) -> tuple[HeadView, torch.Tensor]:
    """A head of random keys (in a few loose clusters) and values of uneven norms, and 24 random queries."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(12, D, generator=g) * 2
    keys = centres[torch.randint(12, (T,), generator=g)] + 0.5 * torch.randn(T, D, generator=g)
    values = torch.randn(T, D, generator=g) * (torch.rand(T, 1, generator=g) + 0.2)
    view = HeadView(layer=3, head=1, keys=keys, values=values, positions=torch.arange(T), queries=torch.zeros(0, 0, 0),
                    query_positions=torch.arange(0), attention=None, scaling=1 / math.sqrt(D), sliding_window=None,
                    log_weights=0.5 * torch.randn(T, generator=g) if log_weights else None)
    return view, torch.randn(24, D, generator=g)


def terms(view: HeadView, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """exp(q.k s + the row's log-weight): each row's term of the full head's sums, float64."""
    logits = (q.double() @ view.keys[rows].double().T) * view.scaling
    return (logits + (view.log_weights[rows].double() if view.log_weights is not None else 0)).exp()


def exact(view: HeadView, q: torch.Tensor) -> torch.Tensor:
    a = terms(view, q, torch.arange(T))
    return (a @ view.values.double()) / a.sum(dim=1, keepdim=True)


def compressed(method: SubGen, view: HeadView, q: torch.Tensor, n_keep: int = KEEP) -> torch.Tensor:
    """Attention over the rows select + refit leave, as kvmem's attention computes it (float32, log-weights added
    to the logits)."""
    chosen = method.select(view, method.score(view), n_keep)
    values, log_weights = method.refit(view, chosen, T)
    assert values.dtype == torch.float32 and chosen.numel() <= n_keep
    logits = (q @ view.keys[chosen].T) * view.scaling + log_weights
    return logits.softmax(dim=-1) @ values


def estimates(method: SubGen, view: HeadView, q: torch.Tensor, n_keep: int = KEEP):
    """SubGen's sums from the samples directly: N^, D^ (clusters), D^_v (the value draws) and the exact rows' N, D."""
    s = method.sketch(view, n_keep)
    a_v, a_c, a_e = terms(view, q, s.value_rows), terms(view, q, s.cluster_rows), terms(view, q, s.exact)
    n_hat = a_v @ (s.value_weight[:, None] * view.values[s.value_rows].double())
    return n_hat, a_c @ s.cluster_weight, a_v @ s.value_weight, a_e @ view.values[s.exact].double(), a_e.sum(dim=1)


@pytest.mark.parametrize("spec, log_weights", [("subgen", False), ("subgen:sinks=4:recent=8:t=3", True)])
def test_attention_over_the_rows_is_the_estimator_from_the_same_samples(spec, log_weights):
    view, q = synthetic(log_weights=log_weights)
    deviation = []
    for mix in (1e-1, 1e-2, 1e-3, 1e-5):
        method = get_method(f"{spec}:mix={mix}")
        out = compressed(method, view, q).double()
        n_hat, d_hat, d_v, n_exact, d_exact = estimates(method, view, q)
        mixed = (n_hat + n_exact) / (mix * d_v + (1 - mix) * d_hat + d_exact)[:, None]
        torch.testing.assert_close(out, mixed, atol=1e-5, rtol=1e-4)  # the rows hold the mixed estimator exactly
        subgen = (n_hat + n_exact) / (d_hat + d_exact)[:, None]  # SubGen's N^/D^
        deviation.append(float((out - subgen).norm() / subgen.norm()))
    print("relative deviation from N^/D^ at mix 1e-1 .. 1e-5:", deviation)
    assert deviation == sorted(deviation, reverse=True) and deviation[-1] < 1e-4 and deviation[2] < 1e-2


def test_the_samples_fill_the_budget_and_all_rows_kept_is_exact_attention():
    view, q = synthetic(log_weights=True)
    method = get_method("subgen")
    s = method.sketch(view, KEEP)
    assert KEEP - 3 <= s.rows.numel() <= KEEP  # the clusters take what the value draws leave
    assert 0 < s.value_rows.numel() <= KEEP // 2 and s.cluster_rows.numel() > 0
    assert bool((s.cluster_weight >= 1).all()) and float(s.cluster_weight.sum()) >= s.cluster_rows.numel()
    torch.testing.assert_close(compressed(method, view, q, T).double(), exact(view, q), atol=1e-5, rtol=1e-4)
    assert torch.equal(method.select(view, method.score(view), T), torch.arange(T))
    values, log_weights = method.refit(view, torch.arange(T), T)
    assert torch.equal(values, view.values) and torch.equal(log_weights, view.log_weights)


def test_the_estimator_is_unbiased_over_seeds():
    """Averaged over 200 seeds, N^ and D^ approach N and D (each is an unbiased sum estimate), and the ratio of the
    averages approaches true attention far better than a single draw does; a biased estimator would not."""
    view, q = synthetic(seed=1)
    a = terms(view, q, torch.arange(T))
    n_true, d_true, z_true = a @ view.values.double(), a.sum(dim=1), exact(view, q)
    runs = [estimates(get_method(f"subgen:seed={seed}"), view, q)[:2] for seed in range(200)]
    n_err = [float((n - n_true).norm() / n_true.norm()) for n, _ in runs]
    d_err = [float(((d - d_true).abs() / d_true).mean()) for _, d in runs]
    z_err = [float((n / d[:, None] - z_true).norm() / z_true.norm()) for n, d in runs]
    n_mean, d_mean = torch.stack([n for n, _ in runs]).mean(0), torch.stack([d for _, d in runs]).mean(0)
    n_avg = float((n_mean - n_true).norm() / n_true.norm())
    d_avg = float(((d_mean - d_true).abs() / d_true).mean())
    z_avg = float((n_mean / d_mean[:, None] - z_true).norm() / z_true.norm())
    single = sum(z_err) / len(z_err)
    print(f"relative error, average of 200 vs one draw: N {n_avg:.3f} vs {sum(n_err) / 200:.3f}, "
          f"D {d_avg:.3f} vs {sum(d_err) / 200:.3f}, N/D {z_avg:.3f} vs {single:.3f}")
    assert n_avg < 0.3 * sum(n_err) / 200 and d_avg < 0.3 * sum(d_err) / 200 and z_avg < 0.3 * single


# -- on the real model -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prefilled(smollm2):
    ids = smollm2.tokenizer(TEXT).input_ids[:300]
    cache = KVCache(smollm2.model.config, observe_window=64)
    feed(smollm2, cache, ids)
    return cache


def compacted(cache: KVCache, spec: str, ratio: float = 0.25) -> KVCache:
    out = cache.clone()
    compress(out, get_method(spec), ratio)
    return out


def positions(cache: KVCache) -> list[list[list[int]]]:
    return [[p.tolist() for p in layer.head_positions] for layer in cache.layers]


def test_keeps_its_own_rows_with_their_estimator_weights(prefilled):
    """Not a sibling in disguise: other rows than random, knorm and attention-matching keep (and another seed's), and
    they hold estimator weights and rescaled values, not the tokens as they were."""
    sub = compacted(prefilled, "subgen")
    kept = positions(sub)
    for sibling in ("random", "knorm", "attention-matching:queries=window", "subgen:seed=1"):
        assert kept != positions(compacted(prefilled, sibling)), sibling
    assert kept == positions(compacted(prefilled, "subgen"))  # seeded: reproducible
    rescaled, zeroed = 0, 0
    for layer, full in zip(sub.layers, prefilled.layers):
        for (k, v, p), (kf, vf, pf), w in zip(layer.rows.heads(), full.rows.heads(), layer.log_weights):
            at = torch.searchsorted(pf, p)
            assert torch.equal(k, kf[at]) and torch.isfinite(w).all() and torch.isfinite(v).all()
            zeroed += int((v.abs().sum(dim=1) == 0).sum())  # cluster samples: the denominator only
            rescaled += int((v.norm(dim=1) > 10 * vf[at].norm(dim=1)).sum())  # value draws: v / mix
            assert float(w.max()) > 0 and float(w.min()) < math.log(0.01)  # n_c/t_c >= 1; mix c/(s p) small
    assert zeroed > 0 and rescaled > 0


def test_frees_memory_and_still_generates(smollm2, prefilled):
    cache = prefilled.clone()
    result = compress(cache, get_method("subgen"), 0.25)
    assert cache.kv_bytes() == result.kv_bytes_after < 0.3 * prefilled.kv_bytes()
    assert 0.23 < result.tokens_after / result.tokens_before <= 0.26  # the budget, nearly filled
    ids = smollm2.tokenizer(" The market", add_special_tokens=False).input_ids
    logits = feed(smollm2, cache, ids)
    for _ in range(3):
        assert torch.isfinite(logits).all()
        logits = feed(smollm2, cache, [int(logits[-1].argmax())])
    assert torch.isfinite(logits).all()
    # layer by layer inside model.generate
    ids = torch.tensor([smollm2.tokenizer(TEXT).input_ids[:300]])
    cache = KVCache(smollm2.model.config, compressor=Compressor(get_method("subgen"), 0.25))
    out = smollm2.model.generate(input_ids=ids, cache=cache, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == 304 and all(layer.log_weights is not None for layer in cache.layers)


def test_bad_options_are_refused_naming_each():
    with pytest.raises(KVMemError) as err:
        get_method("subgen:mix=0:value_fraction=1.5:t=0:sinks=-1:recent=-2")
    for named in ("mix=0", "value_fraction=1.5", "t=0", "sinks=-1", "recent=-2"):
        assert named in str(err.value)
    view, _ = synthetic()  # values of norm ~100 scaled by 1/mix do not fit float16
    view.values = (view.values * 100).half()
    method = get_method("subgen")
    with pytest.raises(KVMemError, match="raise mix"):
        method.refit(view, method.select(view, method.score(view), KEEP), T)
    for spec, named in (("subgen:mix=1", "mix=1"), ("subgen:colour=1", "colour"), ("subgen:t=two", "option t "), ("subgen:seed=0.5", "option seed ")):
        with pytest.raises(KVMemError, match=named):
            get_method(spec)


def test_registered():
    assert METHODS["subgen"] is SubGen
    assert get_method("subgen:t=3:mix=0.01").spec == "subgen:mix=0.01:t=3"


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])  # Llama GQA; Gemma 3 sliding-window MQA
@pytest.mark.parametrize("aware", [False, True])
def test_answers_through_the_one_call_api(request, model, aware):
    from kvmem.generate import answer

    out = answer(request.getfixturevalue(model), "Notes from the trip. " * 20 + "The meeting point is the old lighthouse. " + "We walked. " * 20,
                 "Where is the meeting point?", "subgen", 0.5, query_aware=aware, max_new_tokens=6)
    assert out.tokens and out.kv_bytes < 0.6 * out.kv_bytes_full


def test_cli_generate(tmp_path):
    runner, app = CliRunner(), load_plugins()
    doc = tmp_path / "doc.txt"
    doc.write_text("Notes from the trip. " * 30 + "The meeting point is the old lighthouse. " + "We walked a lot. " * 30)
    result = runner.invoke(app, ["generate", "--context-file", str(doc), "--prompt", "Where is the meeting point?",
                                 "--method", "subgen:t=3", "--keep-ratio", "0.5", "--max-new-tokens", "6"])
    assert result.exit_code == 0, result.output
    assert "KV held" in result.output
    result = runner.invoke(app, ["generate", "--prompt", "hi", "--method", "subgen:mix=2", "--keep-ratio", "0.5"])
    assert result.exit_code == 2 and "mix=2" in result.output.strip().splitlines()[-1]


def stream(keys: torch.Tensor, delta: float) -> torch.Tensor:
    """The paper's clustering rule, key by key in position order: a key joins the nearest centre within delta, else it
    opens a cluster. Each key's cluster number."""
    dist = torch.cdist(keys.double(), keys.double())
    centres, cluster = [], []
    for i in range(keys.shape[0]):
        near = min(centres, key=lambda c: float(dist[i, c])) if centres else None
        if near is not None and dist[i, near] <= delta:
            cluster.append(centres.index(near))
        else:
            centres.append(i)
            cluster.append(len(centres) - 1)
    return torch.tensor(cluster)


def test_the_clusters_are_the_streaming_rule_at_the_smallest_delta_that_fits():
    """The cluster samples, redone by the streaming rule at the delta found: the t members of lowest priority of every
    cluster (all of a smaller one), weighted n_c / t_c; what they add to the rows already taken fits the room, and at a
    delta 0.1 % smaller it would not."""
    from kvmem.compress.subgen import _cluster_samples

    view, _ = synthetic(seed=2)
    g = torch.Generator().manual_seed(5)
    taken, priority = torch.rand(T, generator=g) < 0.1, torch.rand(T, generator=g)
    rows, weight, delta = _cluster_samples(view.keys, 40, taken, priority, 2)

    def samples(delta: float) -> tuple[torch.Tensor, torch.Tensor]:
        cluster = stream(view.keys, delta)
        picked = torch.cat([m[priority[m].argsort()[:2]] for m in (torch.nonzero(cluster == c)[:, 0]
                                                                    for c in range(int(cluster.max()) + 1))])
        sizes = torch.bincount(cluster)[cluster[picked]].double()
        order = picked.argsort()
        return picked[order], (sizes / sizes.clamp(max=2))[order]

    expected, weights = samples(delta)
    assert torch.equal(rows, expected)
    torch.testing.assert_close(weight, weights)
    assert int((~taken[rows]).sum()) <= 40 < int((~taken[samples(delta * 0.999)[0]]).sum())
    # and inside the sketch: the value draws are the rows taken
    s = get_method("subgen").sketch(view, KEEP)
    cluster = stream(view.keys, s.delta)
    sizes = torch.bincount(cluster)
    assert torch.equal(torch.bincount(cluster[s.cluster_rows], minlength=sizes.numel()), sizes.clamp(max=2))
    assert int((~torch.isin(s.cluster_rows, s.value_rows)).sum()) <= KEEP - s.value_rows.numel()
