"""KV-Direct (kvdirect.py): keys and values recomputed from residual checkpoints equal the prefill's, greedy output
equals the full cache's, what is held is measured (bounded with token checkpoints), bad options are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvmem.cache import KVCache
from kvmem.errors import KVMemError
from kvmem.forward import feed
from kvmem.generate import answer, decode
from kvmem.kvdirect import KVDirectCache, check_call, parse
from kvmem.models import LoadedModel

TEXT = (Path(__file__).parents[1] / "src/kvmem/data/abstracts.txt").read_text()
STEPS = 32


def prompt_ids(lm: LoadedModel, n: int, start: int = 0) -> list[int]:
    return lm.tokenizer(TEXT[start:start + 8 * n])["input_ids"][:n]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def model(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def reference(model):
    """The full cache's greedy tokens over a 96-token prompt, and that cache."""
    ids = prompt_ids(model, 96)
    cache = KVCache(model.model.config)
    out = decode(model, cache, feed(model, cache, ids), STEPS, stop_at_newline=False)
    return ids, out, cache


def test_recomputed_keys_and_values_equal_the_full_caches(model, reference):
    ids, out, full = reference
    cache = KVDirectCache(model, window=8, checkpoint="layer")
    assert decode(model, cache, feed(model, cache, ids), STEPS, stop_at_newline=False) == out
    n = len(ids)
    for i, layer in enumerate(cache.layers):
        keys, values, positions = layer.last_recomputed  # the last step's: the prompt and the decoded tokens before the window
        fk, fv, fp = full.layers[i].rows.stacked()
        m = positions.numel()
        # decode feeds 31 tokens after the prompt; the last one's forward held n + 30 tokens, 8 of them resident
        assert m == n + STEPS - 2 - 8 and torch.equal(positions, fp[0, :m])
        # the prompt's rows went through the same kernels in both passes (one forward of 96 rows): the same bits
        assert torch.equal(keys[:, :n], fk[:, :n]) and torch.equal(values[:, :n], fv[:, :n]), f"layer {i}"
        # a decoded token's projection ran on one row (FewRowsLinear's kernel), its recompute on many (MKL): the same
        # dot products summed in another order, and its residual came through kvmem's attention, not SDPA
        torch.testing.assert_close(keys[:, n:], fk[:, n:m], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(values[:, n:], fv[:, n:m], rtol=1e-4, atol=1e-4)
    assert cache.recompute_s > 0


def test_token_checkpoints_decode_as_the_full_cache(model, reference):
    ids, out, _ = reference
    cache = KVDirectCache(model, window=64, checkpoint="tokens")
    assert decode(model, cache, feed(model, cache, ids), STEPS, stop_at_newline=False) == out
    assert cache.refed_tokens == sum(range(len(ids) - 64, len(ids) - 64 + STEPS - 1))  # every step ran the old ones again
    assert cache.layers[0].lengths() == [64] * cache.layers[0].num_heads


def test_bytes_held_per_checkpoint_as_the_conversation_grows(smollm2):
    """Token checkpoints: the window's K/V stay the same and 4 bytes a token are added. Layer checkpoints grow by
    hidden_size floats a token and layer: more than the K/V they replace on SmolLM2's grouped-query heads (576 > 2 x 3 x
    64), measured against the full cache fed the same turns."""
    c = smollm2.model.config
    tokens, layer, full = (KVDirectCache(smollm2, 32, "tokens"), KVDirectCache(smollm2, 32, "layer"),
                           KVCache(c))
    held, turns = [], [prompt_ids(smollm2, 40, 2000 * t) for t in range(4)]
    for turn in turns:
        for cache in (tokens, layer, full):
            feed(smollm2, cache, turn)
        held.append((tokens.kv_bytes(), tokens.checkpoint_bytes(), layer.checkpoint_bytes(), full.kv_bytes()))
    fed = [40 * (t + 1) for t in range(4)]
    assert all(h[0] == held[0][0] for h in held)  # the window's K/V: constant
    assert [h[1] for h in held] == [4 * n for n in fed]  # one int32 id a token
    per_token_full = 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4 * c.num_hidden_layers
    per_token_layer = c.hidden_size * 4 * c.num_hidden_layers
    assert per_token_layer > per_token_full
    for (_, _, layer_bytes, full_bytes), n in zip(held, fed):
        assert n * per_token_layer <= layer_bytes <= (n + 64) * per_token_layer  # buffers grow 64 rows at a time
        assert layer_bytes > full_bytes
    assert held[-1][0] + held[-1][1] < held[-1][3] / 4


@pytest.mark.parametrize("window", [3, 12])
@pytest.mark.parametrize("checkpoint", ["layer", "tokens"])
def test_sliding_layers_keep_what_they_can_see(tiny_gemma, window, checkpoint):
    """Gemma-3's mix of sliding (window 8) and global layers, windows below and above it: the same logits as the full
    cache at every step, and a sliding layer holds no more than it can still see."""
    lm = LoadedModel("tiny-gemma", tiny_gemma, None, "tiny-gemma", 512)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(1))[0].tolist()
    full, cache = KVCache(tiny_gemma.config), KVDirectCache(lm, window, checkpoint)
    a, b = feed(lm, full, ids), feed(lm, cache, ids)
    for _ in range(16):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        token = [int(a.argmax())]
        a, b = feed(lm, full, token), feed(lm, cache, token)
    sliding = [layer for layer in cache.layers if layer.is_sliding]
    assert all(max(layer.lengths()) <= min(window, 7) for layer in sliding)
    if checkpoint == "layer":
        assert all(layer.res_n <= 7 for layer in sliding)
        assert not any(layer.last_recomputed for layer in sliding) or window < 7


def test_answer_and_the_cli_run_it(smollm2, tmp_path):
    context, question = TEXT[:800], "What is the first paper about?"
    full = answer(smollm2, context, question, "full", max_new_tokens=12)
    direct = answer(smollm2, context, question, "kv-direct:window=64:checkpoint=tokens", max_new_tokens=12)
    assert direct.text == full.text
    assert direct.kv_bytes_full >= full.kv_bytes and direct.kv_bytes < full.kv_bytes / 2  # 64 of ~190 tokens
    (tmp_path / "doc.txt").write_text(context)
    from kvmem.cli import app

    result = CliRunner().invoke(app, ["generate", "--prompt", question, "--context-file", str(tmp_path / "doc.txt"),
                                      "--method", "kv-direct:window=64", "--keep-ratio", "1", "--max-new-tokens", "12"])
    assert result.exit_code == 0, result.output
    assert full.text.strip()[:20] in result.output and "residual checkpoints held" in result.output


@pytest.mark.parametrize("spec,kwargs,message", [
    ("kv-direct:window=0", {}, "window must be at least 1"),
    ("kv-direct:window=many", {}, "window of 'kv-direct' must be an integer"),
    ("kv-direct:checkpoint=kv", {}, "checkpoint='kv'; choose layer or tokens"),
    ("kv-direct:budget=8", {}, "has no option budget"),
    ("kv-direct", {"keep_ratio": 0.5}, "give keep ratio 1.0"),
    ("kv-direct", {"quant": "kivi-2"}, "does not take quant='kivi-2'"),
    ("kv-direct", {"store": object()}, "chunk store"),
    ("kv-direct", {"query_aware": True}, "query_aware does not apply"),
])
def test_bad_options_are_refused_by_name(spec, kwargs, message):
    with pytest.raises(KVMemError, match=message.replace("(", r"\(").replace("[", r"\[")):
        check_call(spec, **kwargs)


def test_the_cli_and_the_server_refuse_what_kv_direct_cannot_do():
    from kvmem.cli import app

    runner = CliRunner()
    bad = runner.invoke(app, ["generate", "--prompt", "hi", "--method", "kv-direct:window=0", "--keep-ratio", "1"])
    assert bad.exit_code != 0 and "window must be at least 1" in bad.output
    ratio = runner.invoke(app, ["generate", "--prompt", "hi", "--method", "kv-direct"])  # the default keep ratio 0.5
    assert ratio.exit_code != 0 and "give keep ratio 1.0" in ratio.output
    serve = runner.invoke(app, ["serve", "--method", "kv-direct", "--keep-ratio", "1"])
    assert serve.exit_code != 0 and "batched decoding does not run KV-Direct" in serve.output
    assert parse("kv-direct:checkpoint=tokens").spec == "kv-direct:checkpoint=tokens:window=256"


def test_a_kv_direct_cache_is_fed_through_kvmem(smollm2):
    cache = KVDirectCache(smollm2, 8, "layer")
    with pytest.raises(KVMemError, match="cannot be copied"):
        cache.clone()
    ids = torch.tensor([prompt_ids(smollm2, 12)])
    smollm2.model(input_ids=ids, cache=cache)  # residuals are captured by the hooks: a plain forward works too
    assert cache.layers[0].res_n == 12
    tokens = KVDirectCache(smollm2, 8, "tokens")
    feed(smollm2, tokens, ids[0].tolist())
    with pytest.raises(KVMemError, match="runs its checkpointed tokens again"):  # not silently without them
        smollm2.model(input_ids=ids[:, :1], cache=tokens, position_ids=torch.tensor([[12]]))


def test_the_benchmark_report_counts_token_match_bytes_and_time(tmp_path):
    from kvmem_bench.kvdirect.report import prefix_match, summarize, token_match, write_report
    from kvmem_bench.records import append_record

    assert token_match([1, 2, 9, 4], [1, 2, 3, 4]) == 0.75 and prefix_match([1, 2, 9, 4], [1, 2, 3, 4]) == 0.5
    shape = {"hidden_size": 576, "kv_heads": 3, "head_dim": 64, "layers": 30, "commit": "abc", "model": "m", "window": 2}
    for sample, (direct, evicted) in enumerate([([1, 2, 3, 4], [1, 2, 0, 0]), ([5, 6, 7, 8], [0, 6, 7, 8])]):
        for method, tokens, kv, ckpt, step in (("full", [[1, 2, 3, 4], [5, 6, 7, 8]][sample], 100, 0, 0.1),
                                               ("kv-direct:checkpoint=layer:window=2", direct, 10, 150, 0.2),
                                               ("h2o", evicted, 10, 0, 0.1)):
            append_record(tmp_path / "records.jsonl", {**shape, "part": "decode", "length": 8, "sample": sample,
                                                       "method": method, "tokens": tokens, "step_s": [step] * 4,
                                                       "kv_bytes": [kv] * 4, "checkpoint_bytes": [ckpt] * 4,
                                                       "recompute_s": 0.4 if ckpt else 0.0, "prefill_s": 1.0})
    append_record(tmp_path / "records.jsonl", {**shape, "part": "growth", "length": 8, "method": "full", "fed": [4, 8],
                                               "kv_bytes": [2 ** 20, 2 ** 21], "checkpoint_bytes": [0, 0], "turn_s": [1, 2]})
    s = summarize([__import__("json").loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()])
    rows = {r["method"]: r for r in s["decode"]}
    assert rows["h2o"]["token_match"][0] == 0.625 and rows["h2o"]["prefix_match"][0] == 0.25
    assert rows["kv-direct:checkpoint=layer:window=2"]["held_vs_full"] == 1.6
    assert rows["kv-direct:checkpoint=layer:window=2"]["step_vs_full"][0] == pytest.approx(2.0)
    assert rows["kv-direct:checkpoint=layer:window=2"]["recompute_share"] == pytest.approx(0.5)
    assert s["sizes"]["m"] == {"residual": 2304, "kv": 1536, "ratio": 1.5}
    (d,) = s["differences"]
    assert d["difference"][0] == 0.375 and not d["significant"]  # two samples: too few to call it
    report = write_report(tmp_path).read_text()
    assert "| smollm2" not in report and "| m | 2304 B | 1536 B | 1.50x |" in report and "n < 5: not tested" in report
    assert (tmp_path / "growth.png").exists() and (tmp_path / "decode.png").exists()


def test_a_tiny_benchmark_run_end_to_end(smollm2, tmp_path):
    from kvmem_bench.kvdirect.report import write_report
    from kvmem_bench.kvdirect.runner import KVDirectConfig, run_kvdirect_suite
    from kvmem_bench.records import read_records

    cfg = KVDirectConfig(model="smollm2-135m", lengths=[40], samples=1, new_tokens=3, window=16,
                         evictions=["streaming-llm"], turn=16, growth_length=40, tokens_max_length=40, out=tmp_path)
    cfg.validate()
    run_kvdirect_suite(smollm2, cfg, log=lambda *_: None)
    records = read_records(tmp_path / "records.jsonl")
    assert {(r["part"], r["method"]) for r in records} == {
        ("decode", m) for m in cfg.methods()} | {("growth", m) for m in cfg.methods() if m != "streaming-llm"}
    tokens = next(r for r in records if r["part"] == "growth" and "tokens" in r["method"])
    assert tokens["checkpoint_bytes"] == [64, 128, 160] and len(set(tokens["kv_bytes"][1:])) == 1
    assert "| full | 1 | 1.00 [1.00, 1.00]" in write_report(tmp_path).read_text()
    with pytest.raises(KVMemError, match="must exceed the window"):
        KVDirectConfig(model="m", lengths=[16], window=16).validate()
