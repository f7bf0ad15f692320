"""`kvmem serve` end to end: real servers on loopback (subprocesses, real SmolLM2), the official openai client.

One server (store in memory, continuous batching, a queue of one) answers most tests; one without batching (one
worker, a queue of one) the worker queue's tests; two replicas on one real redis-server answer the sharing and the
no-shared-state tests. Batching's own tests (budget, preemption, rows alone vs together) are in test_serve_batching.py.
"""

from __future__ import annotations

import re
import threading
import time

import httpx2 as httpx  # the HTTP client the openai package is built on
import numpy as np
import openai
import pytest

from kvmem.embed import get_embedder
from kvmem.calibration import load_abstracts
from kvmem.prompts import chat_prompt
from kvmem.serve.local import LocalServer

MODEL = "smollm2-135m"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
COUNT = [{"role": "user", "content": "Count from 1 to 20, one number per line."}]


@pytest.fixture(scope="module")
def server():
    # one torch thread, as every test server: beside the other pytest worker a 2-thread server waits for its
    # descheduled second thread at every parallel region (60 tokens took 102 s under `make test`; with one thread under 20 s)
    with LocalServer(["--store", "memory", "--queue", "1", "--threads", "1", "--max-n", "2"]) as s:
        yield s


@pytest.fixture(scope="module")
def single():
    """The server without batching: one worker decodes one request at a time, one more may wait. One torch thread:
    beside the other pytest worker, a 2-thread server's parallel regions wait for a descheduled thread (60 tokens
    took over 60 s under `make test`), which this module's timeouts are not about."""
    with LocalServer(["--no-batching", "--workers", "1", "--queue", "1", "--threads", "1"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def metric(server, name: str, labels: str = "") -> float:
    text = httpx.get(server.url + "/metrics").text
    pattern = rf"^{re.escape(name)}{re.escape('{' + labels + '}') if labels else ''} ([0-9.e+-]+)$"
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else 0.0


def wait_idle(server, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = httpx.get(server.url + "/health").json()
        if h["running"] == 0 and h["waiting"] == 0:
            return
        time.sleep(0.1)
    raise AssertionError("the server did not become idle")


def wait_until(server, running: int, waiting: int = 0, timeout: float = 30) -> None:
    """Poll /health until the server holds these many requests: a fixed sleep races a client thread's first
    connection on a loaded machine (CI once sent the second request before the first had reached the worker)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = httpx.get(server.url + "/health").json()
        if h["running"] >= running and h["waiting"] >= waiting:
            return
        time.sleep(0.05)
    raise AssertionError(f"the server never held {running} running and {waiting} waiting requests")


def system_prompt(n_abstracts: int = 3) -> str:
    return "You answer questions about these research abstracts.\n\n" + "\n\n".join(load_abstracts()[:n_abstracts])


# -- chat, streaming, sampling ----------------------------------------------------------------------------------
def test_chat_answers_and_reuses_its_context(client, smollm2):
    a = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=20)
    assert "Paris" in a.choices[0].message.content
    assert a.choices[0].finish_reason == "stop"
    want = len(chat_prompt(smollm2.tokenizer, FRANCE).ids)
    assert a.usage.prompt_tokens == want and a.usage.total_tokens == want + a.usage.completion_tokens
    b = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=20)
    context = len(chat_prompt(smollm2.tokenizer, FRANCE).context)
    assert b.usage.prompt_tokens_details.cached_tokens == context  # the template head, from the store
    assert b.choices[0].message.content == a.choices[0].message.content  # raw reuse is bit-identical


def test_streaming_gives_the_same_text_and_usage(client):
    full = client.chat.completions.create(model=MODEL, messages=COUNT, temperature=0, max_tokens=30)
    chunks = list(client.chat.completions.create(model=MODEL, messages=COUNT, temperature=0, max_tokens=30, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 5  # token by token, not one blob
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 30 == full.usage.completion_tokens


def test_sampling_seed_top_p_and_n(client):
    greedy = client.chat.completions.create(model=MODEL, messages=COUNT, temperature=0, max_tokens=12)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Write a sentence about the sea."}], max_tokens=16)
    s1 = client.chat.completions.create(temperature=1.2, seed=5, **kw).choices[0].message.content
    s2 = client.chat.completions.create(temperature=1.2, seed=5, **kw).choices[0].message.content
    s3 = client.chat.completions.create(temperature=1.2, seed=6, **kw).choices[0].message.content
    assert s1 == s2 and s1 != s3
    # a nucleus of one token is greedy decoding
    nucleus = client.chat.completions.create(model=MODEL, messages=COUNT, temperature=1.0, top_p=1e-6, max_tokens=12)
    assert nucleus.choices[0].message.content == greedy.choices[0].message.content
    two = client.chat.completions.create(temperature=1.2, seed=5, n=2, **kw)
    assert [c.index for c in two.choices] == [0, 1] and two.choices[0].message.content == s1


def test_stop_strings_and_max_tokens(client):
    stopped = client.chat.completions.create(model=MODEL, messages=COUNT, temperature=0, max_tokens=60, stop=["5"])
    text = stopped.choices[0].message.content
    assert "4" in text and "5" not in text and stopped.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model=MODEL, messages=COUNT, temperature=0, max_tokens=60, stop=["5"],
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text  # nothing of the stop leaks
    short = client.chat.completions.create(model=MODEL, messages=COUNT, temperature=0, max_tokens=5)
    assert short.usage.completion_tokens == 5 and short.choices[0].finish_reason == "length"


def test_text_completions(client):
    kw = dict(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=6)
    a = client.completions.create(**kw)
    assert a.object == "text_completion" and "Paris" in a.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == a.choices[0].text


def test_a_decode_phase_method_per_request(client):
    """moment-kv evicts generated rows while the server decodes (the prompt stays whole); the answer still comes."""
    body = {"kvmem": {"method": "moment-kv:decode_budget=4", "use_store": False}}
    a = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=12, extra_body=body)
    assert a.choices[0].message.content and a.model_extra["kvmem"]["method"] == "moment-kv:decode_budget=4"


# issue 35's catalog, per request: every scorer and allocator that fits nothing first (cokv fits Shapley values on
# first use, minutes: tests/test_cokv.py; attention-matching's least-squares fit: tests/test_attention_matching.py)
@pytest.mark.parametrize("method", ["keyformer", "vatp", "rcstat", "dapq", "finch", "kvcrush", "subgen", "fastgen",
                                    "snapkv:budget=prefixkv", "attention-matching:queries=window"])
def test_a_catalog_method_per_request(client, method):
    messages = [{"role": "system", "content": system_prompt(2)}, {"role": "user", "content": "Name the first method."}]
    body = {"kvmem": {"method": method, "keep_ratio": 0.5, "use_store": False}}
    a = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=4, extra_body=body)
    info = a.model_extra["kvmem"]
    assert info["method"] == method and info["kv_bytes"] < 0.7 * info["kv_bytes_full"]
    # the answer is whatever the compressed cache gives (subgen's sampled values end it at once: it scores ~0 in the suite)
    assert a.choices[0].finish_reason in ("stop", "length") and a.choices[0].message.content is not None


def test_an_offload_policy_per_request(client):
    """sparq keeps the context in its tier and retrieves while the server decodes: the resident bytes reported (its
    working set at its peak, the retrieved rows included) are about the keep ratio of the full cache's, and the answer
    comes."""
    messages = [{"role": "system", "content": system_prompt()},
                {"role": "user", "content": "In one sentence, what is the first abstract about?"}]
    body = {"kvmem": {"method": "sparq", "keep_ratio": 0.25, "use_store": False}}
    a = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=6, extra_body=body)
    info = a.model_extra["kvmem"]
    assert a.choices[0].message.content and info["method"] == "sparq"
    assert 0.15 * info["kv_bytes_full"] < info["kv_bytes"] < 0.3 * info["kv_bytes_full"]


def test_per_request_compression_and_its_reuse(client, smollm2):
    messages = [{"role": "system", "content": system_prompt()},
                {"role": "user", "content": "In one sentence, what is the first abstract about?"}]
    body = {"kvmem": {"method": "snapkv", "keep_ratio": 0.25}}
    a = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8, extra_body=body)
    info = a.model_extra["kvmem"]
    assert info["method"] == "snapkv" and info["kv_bytes"] < 0.4 * info["kv_bytes_full"]
    b = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8, extra_body=body)
    assert b.usage.prompt_tokens_details.cached_tokens == len(chat_prompt(smollm2.tokenizer, messages).context)
    assert b.choices[0].message.content == a.choices[0].message.content
    q = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=4,
                                       extra_body={"kvmem": {"quant": "kivi-2", "use_store": False}})
    assert q.model_extra["kvmem"]["kv_bytes"] < 0.3 * info["kv_bytes_full"]
    assert q.usage.prompt_tokens_details.cached_tokens == 0  # use_store false reads nothing


def test_cacheblend_documents_are_stored_and_assembled(client, smollm2):
    docs = ["Alice Moreau keeps bees on a farm in Normandy. Her secret code is 4821.",
            "Bruno Keller repairs clocks in Zurich. He has three cats."]
    ask = lambda q: client.chat.completions.create(  # noqa: E731
        model=MODEL, messages=[{"role": "user", "content": q}], temperature=0, max_tokens=20,
        extra_body={"kvmem": {"reuse": "cacheblend", "documents": docs, "recompute_ratio": 0.3}})
    a = ask("What is Alice Moreau's secret code?")
    assert "4821" in a.choices[0].message.content
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    b = ask("What is the secret code of Alice Moreau?")  # another question: the documents come from the store
    doc_tokens = sum(len(smollm2.tokenizer(d + "\n\n", add_special_tokens=False).input_ids) for d in docs)
    assert b.usage.prompt_tokens_details.cached_tokens == doc_tokens and "4821" in b.choices[0].message.content


# -- embeddings, models, health, metrics -------------------------------------------------------------------------
def test_embeddings_match_the_library(client, smollm2):
    texts = ["A cat sat on the mat.", "Stock markets fell sharply today."]
    got = client.embeddings.create(model=MODEL, input=texts)  # the client asks for base64 and decodes it
    vectors = np.array([d.embedding for d in got.data])
    local = get_embedder("prompteol", model=smollm2).encode(texts, normalize_embeddings=True)
    assert vectors.shape == (2, smollm2.config.hidden_size)
    np.testing.assert_allclose(vectors, local, atol=1e-4)
    floats = client.embeddings.create(model=MODEL, input="A cat sat on the mat.", encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, local[0], atol=1e-4)
    mini = client.embeddings.create(model="minilm", input=texts)
    assert len(mini.data[0].embedding) == 384 and got.usage.prompt_tokens > 0
    other = client.embeddings.create(model=MODEL, input=texts, extra_body={"kvmem": {"method": "token-prepending"}})
    assert not np.allclose(np.array([d.embedding for d in other.data]), vectors)


def test_models_health_and_metrics(client, server):
    assert [m.id for m in client.models.list().data][0] == MODEL
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    before = metric(server, "kvmem_time_to_first_token_seconds_count")
    client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=4)
    assert metric(server, "kvmem_time_to_first_token_seconds_count") == before + 1
    assert metric(server, "kvmem_requests_total", 'endpoint="/v1/chat/completions",status="200"') >= 1
    assert metric(server, "kvmem_store_lookups_total", 'result="hit",tier="memory"') >= 1
    assert metric(server, "kvmem_reused_tokens_total") > 0
    assert metric(server, "process_resident_memory_bytes") > 1e8
    for name in ("kvmem_time_per_output_token_seconds_bucket", "kvmem_queue_depth", "kvmem_kv_bytes_held",
                 "kvmem_store_lookups_total"):
        assert name in httpx.get(server.url + "/metrics").text


# -- bad input -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, status, words", [
    ({"model": "gpt-4"}, 404, "does not exist"),
    ({"kvmem": {"method": "no-such-method", "keep_ratio": 0.5}}, 400, "unknown method"),
    ({"kvmem": {"method": "snapkv", "keep_ratio": 0}}, 400, "keep_ratio must be in (0, 1]"),
    ({"kvmem": {"method": "snapkv", "keep_ratio": 1.5}}, 400, "keep_ratio must be in (0, 1]"),
    ({"kvmem": {"quant": "kivi-9"}}, 400, "kivi-9"),
    ({"kvmem": {"method": "moment-kv:decay=2", "keep_ratio": 0.5}}, 400, "decay=2"),
    ({"kvmem": {"method": "snapkv:window=-3"}}, 400, "window"),
    ({"max_tokens": -3}, 400, "max_tokens"),
    ({"n": 1000}, 400, "n=1000"),
    ({"temperature": 7}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "word " * 9000}]}, 400, "maximum context length is 8192 tokens"),
    ({"top_logprobs": 3}, 400, "top_logprobs needs logprobs"),
    ({"kvmem": {"reuse": "cacheblend"}}, 400, "documents"),
    ({"kvmem": {"bogus": 1}}, 400, "bogus"),
])
def test_bad_requests_get_openai_errors(server, change, status, words):
    body = {"model": MODEL, "messages": FRANCE, "max_tokens": 4} | change
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["type"]
    if "kvmem" in change and set(change["kvmem"]) <= {"method", "quant"}:  # the field at fault is named
        assert error["param"] == "kvmem." + next(k for k in ("quant", "method") if k in change["kvmem"])


def test_errors_through_the_client_and_the_server_stays_up(client, server):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=FRANCE)
    with pytest.raises(openai.BadRequestError, match="keep_ratio"):
        client.chat.completions.create(model=MODEL, messages=FRANCE, extra_body={"kvmem": {"method": "snapkv",
                                                                                          "keep_ratio": -1}})
    r = httpx.post(server.url + "/v1/chat/completions", content=b'{"model": "smollm2-135m", "messages": [',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, "input": ""})
    assert r.status_code == 400 and "non-empty" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, "input": [[10**9]]})
    assert r.status_code == 400 and "token ids must be in" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/nowhere").status_code == 404
    assert "Paris" in client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0,
                                                     max_tokens=10).choices[0].message.content


# -- load: cancellation, timeouts, the queue -------------------------------------------------------------------
LONG = {"model": MODEL, "messages": COUNT, "max_tokens": 4000, "temperature": 0, "kvmem": {"ignore_eos": True}}


def test_a_client_that_disconnects_cancels_its_generation(server):
    wait_idle(server)
    generated, cancelled = metric(server, "kvmem_completion_tokens_total"), metric(server, "kvmem_cancelled_requests_total")
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=LONG | {"stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(8)) if line.startswith("data:")]
        assert len(got) >= 3 and metric(server, "kvmem_kv_bytes_held") > 0  # generating, holding its KV
    wait_idle(server, 10)  # the worker stopped: far sooner than 4000 tokens would take
    assert metric(server, "kvmem_kv_bytes_held") == 0
    assert metric(server, "kvmem_cancelled_requests_total") == cancelled + 1
    # a non-streaming client that gives up (its read timeout) is cancelled too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=LONG, timeout=2)
    wait_idle(server, 10)
    assert metric(server, "kvmem_cancelled_requests_total") == cancelled + 2
    assert metric(server, "kvmem_completion_tokens_total") == generated  # no cancelled choice counts as done
    assert metric(server, "kvmem_kv_bytes_held") == 0


def test_a_client_that_leaves_during_the_prefill_stops_it(server):
    """A ~6k-token prompt, not stored: tens of seconds of prefill on 2 cores; the client gives up after 2 s and the
    worker stops at the next 512-token piece."""
    wait_idle(server)
    cancelled = metric(server, "kvmem_cancelled_requests_total")
    long_prompt = {"model": MODEL, "max_tokens": 4, "kvmem": {"use_store": False, "fill_store": False},
                   "messages": [{"role": "user", "content": system_prompt(30) + "\n\nWhich abstract is the longest?"}]}
    t = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=long_prompt | {"stream": True}, timeout=2)
    wait_idle(server, 12)
    assert time.monotonic() - t < 12  # a 6k prefill alone takes longer
    assert metric(server, "kvmem_cancelled_requests_total") == cancelled + 1
    assert metric(server, "kvmem_kv_bytes_held") == 0


def test_a_request_past_its_timeout_gets_504(server):
    wait_idle(server)
    r = httpx.post(server.url + "/v1/chat/completions", json=LONG | {"kvmem": {"ignore_eos": True, "timeout": 1.5}},
                   timeout=60)
    assert r.status_code == 504 and "timed out after 1.5 s" in r.json()["error"]["message"]
    wait_idle(server, 5)


def test_a_request_that_waits_too_long_in_the_queue_gets_504(single):
    server = single
    wait_idle(server)
    busy = threading.Thread(target=lambda: httpx.post(server.url + "/v1/chat/completions", timeout=60,
                                                      json=LONG | {"max_tokens": 40}))
    busy.start()
    wait_until(server, running=1)  # the one worker is taken
    r = httpx.post(server.url + "/v1/chat/completions", json=LONG | {"kvmem": {"ignore_eos": True, "timeout": 1}},
                   timeout=60)
    busy.join()
    assert r.status_code == 504 and "waiting in the queue" in r.json()["error"]["message"]
    wait_idle(server, 5)


def test_a_full_queue_answers_429_with_retry_after(single):
    server = single
    wait_idle(server)
    results: list[httpx.Response] = []

    def long_request():
        results.append(httpx.post(server.url + "/v1/chat/completions", timeout=60,
                                  json=LONG | {"max_tokens": 60}))

    threads = [threading.Thread(target=long_request) for _ in range(2)]  # one runs, one waits: the queue is full
    for waiting, t in enumerate(threads):
        t.start()
        wait_until(server, running=1, waiting=waiting)
    refused = httpx.post(server.url + "/v1/chat/completions", json=LONG | {"max_tokens": 5}, timeout=60)
    for t in threads:
        t.join()
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert "busy" in refused.json()["error"]["message"]
    assert sorted(r.status_code for r in results) == [200, 200]


# -- two replicas on one Redis; no state shared between concurrent requests ---------------------------------------
@pytest.fixture(scope="module")
def replicas(redis_server):
    args = ["--store", f"memory,{redis_server.url}", "--workers", "2", "--threads", "1"]
    with LocalServer(args) as a, LocalServer(args) as b:
        yield a, b


def test_two_replicas_reuse_each_others_kv(replicas, smollm2):
    a, b = replicas
    system = {"role": "system", "content": system_prompt(4)}
    ask = lambda server, q: openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0).chat.completions.create(  # noqa: E731
        model=MODEL, messages=[system, {"role": "user", "content": q}], temperature=0, max_tokens=12)
    first = ask(a, "Which abstract mentions attention?")
    context = len(chat_prompt(smollm2.tokenizer, [system, {"role": "user", "content": "x"}]).context)
    assert context > 512 and first.usage.prompt_tokens_details.cached_tokens == 0
    other = ask(b, "Name one method from the abstracts.")  # replica b never saw this system prompt
    assert other.usage.prompt_tokens_details.cached_tokens == context
    assert metric(b, "kvmem_store_lookups_total", f'result="hit",tier="{b_redis(b)}"') >= 1
    same = ask(b, "Which abstract mentions attention?")
    assert same.choices[0].message.content == first.choices[0].message.content


def b_redis(server) -> str:
    return next(m.group(1) for m in re.finditer(r'tier="(redis://[^"]+)"', httpx.get(server.url + "/metrics").text))


def test_concurrent_requests_share_no_state(replicas):
    """A chat answer is the same alone and while an embedding request (which hooks the shared model's layers) and
    a compressed request run beside it on the other worker."""
    server = replicas[0]
    chat = {"model": MODEL, "messages": COUNT, "temperature": 0, "max_tokens": 40, "kvmem": {"use_store": False}}
    alone = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=120).json()["choices"][0]
    texts = [f"Sentence number {i} about the weather and the sea." for i in range(64)]
    stop = threading.Event()
    embedded: list[int] = []

    def hammer():
        while not stop.is_set():
            r = httpx.post(server.url + "/v1/embeddings", timeout=120,
                           json={"model": MODEL, "input": texts, "kvmem": {"method": "token-prepending"}})
            embedded.append(r.status_code)

    t = threading.Thread(target=hammer)
    t.start()
    try:
        time.sleep(1.0)
        beside = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=120).json()["choices"][0]
    finally:
        stop.set()
        t.join()
    assert embedded and set(embedded) == {200}
    assert beside["message"]["content"] == alone["message"]["content"]


def test_serve_refuses_bad_settings_before_loading():
    from typer.testing import CliRunner

    from kvmem.cli import app

    r = CliRunner().invoke(app, ["serve", "--keep-ratio", "0"])
    assert r.exit_code == 2 and "keep ratio must be in (0, 1]" in r.output
    r = CliRunner().invoke(app, ["serve", "--method", "nope"])
    assert r.exit_code == 2 and "unknown method" in r.output
    for args, words in ((["--kv-budget", "lots"], "not a size"), (["--kv-budget", "1.5"], "fraction of memory"),
                        (["--kv-budget", "0MiB"], "more than 0 bytes"), (["--max-batch", "0"], "--max-batch must be")):
        r = CliRunner().invoke(app, ["serve", *args])
        assert r.exit_code == 2 and words in r.output, args


def test_gemma_sliding_window_reuse_through_the_server():
    """Gemma-3 (MQA, sliding 512 + global layers): a system prompt longer than the window, stored by one request,
    is loaded by the next, and greedy decoding from it is the same as from the computed prompt."""
    messages = [{"role": "system", "content": system_prompt(3)}, {"role": "user", "content": "Summarize the first one."}]
    with LocalServer(["--store", "memory", "--threads", "1"], model="gemma3-270m") as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
        ask = lambda: client.chat.completions.create(model="gemma3-270m", messages=messages, temperature=0,  # noqa: E731
                                                     max_tokens=8)
        cold, warm = ask(), ask()
        assert cold.usage.prompt_tokens > 600 and cold.usage.prompt_tokens_details.cached_tokens == 0
        assert warm.usage.prompt_tokens_details.cached_tokens > 512  # past the sliding window
        assert warm.choices[0].message.content == cold.choices[0].message.content
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model=MODEL, messages=FRANCE)  # this server serves gemma3-270m only
