"""`/v1/embeddings`: training-free embeddings from the served LLM (`kvmem.embed`'s methods at a layer) or a
reference encoder such as MiniLM, run on the engine's threads like any job (admitted, timed out, cancelled)."""

from __future__ import annotations

import base64

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from kvmem.errors import KVMemError
from kvmem.serve.access import note
from kvmem.serve.engine import Busy
from kvmem.serve.jobs import check_model, encode
from kvmem.serve.respond import until_disconnect
from kvmem.serve.schemas import EmbeddingRequest, KVMemOptions, fail
from kvmem.serve.state import Server
from kvmem.serve.validate import EMBEDDING_FIELDS, check_fields

MAX_EMBED_INPUTS = 256


def shorten(vectors: np.ndarray, dimensions: int) -> np.ndarray:
    """The first `dimensions` coordinates of each vector, re-normalised to unit length: what OpenAI's `dimensions`
    does (Matryoshka Representation Learning, Kusupati et al., NeurIPS 2022, trains embeddings so that their
    prefixes are embeddings too). kvmem's training-free embeddings were not trained so: their prefixes are what a
    client asks for, with no promise of the quality a Matryoshka model keeps."""
    if dimensions > vectors.shape[1]:
        fail(400, f"dimensions={dimensions} is more than the {vectors.shape[1]} dimensions of these embeddings",
             param="dimensions")
    kept = vectors[:, :dimensions]
    return kept / np.maximum(np.linalg.norm(kept, axis=1, keepdims=True), np.finfo(np.float32).tiny)


async def embeddings(server: Server, body: EmbeddingRequest, request: Request) -> dict | Response:
    """Vectors of the inputs from the served model (an LLM embedding method at a layer) or a reference encoder."""
    from kvmem.embed import get_embedder, is_lm_method, parse_method

    lm = server.lm
    endpoint = "/v1/embeddings"
    note(request, model=body.model, user=body.user)
    check_fields(body, EMBEDDING_FIELDS, endpoint)
    k = body.kvmem or KVMemOptions()
    if k.method:
        check_model(server, body.model)
        spec = k.method
    elif body.model == lm.name:
        spec = server.embed_method
    else:
        try:
            parse_method(body.model)
        except KVMemError:
            fail(404, f"the model {body.model!r} does not exist here; embeddings come from {lm.name!r} (method "
                      f"{server.embed_method}) or a kvmem.embed method name such as 'minilm'", param="model",
                 code="model_not_found")
        spec = body.model
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
    lengths = [len(encode(server, t)) for t in texts]
    try:
        lm_method = is_lm_method(spec)
        if not lm_method and spec not in server.embedders:
            server.embedders[spec] = get_embedder(spec)
    except KVMemError as e:
        fail(400, str(e), param="kvmem.method")
    layer = k.layer if k.layer is not None else -1
    if lm_method and max(lengths) > lm.max_context:
        fail(400, f"input {lengths.index(max(lengths))} is {max(lengths)} tokens; {lm.name} reads at most "
                  f"{lm.max_context}", param="input", code="context_length_exceeded")

    def embed() -> np.ndarray:  # in a worker thread; an LLM embedder (and its hooks) belongs to this request
        embedder = get_embedder(spec, model=lm, layer=layer) if lm_method else server.embedders[spec]
        return np.asarray(embedder.encode(texts, normalize_embeddings=True), dtype=np.float32).reshape(len(texts), -1)

    try:
        server.engine.admit()
    except Busy as e:
        fail(429, str(e), "rate_limit_error", code="busy", headers={"Retry-After": str(e.retry_after)})
    try:
        vectors = await until_disconnect(request, server.engine.call(embed, k.timeout or server.timeout_s))
    except KVMemError as e:
        fail(400, str(e), param="kvmem.method")
    if vectors is None:
        server.metrics.requests.labels(endpoint, "499").inc()
        return Response(status_code=499)
    if body.dimensions is not None:
        vectors = shorten(vectors, body.dimensions)
    n_tokens = sum(lengths)
    note(request, prompt_tokens=n_tokens)
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if body.encoding_format == "base64"
             else v.tolist()} for i, v in enumerate(vectors)]
    server.metrics.requests.labels(endpoint, "200").inc()
    return {"object": "list", "data": data, "model": body.model,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}, "kvmem": {"method": spec, "layer": layer}}
