"""The OpenAI-compatible HTTP API (FastAPI): chat and text completions (streamed as server-sent events or not),
embeddings, models, health and Prometheus metrics, with kvmem's cache layer inside.

kvmem's per-request options travel in the body's `kvmem` object (the openai client's
`extra_body={"kvmem": {...}}`):

    method, keep_ratio, quant, query_aware   how the context's KV is compressed (`kvmem.compress`, `kvmem.quant`)
    use_store, fill_store                    read stored KV / store what this request computes
    reuse                                    prefix (default) | cacheblend | infoflow (`kvmem.reuse.blend`)
    documents                                texts placed between the conversation and the last message; with
                                             cacheblend/infoflow each is precomputed (and stored) on its own
    recompute_ratio                          cacheblend/infoflow: the share of document tokens recomputed
    ignore_eos, timeout                      generate past end-of-sequence; seconds before the request gives up
    method, layer (embeddings)               the embedding method (a `kvmem.embed` spec) and its layer

A chat prompt is split before the last message (`kvmem.prompts.chat_prompt`): the system prompt, earlier
turns and documents form the reusable, compressible context; the last message is the question. Every error
is an OpenAI-style body, `{"error": {"message", "type", "param", "code"}}`, with its HTTP status.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
import uuid
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvmem.errors import KVMemError
from kvmem.models import LoadedModel
from kvmem.prompts import Prompt, chat_prompt
from kvmem.serve.engine import REUSE_MODES, Busy, Engine, Event, Job, Options, Sampling
from kvmem.serve.schemas import (APIError, ChatRequest, CompletionRequest, EmbeddingRequest, Generation, KVMemOptions,
                                 error_body, refuse_unsupported)
from kvmem.serve.scheduler import Scheduler
from kvmem.serve.metrics import Metrics

DOC_END = "\n\n"  # after each document, as in the RAG benchmark
MAX_EMBED_INPUTS = 256


# -- the app -------------------------------------------------------------------------------------------------
def create_app(lm: LoadedModel, store=None, defaults: Options | None = None, workers: int = 1, queue: int = 16,
               timeout_s: float = 120.0, max_tokens: int = 256, max_n: int = 4,
               embed_method: str = "prompteol", kv_budget: int | None = None, max_rows: int = 64) -> FastAPI:
    """The API for `lm` (loaded once, shared read-only by every request) with an optional `ChunkStore`. With
    `kv_budget` (bytes) requests are decoded together by continuous batching (`serve.scheduler`); without it each of
    `workers` threads decodes one request at a time (`serve.engine`)."""
    from kvmem.compress import get_method
    from kvmem.embed import get_embedder, is_lm_method, parse_method
    from kvmem.quant import get_scheme

    defaults = defaults or Options()
    engine = Scheduler(lm, store, kv_budget, queue, max_rows) if kv_budget else Engine(lm, store, workers, queue)
    metrics = Metrics(engine, store)
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        if hasattr(engine, "close"):
            engine.close()  # the scheduler's thread stops; its swap folder goes

    app = FastAPI(title="kvmem", version="0.1.0", lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics
    shared_embedders: dict[str, Any] = {}  # reference encoders (no LLM, no hooks): loaded once, used read-only
    fingerprint = lm.fingerprint[:16]

    def fail(status: int, message: str, type: str = "invalid_request_error", **kw):
        raise APIError(status, message, type, **kw)

    def error_response(e: APIError, endpoint: str) -> JSONResponse:
        metrics.requests.labels(endpoint, str(e.status)).inc()
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        errors = e.errors()
        if any(err.get("type") == "json_invalid" for err in errors):
            msg = "malformed JSON body: " + "; ".join(str(err.get("ctx", {}).get("error", err["msg"])) for err in errors)
            return error_response(APIError(400, msg, code="invalid_json"), request.url.path)
        first = errors[0]
        where = ".".join(str(x) for x in first["loc"] if x != "body")
        got = f" (got {first['input']!r})" if "input" in first and not isinstance(first["input"], dict) else ""
        return error_response(APIError(400, f"{where or 'body'}: {first['msg']}{got}", param=where or None),
                              request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        return error_response(APIError(e.status_code, str(e.detail), "not_found" if e.status_code == 404 else
                                       "invalid_request_error"), request.url.path)

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception):
        return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error"), request.url.path)

    # -- building a job ------------------------------------------------------------------------------------
    def check_model(name: str) -> None:
        if name != lm.name:
            fail(404, f"the model {name!r} does not exist here; this server serves {lm.name!r}", param="model",
                 code="model_not_found")

    def options(body: Generation) -> Options:
        k = body.kvmem or KVMemOptions()
        o = Options(**{f: getattr(k, f) if getattr(k, f, None) is not None else getattr(defaults, f)
                       for f in Options.__dataclass_fields__})
        o.ignore_eos = k.ignore_eos or defaults.ignore_eos
        if not 0.0 < o.keep_ratio <= 1.0:
            fail(400, f"keep_ratio must be in (0, 1] (the fraction of the KV cache kept); got {o.keep_ratio}",
                 param="kvmem.keep_ratio")
        try:
            get_method(o.method)
            if o.quant:
                get_scheme(o.quant)
        except KVMemError as e:
            fail(400, str(e), param="kvmem.method" if "method" in str(e) else "kvmem.quant")
        if o.method.split(":")[0] == "full" and o.keep_ratio < 1.0:
            fail(400, "method 'full' keeps every token: give keep_ratio 1.0 or another method", param="kvmem.keep_ratio")
        if o.reuse not in REUSE_MODES:
            fail(400, f"unknown reuse mode {o.reuse!r}; choose from {', '.join(REUSE_MODES)}", param="kvmem.reuse")
        if o.reuse != "prefix":
            if not k.documents:
                fail(400, f"reuse={o.reuse} assembles documents: give them in kvmem.documents", param="kvmem.documents")
            if o.method != "full" and o.keep_ratio < 1.0 or o.quant:
                fail(400, f"reuse={o.reuse} does not compress; use reuse=prefix with a method", param="kvmem.reuse")
        if (o.use_store or o.fill_store) and store is None and body.kvmem and (body.kvmem.use_store or
                                                                               body.kvmem.fill_store):
            fail(400, "this server has no store (start it with --store)", param="kvmem.use_store")
        return o

    def sampling(body: Generation, limit: int | None) -> Sampling:
        if body.n > max_n:
            fail(400, f"n={body.n} is more than the {max_n} choices this server computes per request", param="n")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > 4 or any(not s for s in stop):
            fail(400, "stop takes up to 4 non-empty strings", param="stop")
        return Sampling(limit or max_tokens, body.temperature, body.top_p, body.seed, stop, body.n)

    def encode(text: str) -> list[int]:
        return lm.tokenizer(text, add_special_tokens=False).input_ids

    def check_length(n: int) -> None:
        if n >= lm.max_context:
            fail(400, f"the prompt is {n} tokens; {lm.name} reads at most {lm.max_context} tokens, prompt and "
                      f"completion together", param="messages", code="context_length_exceeded")

    def make_job(body: Generation, prompt: Prompt, docs: list[list[int]], o: Options, limit: int | None) -> Job:
        refuse_unsupported(body)
        check_length(len(prompt.ids) + sum(map(len, docs)))
        timeout = body.kvmem.timeout if body.kvmem and body.kvmem.timeout else timeout_s
        return Job(prompt, sampling(body, limit), o, docs, timeout)

    # -- running it --------------------------------------------------------------------------------------------
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

    def observe(event: Event, job: Job) -> None:
        if event.kind == "prefilled" and event.choice == 0:
            metrics.record_prefill(len(job.prompt.ids) + sum(map(len, job.documents)), event.data["reused_tokens"])
        elif event.kind == "done":
            metrics.record_done(event.data)

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

    def gone(job: Job, endpoint: str) -> Response:
        job.cancel.set()
        metrics.cancelled.inc()
        metrics.requests.labels(endpoint, "499").inc()
        return Response(status_code=499)  # nobody reads it: the client has gone

    async def respond(request: Request, body: Generation, job: Job, endpoint: str, chat: bool):
        try:
            engine.admit(job)
        except Busy as e:
            fail(429, str(e), "rate_limit_error", code="busy", headers={"Retry-After": str(e.retry_after)})
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created, model = int(time.time()), lm.name
        events = engine.run(job)
        if body.stream:
            first = await until_disconnect(request, anext(events))
            if first is None:
                return gone(job, endpoint)
            if first.kind == "error":
                await events.aclose()
                raise error_of(first)
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(stream(events, first, job, rid, created, model, endpoint, chat, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        async def collect():
            texts, done = [""] * job.sampling.n, []
            finish = [None] * job.sampling.n
            async for event in events:
                observe(event, job)
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
            return gone(job, endpoint)
        texts, finish, done = result
        if chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": f,
                        "logprobs": None} for i, (t, f) in enumerate(zip(texts, finish))]
        else:
            choices = [{"index": i, "text": t, "finish_reason": f, "logprobs": None}
                       for i, (t, f) in enumerate(zip(texts, finish))]
        metrics.requests.labels(endpoint, "200").inc()
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model, "system_fingerprint": fingerprint, "choices": choices, "usage": usage(done),
                "kvmem": kvmem_info(done, job.options)}

    async def stream(events, first: Event, job: Job, rid: str, created: int, model: str, endpoint: str, chat: bool,
                     include_usage: bool):
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list, **extra) -> str:
            return "data: " + json.dumps({"id": rid, "object": kind, "created": created, "model": model,
                                          "system_fingerprint": fingerprint, "choices": choices, **extra}) + "\n\n"

        def choice(i: int, text: str | None = None, finish: str | None = None, role: bool = False) -> dict:
            if not chat:
                return {"index": i, "text": text or "", "finish_reason": finish, "logprobs": None}
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            return {"index": i, "delta": delta, "finish_reason": finish, "logprobs": None}

        done, status = [], "200"
        try:
            event = first
            while True:
                observe(event, job)
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
            metrics.cancelled.inc()
            raise
        finally:
            job.cancel.set()  # first, synchronously: awaiting in a cancelled task may be cut short
            metrics.requests.labels(endpoint, status).inc()
            await events.aclose()

    # -- routes ----------------------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        check_model(body.model)
        o = options(body)
        messages = []
        for m in body.messages:
            content = m.content
            if isinstance(content, list):
                if any(p.get("type") != "text" for p in content):
                    fail(400, "only text content parts are supported", param="messages")
                content = "".join(p.get("text", "") for p in content)
            messages.append({"role": m.role, "content": content or ""})
        docs = [encode(d + DOC_END) for d in (body.kvmem.documents or [])] if body.kvmem else []
        try:
            prompt = chat_prompt(lm.tokenizer, messages)
        except KVMemError as e:
            fail(400, str(e), param="messages")
        if o.reuse == "prefix" and docs:  # the documents join the reusable context, in the order given
            prompt = Prompt(prompt.context + [t for d in docs for t in d], prompt.question, prompt.head)
            docs = []
        job = make_job(body, prompt, docs, o, body.max_completion_tokens or body.max_tokens)
        return await respond(request, body, job, "/v1/chat/completions", chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        o = options(body)
        if body.kvmem and body.kvmem.documents:
            fail(400, "documents go with /v1/chat/completions", param="kvmem.documents")
        if o.reuse != "prefix":
            fail(400, "cacheblend/infoflow reuse goes with /v1/chat/completions and documents", param="kvmem.reuse")
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                fail(400, "one prompt per request (a list of one string, a string, or token ids)", param="prompt")
            p = p[0]
        if isinstance(p, str):
            ids = lm.tokenizer(p, add_special_tokens=True).input_ids
        else:
            ids = list(p)
            if any(not 0 <= t < len(lm.tokenizer) for t in ids):
                fail(400, f"prompt token ids must be in [0, {len(lm.tokenizer)})", param="prompt")
        if not ids:
            fail(400, "the prompt is empty", param="prompt")
        n_special = len(lm.tokenizer("", add_special_tokens=True).input_ids)
        prompt = Prompt(ids[:-1], ids[-1:], min(n_special, len(ids) - 1))
        job = make_job(body, prompt, [], o, body.max_tokens or 16)  # OpenAI's default max_tokens for completions
        return await respond(request, body, job, "/v1/completions", chat=False)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        endpoint = "/v1/embeddings"
        k = body.kvmem or KVMemOptions()
        if k.method:
            check_model(body.model)
            spec = k.method
        elif body.model == lm.name:
            spec = embed_method
        else:
            try:
                parse_method(body.model)
            except KVMemError:
                fail(404, f"the model {body.model!r} does not exist here; embeddings come from {lm.name!r} (method "
                          f"{embed_method}) or a kvmem.embed method name such as 'minilm'", param="model",
                     code="model_not_found")
            spec = body.model
        if body.dimensions is not None:
            fail(400, "dimensions is not supported (kvmem's embeddings have the model's width)", param="dimensions")
        if body.encoding_format not in ("float", "base64"):
            fail(400, f"encoding_format must be float or base64, got {body.encoding_format!r}", param="encoding_format")
        items = body.input if isinstance(body.input, list) else [body.input]
        if items and isinstance(items[0], int):
            items = [items]
        if any(not isinstance(x, str) and any(not 0 <= t < len(lm.tokenizer) for t in x) for x in items):
            fail(400, f"input token ids must be in [0, {len(lm.tokenizer)})", param="input")
        texts = [x if isinstance(x, str) else lm.tokenizer.decode(x) for x in items]
        if not texts or any(not t.strip() for t in texts):
            fail(400, "input must hold at least one non-empty text", param="input")
        if len(texts) > MAX_EMBED_INPUTS:
            fail(400, f"at most {MAX_EMBED_INPUTS} inputs per request (got {len(texts)})", param="input")
        try:
            lm_method = is_lm_method(spec)
            if not lm_method and spec not in shared_embedders:
                shared_embedders[spec] = get_embedder(spec)
        except KVMemError as e:
            fail(400, str(e), param="kvmem.method")
        layer = k.layer if k.layer is not None else -1

        def embed() -> np.ndarray:  # in a worker thread; an LLM embedder (and its hooks) belongs to this request
            embedder = get_embedder(spec, model=lm, layer=layer) if lm_method else shared_embedders[spec]
            return np.asarray(embedder.encode(texts, normalize_embeddings=True), dtype=np.float32).reshape(len(texts), -1)

        try:
            engine.admit()
        except Busy as e:
            fail(429, str(e), "rate_limit_error", code="busy", headers={"Retry-After": str(e.retry_after)})
        try:
            vectors = await until_disconnect(request, engine.call(embed, k.timeout or timeout_s))
        except KVMemError as e:
            fail(400, str(e), param="kvmem.method")
        if vectors is None:
            metrics.requests.labels(endpoint, "499").inc()
            return Response(status_code=499)
        n_tokens = sum(len(encode(t)) for t in texts)
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if body.encoding_format == "base64"
                 else v.tolist()} for i, v in enumerate(vectors)]
        metrics.requests.labels(endpoint, "200").inc()
        return {"object": "list", "data": data, "model": body.model,
                "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}, "kvmem": {"method": spec, "layer": layer}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": lm.name, "object": "model", "created": 0, "owned_by": "kvmem",
                                            "max_context": lm.max_context, "fingerprint": lm.fingerprint},
                                           {"id": "minilm", "object": "model", "created": 0, "owned_by": "kvmem",
                                            "embeddings_only": True}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": lm.name, "fingerprint": lm.fingerprint, "store": repr(store) if store else None,
                "running": engine.running, "waiting": engine.waiting, "queue": queue} | (
                    {"batching": True, "kv_budget": kv_budget, "batch_rows": len(engine.rows), "swapped": len(engine.swapped),
                     "preemptions": engine.preemptions} if kv_budget else {"batching": False, "workers": workers})

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return app
