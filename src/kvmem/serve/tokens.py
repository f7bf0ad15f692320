"""The OpenAI request fields about tokens, read from a request body and checked into `Sampling`'s fields:
`logprobs`/`top_logprobs`, `presence_penalty`/`frequency_penalty`, `logit_bias`, `echo`, `response_format` and
the grammar of a forced tool call. What they do is `serve.logits`; tools are `serve.tools`.

Refused, with a 400 naming the field: `suffix` (as vLLM: no fill-in-the-middle here), `best_of` above 1 (the
server does not rank candidates by likelihood; ask for `n` choices and their `logprobs`), `echo` and `tools` where
the endpoint has no such field (chat / completions)."""

from __future__ import annotations

import json
import numbers

from pydantic import BaseModel

from kvmem.serve.logits import MAX_TOP_LOGPROBS, check_grammar, vocab_size
from kvmem.serve.schemas import fail
from kvmem.serve.state import Server
from kvmem.serve.tools import forced_call_grammar, read_tools

# JSON between two tokens: up to 32 whitespace characters (indentation and newlines), never an endless run of them
JSON_OPTIONS = {"whitespace_pattern": r"[ \t\n\r]{0,32}"}


def _number(extra: dict, name: str, low: float, high: float) -> float:
    value = extra.get(name)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not low <= value <= high:
        fail(400, f"{name} must be a number in [{low:g}, {high:g}]; got {value!r}", param=name)
    return float(value)


def _logit_bias(extra: dict, vocab: int) -> dict[int, float]:
    bias = extra.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        fail(400, "logit_bias maps token ids (as strings) to numbers in [-100, 100]", param="logit_bias")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if not 0 <= token < vocab:
            fail(400, f"logit_bias: {key!r} is not a token id of this model (0 to {vocab - 1})", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not -100 <= value <= 100:
            fail(400, f"logit_bias: the bias of token {key} must be a number in [-100, 100]; got {value!r}",
                 param="logit_bias")
        out[token] = float(value)
    return out


def _logprobs(extra: dict, chat: bool) -> int | None:
    """How many alternatives to report per token (None: no logprobs)."""
    logprobs, top = extra.get("logprobs"), extra.get("top_logprobs")
    if chat:
        if logprobs not in (None, True, False):
            fail(400, f"logprobs is true or false for chat completions; got {logprobs!r}", param="logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS):
            fail(400, f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]; got {top!r}", param="top_logprobs")
        if top and not logprobs:
            fail(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (top or 0) if logprobs else None
    if top is not None:
        fail(400, "top_logprobs is a chat completions field; /v1/completions takes logprobs: <int>",
             param="top_logprobs")
    if logprobs is None:
        return None
    if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        fail(400, f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] for /v1/completions; got {logprobs!r}",
             param="logprobs")
    return logprobs


def _json_grammar(response_format) -> str | None:
    import llguidance

    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        schema = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            fail(400, 'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                 param="response_format")
    else:
        fail(400, f"response_format type must be text, json_object or json_schema; got {response_format!r}",
             param="response_format")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
    except ValueError as e:
        fail(400, f"response_format: {e}", param="response_format")
    if error := check_grammar(grammar):
        fail(400, f"response_format: the schema cannot be enforced: {error}", param="response_format")
    return grammar


def token_options(server: Server, body: BaseModel, chat: bool) -> dict:
    """`Sampling`'s token fields for this request, every one checked (400 naming the field)."""
    extra = body.model_extra or {}
    if extra.get("suffix"):
        fail(400, "suffix is not supported (no fill-in-the-middle), as in vLLM", param="suffix",
             code="unsupported_parameter")
    best_of = extra.get("best_of")
    if best_of not in (None, 1):
        fail(400, f"best_of={best_of!r} is not supported: the server does not rank candidates; ask for n choices "
                  "with logprobs", param="best_of", code="unsupported_parameter")
    echo = extra.get("echo")
    if echo not in (None, False, True) or echo and chat:
        fail(400, "echo is a /v1/completions field (true or false)", param="echo")
    if not chat and (extra.get("tools") or extra.get("tool_choice") or extra.get("functions")):
        fail(400, "tools go with /v1/chat/completions", param="tools")
    logprobs = _logprobs(extra, chat)
    grammar = _json_grammar(extra.get("response_format"))
    if chat:
        tools, choice = read_tools(server.lm.tokenizer, extra)
        forced = forced_call_grammar(server.lm.tokenizer, tools, choice) if tools else None
        if forced and grammar:
            fail(400, "a forced tool call (tool_choice required or named) and a response_format cannot both "
                      "shape the answer", param="response_format")
        grammar = grammar or forced
    return {"presence_penalty": _number(extra, "presence_penalty", -2, 2),
            "frequency_penalty": _number(extra, "frequency_penalty", -2, 2),
            "logit_bias": _logit_bias(extra, vocab_size(server.lm)),
            "logprobs": logprobs, "prompt_logprobs": bool(echo) and logprobs is not None, "grammar": grammar}


def tools_of(server: Server, body: BaseModel) -> list[dict] | None:
    """The tools the chat template renders for this request (None without tools or with tool_choice none)."""
    return read_tools(server.lm.tokenizer, body.model_extra or {})[0]


def parses_tool_calls(body: BaseModel) -> bool:
    """Whether the answer is parsed for tool calls: tools given and tool_choice not none."""
    extra = body.model_extra or {}
    return bool(extra.get("tools")) and extra.get("tool_choice") != "none"
