"""A job run for an HTTP request: admitted to the engine (429 when it is full), its events answered as one JSON
body or as server-sent events in OpenAI's chunk format, with usage and kvmem's own report; cancelled when the
client goes away (499, counted)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvmem.serve.engine import Busy, Event, Job, Options
from kvmem.serve.schemas import APIError, Generation, error_body, fail
from kvmem.serve.state import Server


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
        return StreamingResponse(stream(server, events, first, job, rid, created, model, endpoint, chat, include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def collect():
        texts, done = [""] * job.sampling.n, []
        finish = [None] * job.sampling.n
        async for event in events:
            observe(server, event, job)
            if event.kind == "error":
                raise error_of(event)
            if event.kind == "delta":
                texts[event.choice] += event.text
            elif event.kind == "done":
                finish[event.choice] = event.finish_reason
                done.append(event.data)
        return texts, finish, done

    result = await until_disconnect(request, collect())
    if result is None:
        return gone(server, job, endpoint)
    texts, finish, done = result
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": f,
                    "logprobs": None} for i, (t, f) in enumerate(zip(texts, finish))]
    else:
        choices = [{"index": i, "text": t, "finish_reason": f, "logprobs": None}
                   for i, (t, f) in enumerate(zip(texts, finish))]
    server.metrics.requests.labels(endpoint, "200").inc()
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "system_fingerprint": server.fingerprint, "choices": choices, "usage": usage(done),
            "kvmem": kvmem_info(done, job.options)}


async def stream(server: Server, events, first: Event, job: Job, rid: str, created: int, model: str, endpoint: str, chat: bool,
                 include_usage: bool):
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list, **extra) -> str:
        return "data: " + json.dumps({"id": rid, "object": kind, "created": created, "model": model,
                                      "system_fingerprint": server.fingerprint, "choices": choices, **extra}) + "\n\n"

    def choice(i: int, text: str | None = None, finish: str | None = None, role: bool = False) -> dict:
        if not chat:
            return {"index": i, "text": text or "", "finish_reason": finish, "logprobs": None}
        delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
        return {"index": i, "delta": delta, "finish_reason": finish, "logprobs": None}

    done, status = [], "200"
    try:
        event = first
        while True:
            observe(server, event, job)
            if event.kind == "prefilled" and chat:
                yield chunk([choice(event.choice, "", role=True)])
            elif event.kind == "delta":
                yield chunk([choice(event.choice, event.text)])
            elif event.kind == "done":
                done.append(event.data)
                yield chunk([choice(event.choice, None if chat else "", event.finish_reason)])
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
