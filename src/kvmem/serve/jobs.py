"""A request body made into a `Job` for the engine: the model checked, kvmem's options resolved against the server's
defaults and validated, sampling limits, the prompt built (chat template, documents, token ids) and its length
checked against the model's context. Every refusal is an `APIError` naming the request's field."""

from __future__ import annotations

from kvmem.errors import KVMemError
from kvmem.prompts import Prompt, chat_prompt
from kvmem.serve.engine import REUSE_MODES, SEMANTIC_MODES, Job, Options, Sampling
from kvmem.serve.schemas import ChatRequest, CompletionRequest, Generation, KVMemOptions, fail
from kvmem.serve.state import Server
from kvmem.serve.tokens import token_options, tools_of
from kvmem.serve.tools import template_message
from kvmem.serve.validate import check_generation, completion_limit, message_texts

DOC_END = "\n\n"  # after each document, as in the RAG benchmark


def check_model(server: Server, name: str) -> None:
    if name != server.lm.name:
        fail(404, f"the model {name!r} does not exist here; this server serves {server.lm.name!r}", param="model",
             code="model_not_found")


def options(server: Server, body: Generation) -> Options:
    """kvmem's options of this request: its `kvmem` object over the server's defaults, checked."""
    from kvmem.compress import get_method
    from kvmem.kvdirect import is_kv_direct
    from kvmem.quant import get_scheme

    defaults, k = server.defaults, body.kvmem or KVMemOptions()
    o = Options(**{f: getattr(k, f) if getattr(k, f, None) is not None else getattr(defaults, f)
                   for f in Options.__dataclass_fields__})
    o.ignore_eos = k.ignore_eos or defaults.ignore_eos
    if not 0.0 < o.keep_ratio <= 1.0:
        fail(400, f"keep_ratio must be in (0, 1] (the fraction of the KV cache kept); got {o.keep_ratio}",
             param="kvmem.keep_ratio")
    if is_kv_direct(o.method):
        fail(400, f"{o.method}: the server's batched decoding does not run KV-Direct caches (kvmem generate and "
                  "kvmem.answer do)", param="kvmem.method")
    for param, check in (("kvmem.method", lambda: get_method(o.method)),
                         ("kvmem.quant", lambda: o.quant and get_scheme(o.quant))):
        try:
            check()
        except KVMemError as e:
            fail(400, str(e), param=param)
    if o.method.split(":")[0] == "full" and o.keep_ratio < 1.0:
        fail(400, "method 'full' keeps every token: give keep_ratio 1.0 or another method", param="kvmem.keep_ratio")
    if o.reuse not in REUSE_MODES:
        fail(400, f"unknown reuse mode {o.reuse!r}; choose from {', '.join(REUSE_MODES)}", param="kvmem.reuse")
    if o.reuse in SEMANTIC_MODES:
        if server.index is None:
            fail(400, f"reuse={o.reuse} looks prompts up in the server's semantic index, and this server has no store "
                      "(start it with --store)", param="kvmem.reuse")
        if get_method(o.method).name != "full" or o.keep_ratio < 1.0 or o.quant:
            fail(400, f"reuse={o.reuse} reads and stores plain rows: no compression method or quantization (use "
                      "reuse=prefix with a method)", param="kvmem.reuse")
    elif o.reuse != "prefix":
        if not k.documents:
            fail(400, f"reuse={o.reuse} assembles documents: give them in kvmem.documents", param="kvmem.documents")
        if o.method != "full" and o.keep_ratio < 1.0 or o.quant:
            fail(400, f"reuse={o.reuse} does not compress; use reuse=prefix with a method", param="kvmem.reuse")
    if (o.use_store or o.fill_store) and server.store is None and body.kvmem and (body.kvmem.use_store or
                                                                                  body.kvmem.fill_store):
        fail(400, "this server has no store (start it with --store)", param="kvmem.use_store")
    return o


def sampling(server: Server, body: Generation, limit: int) -> Sampling:
    if body.n > server.max_n:
        fail(400, f"n={body.n} is more than the {server.max_n} choices this server computes per request", param="n")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 4 or any(not s for s in stop):
        fail(400, "stop takes up to 4 non-empty strings", param="stop")
    return Sampling(limit, body.temperature, body.top_p, body.seed, stop, body.n,
                    **token_options(server, body, chat=isinstance(body, ChatRequest)))


def encode(server: Server, text: str) -> list[int]:
    return server.lm.tokenizer(text, add_special_tokens=False).input_ids


def make_job(server: Server, body: Generation, prompt: Prompt, docs: list[list[int]], o: Options,
             limit: int | None, limit_field: str, default: int) -> Job:
    n_prompt = len(prompt.ids) + sum(map(len, docs))
    limit = completion_limit(server.lm, n_prompt, limit, limit_field, default,
                             "messages" if isinstance(body, ChatRequest) else "prompt")
    timeout = body.kvmem.timeout if body.kvmem and body.kvmem.timeout else server.timeout_s
    return Job(prompt, sampling(server, body, limit), o, docs, timeout)


def chat_job(server: Server, body: ChatRequest) -> Job:
    """The conversation through the chat template, split before its last message; documents join the reusable
    context (prefix reuse) or are assembled apart (cacheblend, infoflow)."""
    check_model(server, body.model)
    check_generation(body)
    o = options(server, body)
    messages = [template_message(m.role, text, m.model_extra or {}) for m, text in zip(body.messages, message_texts(body))]
    docs = [encode(server, d + DOC_END) for d in (body.kvmem.documents or [])] if body.kvmem else []
    try:
        prompt = chat_prompt(server.lm.tokenizer, messages, tools_of(server, body))
    except KVMemError as e:
        fail(400, str(e), param="messages")
    if o.reuse in ("prefix", *SEMANTIC_MODES) and docs:  # the documents join the reusable context, in the order given
        prompt = Prompt(prompt.context + [t for d in docs for t in d], prompt.question, prompt.head)
        docs = []
    limit_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    return make_job(server, body, prompt, docs, o, getattr(body, limit_field), limit_field, server.max_tokens)


def completion_job(server: Server, body: CompletionRequest) -> Job:
    """A raw prompt (text or token ids), its last token the question."""
    check_model(server, body.model)
    check_generation(body)
    o = options(server, body)
    tokenizer = server.lm.tokenizer
    if body.kvmem and body.kvmem.documents:
        fail(400, "documents go with /v1/chat/completions", param="kvmem.documents")
    if o.reuse not in ("prefix", *SEMANTIC_MODES):
        fail(400, "cacheblend/infoflow reuse goes with /v1/chat/completions and documents", param="kvmem.reuse")
    p = body.prompt
    if isinstance(p, list) and p and isinstance(p[0], str):
        if len(p) != 1:
            fail(400, "one prompt per request (a list of one string, a string, or token ids)", param="prompt")
        p = p[0]
    if isinstance(p, str):
        ids = tokenizer(p, add_special_tokens=True).input_ids
    else:
        ids = list(p)
        if any(not 0 <= t < len(tokenizer) for t in ids):
            fail(400, f"prompt token ids must be in [0, {len(tokenizer)})", param="prompt")
    if not ids:
        fail(400, "the prompt is empty", param="prompt")
    n_special = len(tokenizer("", add_special_tokens=True).input_ids)
    prompt = Prompt(ids[:-1], ids[-1:], min(n_special, len(ids) - 1))
    return make_job(server, body, prompt, [], o, body.max_tokens, "max_tokens", 16)  # OpenAI's default for completions
