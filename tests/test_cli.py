"""The command line: clear one-line errors for bad input, and real runs on the embedded model."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvmem.cli import load_plugins

app = load_plugins()  # demo, eval and race come from the benchmark package

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, list(args))


def test_methods_lists_compression_and_embedding_methods():
    out = run("methods").output
    for name in ("full", "random", "streaming-llm", "h2o", "snapkv", "tova", "knorm", "mean", "last", "prompteol",
                 "echo", "token-prepending", "kv-embedding", "minilm", "tfidf"):
        assert f"{name}:" in out
    assert "layers='id'" in out and "exit=None" in out  # the embedders' options, for specs


@pytest.mark.parametrize(
    "args,message",
    [
        (["generate", "--prompt", "hi", "--method", "snapkv2"], "unknown method 'snapkv2'"),
        (["generate", "--prompt", "hi", "--keep-ratio", "0"], "keep ratio must be in (0, 1]"),
        (["generate", "--prompt", "hi", "--keep-ratio", "1.5"], "keep ratio must be in (0, 1]"),
        (["generate", "--prompt", "hi", "--method", "full", "--keep-ratio", "0.5"], "'full' keeps every token"),
        (["serve", "--keep-ratio", "2"], "keep ratio must be in (0, 1]"),
        (["serve", "--method", "kvzip:chunk=0"], "kvzip needs chunk >= 1"),
        (["generate", "--prompt", "hi", "--context-file", "/no/such/file.txt"], "No such file"),
        (["generate", "--prompt", "hi", "--model", "gpt-17"], "unknown model 'gpt-17'"),
        (["generate", "--prompt", "hi", "--quant", "kivi-5"], "unknown quantization scheme 'kivi-5'"),
        (["generate", "--prompt", "hi", "--store", "ftp://x"], "unknown store tier 'ftp://x'"),
        (["serve", "--store", "memory,redis+cluster://127.0.0.1:7000,127.0.0.1"], "'127.0.0.1' is not host:port"),
        (["generate", "--prompt", "hi", "--store", "memory", "--codec", "zip"], "unknown codec 'zip'"),
        (["eval", "--tasks", "niah-42"], "unknown task 'niah-42'"),
        (["eval", "--samples", "3", "--first-sample", "3"], "--first-sample must be in [0, --samples) = [0, 3)"),
        (["eval", "--suite", "quant", "--first-sample", "2"], "--first-sample is for the longctx suite only"),
        (["eval", "--ratios", "0.5,abc"], "comma-separated list of float"),
        (["eval", "--lengths", "99999", "--tasks", "passkey"], "longer than smollm2-135m allows"),
        (["eval", "--methods", "moment-kv"], "`kvmem eval --suite longgen`"),
        (["generate", "--prompt", "hi", "--method", "moment-kv:recent=-1", "--keep-ratio", "0.5"], "recent=-1"),
        (["eval", "--suite", "longgen", "--methods", "kvzip"], "needs the model"),
        (["eval", "--suite", "longgen", "--extra-rows", "0"], "below 1 without extra_rows"),
    ],
)
def test_bad_input_is_one_clear_line(args, message, tmp_path):
    if args[0] == "eval":
        args = [*args, "--out", str(tmp_path)]
    result = run(*args)
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    last = result.output.strip().splitlines()[-1]  # before it, at most a first-use model conversion notice
    assert last.startswith("error:") and message in last


def test_generate_reads_a_context_file(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("Notes from the trip. " * 30 + "The meeting point is the old lighthouse. " + "We walked a lot. " * 30)
    result = run("generate", "--context-file", str(doc), "--prompt", "Where is the meeting point? The meeting point is",
                 "--method", "snapkv", "--keep-ratio", "0.5", "--query-aware", "--max-new-tokens", "8")
    assert result.exit_code == 0, result.output
    assert "lighthouse" in result.output
    assert "KV held" in result.output


def test_generate_with_a_quantized_cache(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("Notes from the trip. " * 30 + "The meeting point is the old lighthouse. " + "We walked a lot. " * 30)
    result = run("generate", "--context-file", str(doc), "--prompt", "Where is the meeting point? The meeting point is",
                 "--method", "snapkv", "--keep-ratio", "0.5", "--query-aware", "--max-new-tokens", "8", "--quant", "kivi-4")
    assert result.exit_code == 0, result.output
    assert "lighthouse" in result.output and "quantized kivi-4" in result.output


def test_eval_writes_results_report_and_plot(tmp_path):
    result = run("eval", "--lengths", "512", "--samples", "2", "--tasks", "fact-single,ppl-next",
                 "--methods", "full,knorm,streaming-llm", "--ratios", "1.0,0.5", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    keys = {(r["task"], r["setting"], r["method"], r["keep_ratio"]) for r in records}
    assert ("fact-single", "agnostic", "knorm", 0.5) in keys and ("fact-single", "aware", "streaming-llm", 0.5) in keys
    assert ("ppl-next", "agnostic", "knorm", 0.5) in keys
    rows = json.loads((tmp_path / "results.json").read_text())
    for r in rows:
        assert r["kv_bytes"] > 0 and 0 < r["fraction_kept"] <= 1.0 and r["lo"] <= r["score"] <= r["hi"] and r["n"] >= 1
        if r["keep_ratio"] == 0.5:
            assert r["fraction_kept"] < 0.7
    report = (tmp_path / "report.md").read_text()
    assert "## Which tasks count" in report and "| fact-single |" in report
    # a method added later runs on the samples already done; nothing else is recomputed
    result = run("eval", "--lengths", "512", "--samples", "2", "--tasks", "fact-single,ppl-next",
                 "--methods", "full,knorm,streaming-llm,keydiff:budget=pyramid", "--ratios", "1.0,0.5", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    again = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert again[:len(records)] == records
    added = {(r["task"], r["sample"], r["setting"], r["method"]) for r in again[len(records):]}
    assert {m for *_, m in added} == {"keydiff:budget=pyramid"}
    assert len(added) == 2 * 2 + 2  # 2 samples x 2 settings of fact-single, 2 samples of ppl-next (agnostic)
    # a method run in one setting first gets the other later, and only that (was: counted done, never run)
    args = ["eval", "--lengths", "512", "--samples", "2", "--tasks", "fact-single,ppl-next", "--ratios", "1.0,0.5",
            "--out", str(tmp_path), "--methods", "full,tova"]
    for settings, want in (("agnostic", {("fact-single", "agnostic"), ("ppl-next", "agnostic")}),
                           ("agnostic,aware", {("fact-single", "aware")})):
        before = len(again)
        assert run(*args, "--settings", settings).exit_code == 0
        again = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
        new = again[before:]
        assert {(r["task"], r["setting"]) for r in new} == want and {r["method"] for r in new} == {"tova"}
        assert len(new) == 2 * len(want)  # 2 samples each, one ratio below 1
    # --first-sample: a second process takes samples 2.. of the same tasks; 0 and 1 are not touched
    before = len(again)
    result = run("eval", "--lengths", "512", "--samples", "3", "--first-sample", "2", "--tasks", "fact-single",
                 "--methods", "full,knorm", "--ratios", "1.0,0.5", "--settings", "agnostic", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    new = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()][before:]
    assert {(r["sample"], r["method"]) for r in new} == {(2, "full"), (2, "knorm")}
    if any(r["task"] == "mean" for r in rows):  # the model answered with its full cache: there is a headline
        assert list(tmp_path.glob("score_vs_kept_*.png"))


def test_generate_without_context_just_answers():
    result = run("generate", "--prompt", "What is the capital of France?", "--max-new-tokens", "12")
    assert result.exit_code == 0, result.output
    assert "Paris" in result.output


def test_embed_writes_npy_and_jsonl(tmp_path):
    import numpy as np

    texts = tmp_path / "texts.txt"
    texts.write_text("The cat sat on the mat.\nA dog ran in the park.\n\nStocks fell sharply today.\n")
    result = run("embed", str(texts), "--method", "mean", "--out", str(tmp_path / "e.npy"))
    assert result.exit_code == 0, result.output
    vectors = np.load(tmp_path / "e.npy")
    assert vectors.shape == (3, 576) and np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    result = run("embed", str(texts), "--method", "tfidf", "--precision", "binary", "--out", str(tmp_path / "e.jsonl"))
    assert result.exit_code == 0, result.output
    assert len((tmp_path / "e.jsonl").read_text().splitlines()) == 3
    result = run("embed", str(texts), "--out", str(tmp_path / "e.csv"))
    assert result.exit_code == 2 and "error:" in result.output and ".npy or .jsonl" in result.output


def test_embed_with_the_new_methods_on_both_models(tmp_path):
    import numpy as np

    texts = tmp_path / "texts.txt"
    texts.write_text("The cat sat on the mat.\nStocks fell sharply today.\n")
    for model, method, dim in (("smollm2-135m", "kv-embedding:layers=8-14:bias=1", 576),
                               ("gemma3-270m", "token-prepending:exit=3", 640)):
        result = run("embed", str(texts), "--model", model, "--method", method, "--out", str(tmp_path / "e.npy"))
        assert result.exit_code == 0, result.output
        assert np.load(tmp_path / "e.npy").shape == (2, dim)
    for method, problem in (("kv-embedding:depth=3", "has no option depth"), ("kv-embedding:layers", "key=value"),
                            ("kv-embedding:layers=99", "re-routing layers")):
        result = run("embed", str(texts), "--method", method, "--out", str(tmp_path / "e.npy"))
        assert result.exit_code == 2 and problem in result.output, result.output


def test_eval_retrieval_suite(tmp_path):
    result = run("eval", "--suite", "retrieval", "--methods", "tfidf,mean", "--tasks", "abstracts", "--limit", "12",
                 "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "results.json").read_text())
    assert {r["method"] for r in rows} == {"tfidf", "mean"}
    assert all(0.0 <= r["ndcg@10"] <= 1.0 for r in rows)
