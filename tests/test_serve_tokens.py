"""The token side of the OpenAI API through `kvmem serve` and the official openai client: logprobs (chat and legacy
completions formats, streamed or not), presence/frequency penalties, logit_bias, echo, JSON mode (constrained by
llguidance), tools (Qwen2.5's Hermes template; SmolLM2's has none), seed, and the fields refused with a reason.

Real servers on loopback (subprocesses): SmolLM2 with continuous batching and without (`--no-batching`) answer the
cheap tests on both paths; a Qwen2.5-coder server answers the tools tests. Logprobs and penalties are checked
against a direct forward of the model in this process."""

from __future__ import annotations

import json
import threading

import httpx2 as httpx
import openai
import pytest
import torch

from kvmem.models import load_tokenizer
from kvmem.prompts import chat_prompt
from kvmem.serve.local import LocalServer
from kvmem.serve.tools import ToolTextFilter, parse_tool_calls

MODEL = "smollm2-135m"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module", params=["batching", "no-batching"])
def server(request):
    args = ["--threads", "1", "--max-n", "2"] + (["--no-batching", "--workers", "1"] if request.param == "no-batching"
                                                  else [])
    with LocalServer(args, startup_s=600) as s:  # a loaded machine (a kernel rebuild beside) can take minutes
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def ids_of(tokenizer, tokens: list[str]) -> list[int]:
    """The token ids behind the token texts a response reports (each text is one token of its own)."""
    ids = [tokenizer(t, add_special_tokens=False).input_ids for t in tokens]
    assert all(len(i) == 1 for i in ids), tokens
    return [i[0] for i in ids]


@torch.no_grad()
def direct_logprobs(lm, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at every position of `ids`, one plain forward (no server)."""
    return torch.log_softmax(lm.model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


# -- logprobs ---------------------------------------------------------------------------------------------------------
def test_chat_logprobs_are_the_models_streamed_or_not(client, smollm2):
    kw = dict(model=MODEL, messages=FRANCE, temperature=0, max_tokens=6, logprobs=True, top_logprobs=5)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    assert "".join(t.token for t in content) == r.choices[0].message.content
    ids = ids_of(smollm2.tokenizer, [t.token for t in content])
    prompt = chat_prompt(smollm2.tokenizer, FRANCE).ids
    want = direct_logprobs(smollm2, prompt + ids)[len(prompt) - 1:]
    for i, t in enumerate(content):
        assert len(t.top_logprobs) == 5 and bytes(t.bytes).decode() == t.token
        assert t.logprob == max(a.logprob for a in t.top_logprobs) == t.top_logprobs[0].logprob  # greedy: the best
        assert t.logprob == pytest.approx(want[i, ids[i]].item(), abs=2e-4)
        top = want[i].topk(5)
        assert [a.logprob for a in t.top_logprobs] == pytest.approx(top.values.tolist(), abs=2e-4)
        assert [smollm2.tokenizer.decode([j]) for j in top.indices.tolist()] == [a.token for a in t.top_logprobs]
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-5)
    plain = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_with_echo(client, smollm2):
    prompt = "The capital of France is"
    kw = dict(model=MODEL, prompt=prompt, temperature=0, max_tokens=4, logprobs=3, echo=True)
    r = client.completions.create(**kw)
    choice, lp = r.choices[0], r.choices[0].logprobs
    assert choice.text.startswith(prompt) and "Paris" in choice.text[len(prompt):]
    prompt_ids = smollm2.tokenizer(prompt).input_ids
    assert len(lp.tokens) == len(prompt_ids) + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing before the first token
    ids = prompt_ids + ids_of(smollm2.tokenizer, lp.tokens[len(prompt_ids):])
    want = direct_logprobs(smollm2, ids)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(want[i - 1, ids[i]].item(), abs=2e-4)
        assert lp.tokens[i] in lp.top_logprobs[i] and len(lp.top_logprobs[i]) <= 4  # 3 best and the token itself
    for token, offset in zip(lp.tokens, lp.text_offset):
        assert choice.text[offset:offset + len(token)] == token
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    assert [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset] == lp.text_offset
    no_echo = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=4, logprobs=0)
    assert no_echo.choices[0].text == choice.text[len(prompt):] and no_echo.choices[0].logprobs.text_offset[0] == 0
    assert all(len(t) == 1 for t in no_echo.choices[0].logprobs.top_logprobs)  # logprobs=0: the token alone


# -- penalties, logit_bias ------------------------------------------------------------------------------------------------
def test_penalties_follow_openais_formula(client, smollm2):
    """Greedy with penalties: every token is the argmax of logit - frequency * count - presence * (count > 0), the
    counts over the tokens generated before it (checked on a direct forward); without them the text repeats."""
    prompt, freq, pres = "one one one one one one", 1.5, 0.7
    plain = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8).choices[0].text
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, frequency_penalty=freq,
                                  presence_penalty=pres, logprobs=0)
    ids = smollm2.tokenizer(prompt).input_ids
    out = ids_of(smollm2.tokenizer, r.choices[0].logprobs.tokens)
    assert smollm2.tokenizer.decode(out) == r.choices[0].text and len(out) == 8
    logits = torch.log_softmax(smollm2.model(input_ids=torch.tensor([ids + out])).logits[0].float(), -1)
    counts = torch.zeros(logits.shape[-1])
    for i, token in enumerate(out):
        shaped = logits[len(ids) - 1 + i] - freq * counts - pres * (counts > 0).float()
        assert shaped.argmax().item() == token, i
        counts[token] += 1
    assert r.choices[0].text != plain


def test_logit_bias_moves_the_greedy_token(client):
    kw = dict(model=MODEL, messages=FRANCE, temperature=0, max_tokens=3, logprobs=True, top_logprobs=2)
    first = client.chat.completions.create(**kw).choices[0].logprobs.content[0]
    greedy, second = first.top_logprobs
    token_id = ids_of(load_tokenizer(MODEL), [greedy.token])[0]
    banned = client.chat.completions.create(logit_bias={str(token_id): -100}, **kw).choices[0].logprobs.content
    assert banned[0].token == second.token  # the runner-up, and its logprob is still the model's (raw)
    assert banned[0].logprob == pytest.approx(second.logprob, abs=1e-5)
    forced = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=3,
                                            logit_bias={str(token_id): 100})
    assert forced.choices[0].message.content == greedy.token * 3


# -- JSON mode ------------------------------------------------------------------------------------------------------
def test_json_mode_parses_at_temperature_one(client):
    """json_object: every answer that ends parses (an object of any size may still be cut by max_tokens, as with
    OpenAI: finish_reason "length"); a schema with bounded strings ends within max_tokens and parses every time."""
    ask = [{"role": "user", "content": "Give a JSON object with one key, color, and its value."}]
    finished = 0
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=ask, temperature=1.0, seed=seed, max_tokens=64,
                                           response_format={"type": "json_object"})
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert finish in ("stop", "length") and text.lstrip().startswith("{")
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
            finished += 1
    assert finished >= 1
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    person = [{"role": "user", "content": "Invent a person."}]
    for seed in range(2):
        chunks = client.chat.completions.create(model=MODEL, messages=person, temperature=1.0, seed=seed,
                                                max_tokens=40, response_format=fmt, stream=True)
        got = json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
        assert set(got) == {"name", "age"} and isinstance(got["age"], int) and len(got["name"]) <= 12


# -- seed --------------------------------------------------------------------------------------------------------------
def test_same_seed_same_output_with_other_requests_in_flight(client, server):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Write about the sea."}], temperature=1.1,
              max_tokens=8, seed=11, user="someone")
    alone = client.chat.completions.create(**kw).choices[0].message.content
    other = client.chat.completions.create(**(kw | {"seed": 12})).choices[0].message.content
    assert other != alone
    busy = threading.Thread(target=lambda: httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": FRANCE, "max_tokens": 24, "temperature": 1.0, "kvmem": {"ignore_eos": True}}))
    busy.start()
    try:
        beside = client.chat.completions.create(**kw).choices[0].message.content
    finally:
        busy.join()
    assert beside == alone


# -- refusals ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, change, param", [
    ("chat", {"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logit_bias": {"999999": 5}}, "logit_bias"),
    ("chat", {"logit_bias": {"12": 101}}, "logit_bias"),
    ("chat", {"logit_bias": {"dog": 1}}, "logit_bias"),
    ("chat", {"presence_penalty": 3}, "presence_penalty"),
    ("chat", {"frequency_penalty": "much"}, "frequency_penalty"),
    ("chat", {"echo": True}, "echo"),
    ("chat", {"tools": TOOLS}, "tools"),  # SmolLM2's template renders no tools
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"response_format": {"type": "yaml"}}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}},
     "response_format"),
    ("completions", {"suffix": "end"}, "suffix"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"tools": TOOLS}, "tools"),
])
def test_bad_token_fields_name_their_param(server, path, change, param):
    base = {"model": MODEL, "max_tokens": 2} | ({"messages": FRANCE} if path == "chat" else {"prompt": "Hello"})
    r = httpx.post(f"{server.url}/v1/{'chat/completions' if path == 'chat' else 'completions'}", json=base | change,
                   timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


# -- tools ---------------------------------------------------------------------------------------------------------------
def test_tool_calls_are_parsed_out_of_hermes_text():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check." and len(calls) == 1
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    two, _ = parse_tool_calls("<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"b\"}")
    assert two is None and [c["function"]["name"] for c in parse_tool_calls(
        "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"b\"}")[1]] == ["a", "b"]
    assert parse_tool_calls("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    f = ToolTextFilter()
    sent = "".join(f.feed(d) for d in ["Sure", ". <tool", "_call>\n{\"name\": \"get_weather\", ",
                                         "\"arguments\": {\"city\": \"Rome\"}}\n</tool_call>"])
    rest, calls = f.finish()
    assert sent == "Sure. " and rest == "" and json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}


@pytest.fixture(scope="module")
def qwen_client():
    with LocalServer(["--threads", "1"], model="qwen2.5-coder-0.5b", startup_s=600) as s:  # a 0.5B load, beside others
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_tools_through_qwens_template(qwen_client):
    """Qwen2.5's template renders the tools; a forced call (tool_choice required / named) is constrained to a
    `<tool_call>` block of a listed function with schema-valid arguments and parsed into tool_calls; the tool's
    answer goes back as a `role: tool` message. (With `auto` this 0.5B coder model tends to answer with a ```json
    block rather than a `<tool_call>`, which stays content: nothing is guessed.)"""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model="qwen2.5-coder-0.5b", messages=ask, temperature=0, max_tokens=32, tools=TOOLS)
    r = qwen_client.chat.completions.create(tool_choice="required", **kw)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    chunks = list(qwen_client.chat.completions.create(
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True, **kw))
    deltas = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert [d.function.name for d in deltas] == ["get_weather"] and json.loads(deltas[0].function.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    back = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "sunny"}'}]
    answer = qwen_client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=back, temperature=0,
                                                 max_tokens=24, tools=TOOLS)
    assert answer.choices[0].message.content and "21" in answer.choices[0].message.content
