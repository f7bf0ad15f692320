"""The OpenAI-compatible HTTP API (FastAPI): chat and text completions (streamed as server-sent events or not),
embeddings, models, health and Prometheus metrics, with kvmem's cache layer inside.

kvmem's per-request options travel in the body's `kvmem` object (the openai client's
`extra_body={"kvmem": {...}}`):

    method, keep_ratio, quant, query_aware   how the context's KV is compressed (`kvmem.compress`, `kvmem.quant`)
    use_store, fill_store                    read stored KV / store what this request computes
    reuse                                    prefix (default) | semantic (token recycling, `kvmem.reuse.semantic`) |
                                             semshare (`kvmem.reuse.semshare`) | cacheblend | infoflow (`kvmem.reuse.blend`)
    documents                                texts placed between the conversation and the last message; with
                                             cacheblend/infoflow each is precomputed (and stored) on its own
    recompute_ratio                          cacheblend/infoflow: the share of document tokens recomputed; semshare:
                                             of the tokens aligned to the similar prompt
    ignore_eos, timeout                      generate past end-of-sequence; seconds before the request gives up
    method, layer (embeddings)               the embedding method (a `kvmem.embed` spec) and its layer

A chat prompt is split before the last message (`kvmem.prompts.chat_prompt`): the system prompt, earlier
turns and documents form the reusable, compressible context; the last message is the question. Every error
is an OpenAI-style body, `{"error": {"message", "type", "param", "code"}}`, with its HTTP status; which OpenAI
fields are used, accepted and ignored, or refused is `serve.validate`. Every response carries `x-request-id` and
leaves an access-log line; `--api-key` guards /v1/* (`serve.access`).
"""

from __future__ import annotations

import contextlib
import re
import time
from typing import Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvmem.models import LoadedModel
from kvmem.serve import embeddings as embedding_route
from kvmem.serve.access import Access, note, require_key
from kvmem.serve.engine import Engine, Options
from kvmem.serve.jobs import chat_job, completion_job
from kvmem.serve.metrics import Metrics
from kvmem.serve.respond import respond
from kvmem.serve.scheduler import Scheduler
from kvmem.serve.schemas import APIError, ChatRequest, CompletionRequest, EmbeddingRequest, error_body
from kvmem.serve.state import Server


def create_app(lm: LoadedModel, store=None, defaults: Options | None = None, workers: int = 1, queue: int = 16,
               timeout_s: float = 120.0, max_tokens: int = 256, max_n: int = 4,
               embed_method: str = "prompteol", kv_budget: int | None = None, max_rows: int = 64,
               api_key: str | None = None, cors_origins: list[str] | None = None, index=None) -> FastAPI:
    """The API for `lm` (loaded once, shared read-only by every request) with an optional `ChunkStore` and, over it,
    a `SemanticIndex` for reuse=semantic / semshare (saved at shutdown when it has a path). With
    `kv_budget` (bytes) requests are decoded together by continuous batching (`serve.scheduler`); without it each of
    `workers` threads decodes one request at a time (`serve.engine`). The routes build a job (`serve.jobs`) and
    answer with its events (`serve.respond`); embeddings are `serve.embeddings`. With `api_key`, /v1/* needs it as a
    Bearer token; `cors_origins` are the browser origins allowed; every request gets an id and an access-log line
    (`serve.access`)."""
    engine = (Scheduler(lm, store, kv_budget, queue, max_rows, index=index) if kv_budget else
              Engine(lm, store, workers, queue, index=index))
    metrics = Metrics(engine, store)
    server = Server(lm, store, engine, metrics, defaults or Options(), workers, queue, kv_budget, timeout_s, max_tokens,
                    max_n, embed_method, index=index)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        if hasattr(engine, "close"):
            engine.close()  # the scheduler's thread stops; its swap folder goes
        if index is not None and index.path is not None:
            index.save()  # the remembered prompts outlive the process (their KV is in the store's lasting tiers)

    started = int(time.time())  # the models' `created`
    app = FastAPI(title="kvmem", version="0.1.0", lifespan=lifespan, dependencies=[Depends(require_key(api_key))])
    app.state.engine, app.state.metrics, app.state.server = engine, metrics, server
    crash = _error_handlers(app, metrics)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["*"], expose_headers=["x-request-id", "retry-after"])
    app.add_middleware(Access, on_crash=crash)  # outermost: 401s, CORS answers and crashes get an id and a log line

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        note(request, model=body.model, user=body.user)
        job = chat_job(server, body)
        note(request, job=job)
        return await respond(server, request, body, job, "/v1/chat/completions", chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        note(request, model=body.model, user=body.user)
        job = completion_job(server, body)
        note(request, job=job)
        return await respond(server, request, body, job, "/v1/completions", chat=False)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        return await embedding_route.embeddings(server, body, request)

    # `max_model_len` is vLLM's name for the context length, `max_context` kvmem's
    listed = [{"id": lm.name, "object": "model", "created": started, "owned_by": "kvmem", "max_model_len": lm.max_context,
               "max_context": lm.max_context, "fingerprint": lm.fingerprint},
              {"id": "minilm", "object": "model", "created": started, "owned_by": "kvmem", "embeddings_only": True}]

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": listed}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        found = [m for m in listed if m["id"] == model_id]
        if not found:
            raise APIError(404, f"the model {model_id!r} does not exist here; this server serves "
                                f"{', '.join(m['id'] for m in listed)}", param="model", code="model_not_found")
        return found[0]

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": lm.name, "fingerprint": lm.fingerprint, "store": repr(store) if store else None,
                "semantic_index": None if index is None else {"prompts": len(index), "dropped": index.dropped},
                "running": engine.running, "waiting": engine.waiting, "queue": queue} | (
                    {"batching": True, "kv_budget": kv_budget, "batch_rows": len(engine.rows), "swapped": len(engine.swapped),
                     "preemptions": engine.preemptions} if kv_budget else {"batching": False, "workers": workers})

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def _error_handlers(app: FastAPI, metrics: Metrics) -> Callable[[Request, Exception], Response]:
    """Every error, whatever raised it, leaves as an OpenAI-style body with its status, and is counted. Returns the
    answer to a crash (the access middleware, outermost, gives it, with the request's id)."""

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
        where = field_path(first["loc"])
        got = f" (got {_short(first['input'])})" if "input" in first and not isinstance(first["input"], dict) else ""
        return error_response(APIError(400, f"{where or 'body'}: {first['msg']}{got}", param=where or None),
                              request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        return error_response(APIError(e.status_code, str(e.detail), "not_found" if e.status_code == 404 else
                                       "invalid_request_error"), request.url.path)

    def crash(request: Request, e: Exception) -> Response:
        return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error"),
                              request.url.path)

    return crash


# pydantic's location of an error names the union member it tried ('str', 'list[int]', 'function-after[...]'):
# not a field, so not part of `param`
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|dict|list|tuple|literal|json-or-python|function-\w+)(\[.*\])?$")


def field_path(loc: tuple) -> str:
    """The request field an error is about, as OpenAI writes it (messages.0.role), from pydantic's location."""
    parts = []
    for x in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(x, str) and _TYPE_TAG.match(x):
            break
        parts.append(str(x))
    return ".".join(parts)


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"
