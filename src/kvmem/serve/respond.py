"""A job run for an HTTP request: admitted to the engine (429 when it is full), its events answered as one JSON
body or as server-sent events in OpenAI's chunk format, with usage and kvmem's own report; cancelled when the
client goes away (499, counted). Logprobs in OpenAI's two formats (chat: `logprobs.content[]`; completions: the
legacy `tokens`/`token_logprobs`/`top_logprobs`/`text_offset`), `echo`ed prompts, and tool calls parsed out of
the text (`serve.tools`) are shaped here."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvmem.serve.engine import Busy, Event, Job, Options
from kvmem.serve.logits import TokenLogprob
from kvmem.serve.schemas import APIError, Generation, error_body, fail
from kvmem.serve.state import Server
from kvmem.serve.tokens import parses_tool_calls
from kvmem.serve.tools import ToolTextFilter, parse_tool_calls


async def until_disconnect(request: Request, awaitable):
    """Await `awaitable`, cancelling it if the client goes away (None then)."""
    task = asyncio.ensure_future(awaitable)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.2)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            return None


def error_of(event: Event) -> APIError:
    d = event.data
    return APIError(d["status"], d["message"], d["type"], code="timeout" if d["type"] == "timeout" else None)


def observe(server: Server, event: Event, job: Job) -> None:
    if event.kind == "prefilled" and event.choice == 0:
        server.metrics.record_prefill(len(job.prompt.ids) + sum(map(len, job.documents)), event.data["reused_tokens"])
    elif event.kind == "done":
        server.metrics.record_done(event.data)
        job.completion_tokens += event.data["completion_tokens"]


def usage(done: list[dict]) -> dict:
    prompt_tokens = done[0]["prompt_tokens"]
    completion = sum(d["completion_tokens"] for d in done)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": done[0]["reused_tokens"]}}


def kvmem_info(done: list[dict], o: Options) -> dict:
    return {"method": o.method, "keep_ratio": o.keep_ratio, "quant": o.quant, "reuse": o.reuse,
            "reused_tokens": done[0]["reused_tokens"], "kv_bytes": done[0]["kv_bytes"],
            "kv_bytes_full": done[0]["kv_bytes_full"], "ttft_s": done[0]["ttft_s"]}


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    """OpenAI's `ChoiceLogprobs` of a chat choice (or chunk)."""
    return {"content": [{"token": e.text, "logprob": e.logprob, "bytes": e.bytes,
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": b} for t, b, lp in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(answer: list[TokenLogprob], prompt: list[TokenLogprob] = (), echoed: int = 0) -> dict:
    """The legacy `Logprobs` of /v1/completions: each token's alternatives include the token itself, as OpenAI's
    do (so up to logprobs + 1 of them); with `echo`, the `prompt`'s tokens come first, its first token without any
    (null). Offsets count from the start of the returned text, where the answer follows `echoed` characters."""
    entries, tops = [*prompt, *answer], []
    for e in entries:
        top = None if e.logprob is None else {t: lp for t, _, lp in e.top}
        if top is not None:
            top.setdefault(e.text, e.logprob)
        tops.append(top)
    return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops, "text_offset": [e.offset for e in prompt] + [e.offset + echoed for e in answer]}


def echo_text(server: Server, body: Generation, job: Job, chat: bool) -> str:
    """The prompt a completion with `echo` starts with: as sent, or decoded from the token ids sent ('' without)."""
    if chat or not (body.model_extra or {}).get("echo"):
        return ""
    p = body.prompt
    if isinstance(p, list) and p and isinstance(p[0], str):
        p = p[0]
    return p if isinstance(p, str) else server.lm.tokenizer.decode(job.prompt.ids)


def gone(server: Server, job: Job, endpoint: str) -> Response:
    job.cancel.set()
    server.metrics.cancelled.inc()
    server.metrics.requests.labels(endpoint, "499").inc()
    return Response(status_code=499)  # nobody reads it: the client has gone


async def respond(server: Server, request: Request, body: Generation, job: Job, endpoint: str, chat: bool):
    """Admit `job` and answer with its events: an SSE stream or one JSON body; 499 if the client goes away."""
    try:
        server.engine.admit(job)
    except Busy as e:
        fail(429, str(e), "rate_limit_error", code="busy", headers={"Retry-After": str(e.retry_after)})
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created, model = int(time.time()), server.lm.name
    events = server.engine.run(job)
    if body.stream:
        first = await until_disconnect(request, anext(events))
        if first is None:
            return gone(server, job, endpoint)
        if first.kind == "error":
            await events.aclose()
            raise error_of(first)
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(stream(server, events, first, job, rid, created, model, endpoint, chat, include_usage,
                                        body),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    n, wants_logprobs = job.sampling.n, job.sampling.logprobs is not None
    echo = echo_text(server, body, job, chat)

    async def collect():
        texts, done, logprobs, prompt_logprobs = [""] * n, [], [[] for _ in range(n)], []
        finish = [None] * n
        async for event in events:
            observe(server, event, job)
            if event.kind == "error":
                raise error_of(event)
            if event.kind == "prefilled":
                prompt_logprobs = event.data.get("prompt_logprobs", prompt_logprobs)
            elif event.kind == "delta":
                texts[event.choice] += event.text
                logprobs[event.choice] += event.data.get("logprobs", [])
            elif event.kind == "done":
                finish[event.choice] = event.finish_reason
                done.append(event.data)
        return texts, finish, done, logprobs, prompt_logprobs

    result = await until_disconnect(request, collect())
    if result is None:
        return gone(server, job, endpoint)
    texts, finish, done, logprobs, prompt_logprobs = result
    if chat:
        choices = []
        for i, (t, f) in enumerate(zip(texts, finish)):
            content, calls = parse_tool_calls(t) if parses_tool_calls(body) else (t, [])
            message = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
            f = "tool_calls" if calls else f
            choices.append({"index": i, "message": message, "finish_reason": f,
                            "logprobs": chat_logprobs(logprobs[i]) if wants_logprobs else None})
    else:
        choices = [{"index": i, "text": echo + t, "finish_reason": f,
                    "logprobs": completion_logprobs(logprobs[i], prompt_logprobs, len(echo)) if wants_logprobs else None}
                   for i, (t, f) in enumerate(zip(texts, finish))]
    server.metrics.requests.labels(endpoint, "200").inc()
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "system_fingerprint": server.fingerprint, "choices": choices, "usage": usage(done),
            "kvmem": kvmem_info(done, job.options)}


async def stream(server: Server, events, first: Event, job: Job, rid: str, created: int, model: str, endpoint: str, chat: bool,
                 include_usage: bool, body: Generation):
    kind = "chat.completion.chunk" if chat else "text_completion"
    echo = echo_text(server, body, job, chat)
    tools = [ToolTextFilter() for _ in range(job.sampling.n)] if chat and parses_tool_calls(body) else None
    prompt_logprobs: list[TokenLogprob] = []

    def chunk(choices: list, **extra) -> str:
        return "data: " + json.dumps({"id": rid, "object": kind, "created": created, "model": model,
                                      "system_fingerprint": server.fingerprint, "choices": choices, **extra}) + "\n\n"

    def choice(i: int, text: str | None = None, finish: str | None = None, role: bool = False,
               logprobs: list[TokenLogprob] | None = None, prompt: list[TokenLogprob] = (), calls: list = ()) -> dict:
        if not chat:
            return {"index": i, "text": text or "", "finish_reason": finish,
                    "logprobs": completion_logprobs(logprobs or [], prompt, len(echo)) if logprobs or prompt else None}
        delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {}) | (
            {"tool_calls": [c | {"index": k} for k, c in enumerate(calls)]} if calls else {})
        return {"index": i, "delta": delta, "finish_reason": finish,
                "logprobs": chat_logprobs(logprobs) if logprobs else None}

    done, status = [], "200"
    try:
        event = first
        while True:
            observe(server, event, job)
            if event.kind == "prefilled" and chat:
                yield chunk([choice(event.choice, "", role=True)])
            elif event.kind == "prefilled" and echo:  # the prompt comes first (with its logprobs, asked for)
                prompt_logprobs = event.data.get("prompt_logprobs", prompt_logprobs)
                yield chunk([choice(event.choice, echo, prompt=prompt_logprobs)])
            elif event.kind == "delta":
                text, logprobs = event.text, event.data.get("logprobs")
                if tools:
                    text = tools[event.choice].feed(text)
                if text or logprobs:
                    yield chunk([choice(event.choice, text, logprobs=logprobs)])
            elif event.kind == "done":
                done.append(event.data)
                finish = event.finish_reason
                if tools:  # what was held back: content, or the calls
                    text, calls = tools[event.choice].finish()
                    if text or calls:
                        yield chunk([choice(event.choice, text or None, calls=calls)])
                    finish = "tool_calls" if calls else finish
                yield chunk([choice(event.choice, None if chat else "", finish)])
                if event.data["last"]:
                    break
            elif event.kind == "error":
                status = str(event.data["status"])
                e = error_of(event)
                yield "data: " + json.dumps(error_body(e.message, e.type, code=e.code)) + "\n\n"
                return
            event = await anext(events)
        if include_usage:
            yield chunk([], usage=usage(done), kvmem=kvmem_info(done, job.options))
        yield "data: [DONE]\n\n"
    except (asyncio.CancelledError, GeneratorExit):
        status = "499"
        server.metrics.cancelled.inc()
        raise
    finally:
        job.cancel.set()  # first, synchronously: awaiting in a cancelled task may be cut short
        server.metrics.requests.labels(endpoint, status).inc()
        await events.aclose()
