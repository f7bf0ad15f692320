"""The request side of `kvmem serve`'s OpenAI API: every field's validation (a 400 naming the field), the accepted-and-
ignored fields, embeddings' `dimensions` and base64, /v1/models, x-request-id, the access log, the API key and CORS.

Most tests run the app in process (FastAPI's TestClient, real SmolLM2, one worker, max_tokens 4); the official openai
client talks to it through the TestClient (an httpx2 client). LangChain and the --api-key / CORS command line are
tested against a real `kvmem serve` on loopback.
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient

from kvmem.prompts import chat_prompt
from kvmem.serve.app import create_app
from kvmem.serve.local import LocalServer
from kvmem.serve.validate import completion_limit

MODEL = "smollm2-135m"
HI = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def started():
    return time.time()


@pytest.fixture(scope="module")
def app_client(smollm2, started):
    app = create_app(smollm2, max_tokens=4, max_n=2, timeout_s=60)
    with TestClient(app) as c:
        yield c


@pytest.fixture(scope="module")
def client(app_client):
    """The official openai client, through the in-process app."""
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=app_client, max_retries=0)


def chat(c, change: dict, path: str = "/v1/chat/completions"):
    base = {"model": MODEL, "messages": HI, "max_tokens": 2} if "chat" in path else \
        {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2} if "completions" in path else \
        {"model": MODEL, "input": "hello"}
    return c.post(path, json={k: v for k, v in (base | change).items() if v is not ...})


# -- refusals: status, param, a message naming the problem --------------------------------------------------------
CHAT, TEXT, EMB = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
REFUSALS = [
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", "'assistant', 'tool' or 'function'"),
    (CHAT, {"messages": []}, "messages", "at least one message"),
    (CHAT, {"messages": [{"role": "user", "content": None}]}, "messages.0.content", "needs content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0.type", "only text content parts"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages.0.content.0.text",
     "string 'text'"),
    (CHAT, {"max_tokens": 100_000_000}, "max_tokens", "maximum context length is 8192 tokens"),
    (CHAT, {"max_tokens": ..., "max_completion_tokens": 8190}, "max_completion_tokens", "(8190 > 8192 - "),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 9000}]}, "messages", "the prompt alone is"),
    (CHAT, {"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    (CHAT, {"temperature": 2.5}, "temperature", "less than or equal to 2"),
    (CHAT, {"top_p": 0}, "top_p", "greater than 0"),
    (CHAT, {"n": 0}, "n", "greater than or equal to 1"),
    (CHAT, {"n": 3}, "n", "n=3 is more than"),
    (CHAT, {"stop": 5}, "stop", "valid string"),
    (CHAT, {"stop": ["a", "b", "c", "d", "e"]}, "stop", "up to 4"),
    (CHAT, {"stream_options": {"include_usage": True}}, "stream_options", "stream=true"),
    (CHAT, {"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "true or false"),
    (CHAT, {"stream": True, "stream_options": {"usage": True}}, "stream_options", "not usage"),
    (CHAT, {"seed": 2**64}, "seed", "64-bit integer"),
    (CHAT, {"user": 5}, "user", "valid string"),
    (CHAT, {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16"),
    (CHAT, {"metadata": {"k": 5}}, "metadata.k", "valid string"),
    (CHAT, {"service_tier": "gold"}, "service_tier", "'auto', 'default'"),
    (CHAT, {"store": True}, "store", "keeps no completions"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities", "text only"),
    (CHAT, {"audio": {"voice": "alloy", "format": "mp3"}}, "audio", "text only"),
    (CHAT, {"reasoning_effort": "high"}, "reasoning_effort", "do not reason"),
    (CHAT, {"prediction": {"type": "content", "content": "x"}}, "prediction", "predicted outputs"),
    (CHAT, {"temprature": 0}, "temprature", "unrecognized request argument 'temprature'"),
    (CHAT, {"kvmem": {"keep_ratio": "lots"}}, "kvmem.keep_ratio", "valid number"),
    (TEXT, {"max_tokens": 9000}, "max_tokens", "maximum context length is 8192 tokens"),
    (TEXT, {"prompt": None}, "prompt", "valid string"),
    (TEXT, {"prompt": [[1, 2], [3]]}, "prompt", "valid string"),
    (TEXT, {"messages": HI}, "messages", "unrecognized request argument 'messages' for /v1/completions"),
    (TEXT, {"metadata": {"a": "b"}}, "metadata", "unrecognized request argument 'metadata'"),
    (TEXT, {"seed": -2**63 - 1}, "seed", "64-bit integer"),
    (EMB, {"dimensions": 0}, "dimensions", "greater than or equal to 1"),
    (EMB, {"dimensions": 100_000}, "dimensions", "more than the 576 dimensions"),
    (EMB, {"encoding_format": "hex"}, "encoding_format", "float or base64"),
    (EMB, {"user": ["bob"]}, "user", "valid string"),
    (EMB, {"input": "word " * 9000}, "input", "reads at most 8192"),
    (EMB, {"temperature": 0}, "temperature", "unrecognized request argument 'temperature' for /v1/embeddings"),
]


@pytest.mark.parametrize("path, change, param, words", REFUSALS,
                         ids=[f"{p.split('/')[-1]}-{next(iter(c))}" for p, c, _, _ in REFUSALS])
def test_each_bad_field_gets_a_400_naming_it(app_client, path, change, param, words):
    r = chat(app_client, change, path)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_context_length_error_names_the_numbers_like_vllm(app_client, smollm2):
    r = chat(app_client, {"max_tokens": 100_000_000})
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    n = len(chat_prompt(smollm2.tokenizer, HI).ids)
    assert f"the request has {n} prompt tokens (100000000 > 8192 - {n})" in error["message"]
    one_over = chat(app_client, {"max_tokens": 8192 - n + 1}).json()["error"]  # the room left is the bound
    assert one_over["code"] == "context_length_exceeded" and f"({8192 - n + 1} > 8192 - {n})" in one_over["message"]


def test_the_default_max_tokens_is_cut_to_the_room_left():
    class LM:
        max_context = 100

    assert completion_limit(LM, 90, None, "max_tokens", 256, "messages") == 10  # not a refusal: nobody asked for 256
    assert completion_limit(LM, 90, 10, "max_tokens", 256, "messages") == 10
    assert completion_limit(LM, 10, None, "max_tokens", 16, "prompt") == 16


def test_accepted_fields_change_nothing(app_client):
    plain = chat(app_client, {"temperature": 0, "max_tokens": 6})
    ignored = {"user": "alice", "metadata": {"team": "search"}, "service_tier": "auto", "parallel_tool_calls": False,
               "safety_identifier": "u-1", "prompt_cache_key": "k", "prompt_cache_retention": "24h", "store": False,
               "modalities": ["text"], "reasoning_effort": None, "n": None, "top_p": None}
    r = chat(app_client, {"temperature": 0, "max_tokens": 6} | ignored)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["message"]["content"]
    r = chat(app_client, {"temperature": None, "stream": True, "stream_options": {"include_usage": True,
                                                                                  "include_obfuscation": True}})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    text = chat(app_client, {"user": "alice", "max_tokens": None}, TEXT)
    assert text.status_code == 200 and text.json()["usage"]["completion_tokens"] <= 16  # OpenAI's default for text


def test_every_openai_role_is_accepted(app_client):
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": [{"type": "text", "text": "Bye"}]}]
    assert chat(app_client, {"messages": messages}).status_code == 200
    for role in ("system", "tool", "function"):  # the chat template decides what it can place; never a 500
        r = chat(app_client, {"messages": [{"role": "user", "content": "Hi"}, {"role": role, "content": "x"},
                                           {"role": "user", "content": "Bye"}]})
        assert r.status_code in (200, 400), r.text


# -- embeddings --------------------------------------------------------------------------------------------------
def test_embedding_dimensions_and_base64_round_trip_the_official_client(client):
    texts = ["The cat sat on the mat.", "Stock markets fell today."]
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    default = client.embeddings.create(model=MODEL, input=texts)  # the client asks for base64 and decodes it
    assert np.array_equal(np.array([d.embedding for d in floats.data], np.float32),
                          np.array([d.embedding for d in default.data], np.float32))
    full = np.array([d.embedding for d in floats.data])
    short = np.array([d.embedding for d in client.embeddings.create(model=MODEL, input=texts, dimensions=32).data])
    assert short.shape == (2, 32)
    np.testing.assert_allclose(np.linalg.norm(short, axis=1), 1.0, rtol=1e-5)
    want = full[:, :32] / np.linalg.norm(full[:, :32], axis=1, keepdims=True)  # truncated, then re-normalised
    np.testing.assert_allclose(short, want, rtol=1e-4, atol=1e-6)
    mini = client.embeddings.create(model="minilm", input=texts, dimensions=8)
    assert len(mini.data[0].embedding) == 8


# -- models ------------------------------------------------------------------------------------------------------
def test_models_have_the_fields_clients_read(client, app_client, started):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL, "minilm"]
    m = client.models.retrieve(MODEL)
    assert m.object == "model" and m.owned_by == "kvmem" and started - 1 <= m.created <= time.time()
    assert m.model_extra["max_model_len"] == m.model_extra["max_context"] == 8192
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    assert "gpt-4" in e.value.body["message"]


# -- request ids, access log, crashes ------------------------------------------------------------------------------
def access_lines(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "kvmem.access"]


def test_request_ids_are_echoed_and_logged(app_client, caplog):
    caplog.set_level(logging.INFO, logger="kvmem.access")
    r = app_client.post(CHAT, json={"model": MODEL, "messages": HI, "max_tokens": 3, "user": "alice"},
                        headers={"x-request-id": "trace-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    usage = r.json()["usage"]
    bad = app_client.post(CHAT, json={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]})
    with app_client.stream("POST", CHAT, json={"model": MODEL, "messages": HI, "max_tokens": 3, "stream": True},
                           headers={"x-request-id": "bad id"}) as s:
        streamed_id = s.headers["x-request-id"]
        body = s.read().decode()
    missing = app_client.get("/v1/nothing-here")
    assert len({bad.headers["x-request-id"], streamed_id, missing.headers["x-request-id"]}) == 3
    assert streamed_id != "bad id" and "[DONE]" in body  # an id with a space is replaced, not echoed
    lines = {line["id"]: line for line in access_lines(caplog)}
    ok = lines["trace-42"]
    assert ok["method"] == "POST" and ok["path"] == CHAT and ok["status"] == 200 and ok["user"] == "alice"
    assert ok["model"] == MODEL and ok["duration_s"] > 0
    assert (ok["prompt_tokens"], ok["completion_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert lines[bad.headers["x-request-id"]]["status"] == 400
    assert lines[streamed_id]["status"] == 200 and lines[streamed_id]["completion_tokens"] == 3
    assert lines[missing.headers["x-request-id"]]["status"] == 404


def test_a_crash_is_a_500_body_with_the_request_id(app_client, monkeypatch, caplog):
    import kvmem.serve.app as app_module

    def broken(*_):
        raise RuntimeError("boom")

    monkeypatch.setattr(app_module, "chat_job", broken)
    caplog.set_level(logging.INFO, logger="kvmem.access")
    r = app_client.post(CHAT, json={"model": MODEL, "messages": HI}, headers={"x-request-id": "crash-1"})
    assert r.status_code == 500 and r.headers["x-request-id"] == "crash-1"
    assert r.json()["error"] == {"message": "internal error: RuntimeError: boom", "type": "server_error",
                                 "param": None, "code": None}
    assert "Traceback" not in r.text
    assert any(rec.name == "kvmem.serve" and rec.exc_info for rec in caplog.records)  # the traceback goes to the log
    assert {"id": "crash-1", "status": 500}.items() <= {k: v for line in access_lines(caplog) if line["id"] == "crash-1"
                                                         for k, v in line.items()}.items()


# -- API key and CORS (in process) ----------------------------------------------------------------------------------
def test_api_key_and_cors(smollm2):
    app = create_app(smollm2, max_tokens=2, api_key="s3cret", cors_origins=["http://localhost:3000"])
    with TestClient(app) as c:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
            r = c.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
            assert "Authorization: Bearer" in r.json()["error"]["message"] and r.headers["x-request-id"]
        assert c.get("/v1/models", headers={"authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200  # open for probes
        pre = c.options(CHAT, headers={"origin": "http://localhost:3000", "access-control-request-method": "POST",
                                       "access-control-request-headers": "authorization,content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://localhost:3000"
        denied = c.get("/v1/models", headers={"origin": "http://localhost:3000"})  # a browser reads the 401 too
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "x-request-id" in denied.headers["access-control-expose-headers"]
        other = c.options(CHAT, headers={"origin": "http://evil.example", "access-control-request-method": "POST"})
        assert "access-control-allow-origin" not in other.headers


def test_an_empty_api_key_is_refused_before_loading():
    from typer.testing import CliRunner

    from kvmem.cli import app

    result = CliRunner().invoke(app, ["serve", "--model", "no-such-model"], env={"KVMEM_API_KEY": " "})
    assert result.exit_code != 0 and "KVMEM_API_KEY) is empty" in result.output


# -- a second client nobody here wrote: LangChain, against a live server with an API key ----------------------------
@pytest.fixture(scope="module")
def keyed():
    with LocalServer(["--no-batching", "--threads", "1", "--max-tokens", "8"], env={"KVMEM_API_KEY": "lc-key"}) as s:
        yield s


def test_langchain_chat_streaming_and_embeddings(keyed):
    from langchain_openai import ChatOpenAI, OpenAIEmbeddings

    llm = ChatOpenAI(model=MODEL, base_url=keyed.url + "/v1", api_key="lc-key", temperature=0, max_tokens=8,
                     max_retries=0, timeout=120)
    answer = llm.invoke("What is the capital of France?")
    assert "Paris" in answer.content
    assert answer.usage_metadata["output_tokens"] <= 8 and answer.usage_metadata["input_tokens"] > 5
    chunks = list(llm.stream("What is the capital of France?"))
    assert len([c for c in chunks if c.content]) > 1 and "".join(c.content for c in chunks) == answer.content
    emb = OpenAIEmbeddings(model=MODEL, base_url=keyed.url + "/v1", api_key="lc-key", check_embedding_ctx_length=False,
                           max_retries=0)
    docs = emb.embed_documents(["The cat sat on the mat.", "Stock markets fell today."])
    query = emb.embed_query("The cat sat on the mat.")
    assert len(docs) == 2 and len(query) == 576
    np.testing.assert_allclose(query, docs[0], rtol=1e-4, atol=1e-6)  # the same text, the same vector
    with pytest.raises(openai.AuthenticationError):
        ChatOpenAI(model=MODEL, base_url=keyed.url + "/v1", api_key="wrong", max_retries=0).invoke("hi")


# -- fuzz: bodies around the schemas never crash the server --------------------------------------------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_leaf = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=16)
         | st.sampled_from([2**63, -2**63 - 1, 2**64, 10**30, -1, 0, 1e308, "", "\u202e\U0001f600\x00"]))
JUNK = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=4), max_leaves=12)
TEXT_ = st.text(max_size=60)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                                 "content": TEXT_ | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                    "text": TEXT_}), max_size=2)})
KVMEM = st.fixed_dictionaries({}, optional={
    "method": st.sampled_from(["full", "snapkv", "streamingllm", "h2o"]), "keep_ratio": st.floats(0.1, 1.0),
    "quant": st.sampled_from(["kivi-4", "kivi-2"]), "ignore_eos": st.booleans(), "use_store": st.booleans()})
SHARED = {"max_tokens": st.integers(1, 2), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
          "n": st.integers(1, 2), "stop": TEXT_ | st.lists(TEXT_, max_size=5), "stream": st.booleans(),
          "seed": st.integers(), "user": TEXT_, "kvmem": KVMEM}
# plausible values: each body is one of these, then a few fields replaced by junk, dropped or added
BODIES = {
    CHAT: ({"model": st.just(MODEL), "messages": st.lists(MESSAGE, min_size=1, max_size=3)},
           {**SHARED, "max_completion_tokens": st.integers(1, 2), "metadata": st.dictionaries(TEXT_, TEXT_, max_size=3),
            "service_tier": st.sampled_from(["auto", "default"]), "store": st.booleans(), "logprobs": st.booleans(),
            "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})}),
    TEXT: ({"model": st.just(MODEL), "prompt": st.text(min_size=1, max_size=60) | st.lists(st.integers(0, 49151),
                                                                                           min_size=1, max_size=8)},
           {**SHARED, "echo": st.booleans(), "suffix": TEXT_}),
    EMB: ({"model": st.sampled_from([MODEL, "minilm"]), "input": st.text(min_size=1, max_size=60)
           | st.lists(st.text(min_size=1, max_size=30), min_size=1, max_size=3)},
          {"encoding_format": st.sampled_from(["float", "base64"]), "dimensions": st.integers(1, 600), "user": TEXT_,
           "kvmem": st.fixed_dictionaries({}, optional={"method": st.sampled_from(["pooling", "prompteol", "echo"]),
                                                        "layer": st.integers(-40, 40)})}),
}


def body_of(path: str):
    required, optional = BODIES[path]
    names = sorted({*required, *optional, "kvmem.method", "kvmem.layer", "messages.0.role", "messages.0.content"})
    plain = st.fixed_dictionaries(required, optional=optional)
    changes = st.lists(st.tuples(st.sampled_from(names) | st.text(max_size=10), JUNK | st.just(...)), max_size=2)

    def change(body: dict, edits: list) -> dict:
        for name, value in edits:
            head, _, rest = name.partition(".")
            target, key = body, name
            if rest and isinstance(body.get(head), (dict, list)):  # a nested field: kvmem.method, messages.0.role
                index, _, key = rest.partition(".")
                target = body[head] if isinstance(body[head], dict) else (body[head][0] if body[head] else {})
                key = key or index
                if not isinstance(target, dict):
                    continue
            if value is ...:
                target.pop(key, None)
            else:
                target[key] = value
        return body

    return st.builds(change, plain, changes) | JUNK


def small(body):
    """Bounded work per example: a valid max_tokens above 2 (or none on a text completion, 16) would decode for long."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body[key], bool) and 2 < body[key] <= 8192:
                body[key] = 2
    return body


@pytest.mark.parametrize("path", [CHAT, TEXT, EMB])
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_fuzzed_bodies_never_crash_the_server(app_client, path, data):
    body = small(data.draw(body_of(path)))
    if isinstance(body, dict) and path != EMB and isinstance(body.get("max_tokens"), type(None)):
        body["max_tokens"] = 2
    r = app_client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert r.status_code in (200, 400, 404, 504), (body, r.status_code, r.text[:500])
    assert "Traceback" not in r.text and r.headers["x-request-id"]
    if r.status_code != 200:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and error["type"], r.text
    assert app_client.get("/health").json()["status"] == "ok"


def test_broken_bytes_get_a_400(app_client):
    for raw in (b"\xff\xfe\x00junk", b'{"model": "smollm2-135m", "messages": [' * 50, b"[]", b"null", b'"x"', b""):
        r = app_client.post(CHAT, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "Traceback" not in r.text, (raw, r.text)
