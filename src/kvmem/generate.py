"""kvmem's own generation loop: prefill, compress, feed more tokens, decode greedily.

`model.generate(..., cache=KVCache(config, compressor=Compressor(...)))` works too (see tests); this
loop exists so that a context can be compressed before a question is read (the query-agnostic,
reusable setting) and so the benchmark can time the parts. Decode-time re-compression is the
Compressor's `every=N`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvmem.cache import KVCache
from kvmem.compress import Method, ModelContext, compress, compress_while_decoding, get_method
from kvmem.errors import KVMemError
from kvmem.forward import feed, feed_pieces
from kvmem.kvdirect import check_call, is_kv_direct
from kvmem.kvdirect import new_cache as kv_direct_cache
from kvmem.models import LoadedModel
from kvmem.prompts import Prompt, build_prompt
from kvmem.quant import get_scheme


def new_cache(lm: LoadedModel, method: Method, quant: str | None = None) -> KVCache:
    """A cache that records what `method` needs to score tokens (queries, accumulated attention), holding
    its rows quantized with `quant` (a scheme, e.g. `kivi-2`, prepared for this model) if given."""
    return KVCache(lm.model.config, observe_window=max(64, method.observe_window), track_attention=method.needs_attention,
                   quant=get_scheme(quant, lm) if isinstance(quant, str) else quant, attention_decay=method.attention_decay)


@torch.no_grad()
def nll(lm: LoadedModel, cache: KVCache, ids: list[int]) -> float:
    """Mean negative log-likelihood of `ids[1:]` given the cache and `ids[0]` (for perplexity)."""
    x = torch.tensor([ids], dtype=torch.long)
    logits = lm.model(input_ids=x, cache=cache, use_cache=True).logits[0, :-1].float()
    return torch.nn.functional.cross_entropy(logits, x[0, 1:]).item()


_NEWLINE_IDS: dict[int, set[int]] = {}


def end_ids(lm: LoadedModel) -> set[int]:
    eos = lm.model.generation_config.eos_token_id
    return {i for i in set(eos if isinstance(eos, list) else [eos]) | {lm.tokenizer.eos_token_id} if i is not None}


def newline_ids(lm: LoadedModel) -> set[int]:
    """Every token whose text contains a newline (cached per tokenizer)."""
    tok = lm.tokenizer
    if id(tok) not in _NEWLINE_IDS:
        _NEWLINE_IDS[id(tok)] = {i for t, i in tok.get_vocab().items() if "\n" in tok.convert_tokens_to_string([t])}
    return _NEWLINE_IDS[id(tok)]


def normalize_text(text: str) -> str:
    """Case- and whitespace-insensitive form used to look for answers in outputs."""
    return " ".join(text.casefold().split())


class StopRule:
    """When greedy decoding of one answer ends: end of sequence, `max_new_tokens`, (with `stop_at_newline`)
    the end of the first line that has a letter or digit, or (with `answers`) once every answer string is
    in the output: more tokens cannot take a found answer away, so they would only cost time."""

    def __init__(self, lm: LoadedModel, max_new_tokens: int, stop_at_newline: bool = True, answers=()):
        self.tokenizer, self.max_new_tokens = lm.tokenizer, max_new_tokens
        self.ends, self.newlines = end_ids(lm), newline_ids(lm) if stop_at_newline else set()
        self.answers = [normalize_text(a) for a in answers]

    def accept(self, out: list[int], token: int) -> bool:
        """Append `token` to `out` unless it ends the answer; returns whether decoding goes on."""
        if token in self.ends:
            return False
        if token in self.newlines and any(c.isalnum() for c in self.tokenizer.decode(out)):
            return False
        out.append(token)
        if len(out) >= self.max_new_tokens:
            return False
        if self.answers:
            text = normalize_text(self.tokenizer.decode(out))
            return not all(a in text for a in self.answers)
        return True


@torch.no_grad()
def decode(lm: LoadedModel, cache: KVCache, first_logits: Tensor, max_new_tokens: int,
           stop_at_newline: bool = True, answers=()) -> list[int]:
    """Greedy decoding until the `StopRule` or a full context (the model's maximum length)."""
    out: list[int] = []
    rule = StopRule(lm, max_new_tokens, stop_at_newline, answers)
    logits = first_logits
    while rule.accept(out, int(logits.argmax())) and cache.get_seq_length() < lm.max_context:
        logits = feed(lm, cache, [out[-1]])
    return out


@torch.no_grad()
def answer_batch(lm: LoadedModel, caches: list[KVCache], question: list[int], max_new_tokens: int,
                 stop_at_newline: bool = True, answers=()) -> list[list[int]]:
    """Feed `question` on top of each cache and decode greedily, all caches in one batch (see kvmem.batch);
    the caches themselves are not changed. Returns each row's answer tokens, as `decode` would."""
    from kvmem.batch import BatchedCache

    batch = BatchedCache(caches)
    start = batch.get_seq_length()
    if start + len(question) + max_new_tokens > lm.max_context:
        max_new_tokens = lm.max_context - start - len(question)
        if max_new_tokens < 1:
            raise KVMemError(f"context too long: {start + len(question)} tokens leave no room to answer in {lm.max_context}")
    rules = [StopRule(lm, max_new_tokens, stop_at_newline, answers) for _ in caches]
    outs: list[list[int]] = [[] for _ in caches]
    live = list(range(len(caches)))  # the answer (index into `caches`) in each batch row
    ids = torch.tensor([question] * len(caches), dtype=torch.long, device=lm.model.device)
    position = start
    while live:
        positions = torch.arange(position, position + ids.shape[1], device=lm.model.device)[None].expand(len(live), -1)
        logits = lm.model(input_ids=ids, cache=batch, position_ids=positions, use_cache=True, logits_to_keep=1).logits[:, -1]
        position += ids.shape[1]
        going = [r for r, b in enumerate(live) if rules[b].accept(outs[b], int(logits[r].argmax()))]
        if len(going) < len(live):  # finished answers leave the batch: later steps read only live rows
            batch.keep_rows(going)
            live = [live[r] for r in going]
        ids = torch.tensor([[outs[b][-1]] for b in live], device=lm.model.device)
    return outs


@dataclass
class Answer:
    text: str
    tokens: list[int]
    kv_bytes: int
    kv_bytes_full: int
    tokens_held: int
    reuse: object = None  # a kvmem.reuse.ReuseReport when a store was used


def answer(
    lm: LoadedModel,
    context: str,
    question: str,
    method: str = "full",
    keep_ratio: float = 1.0,
    query_aware: bool = False,
    max_new_tokens: int = 32,
    raw_prompt: bool = False,
    answer_prefix: str = "",
    quant: str | None = None,
    store=None,
    reuse: str = "prefix",
    index=None,
    recompute_ratio: float = 0.15,
) -> Answer:
    """Read `context`, compress its KV with `method` (a name or spec, e.g. `kvzip` or `snapkv:budget=adaptive`),
    then answer `question` (the one-call API).

    The prompt goes through the tokenizer's chat template (`kvmem.prompts`; `raw_prompt=True` for base
    models). query_aware=False compresses the context before the question is seen (the reusable setting);
    True compresses after reading the question too, keeping the question's tokens. `quant` (e.g. `kivi-2`)
    holds the cache quantized: eviction first, then what is kept is quantized. `store` (a
    `kvmem.store.ChunkStore`) keeps computed KV across calls (`kvmem.reuse.prefix`): the longest stored prefix
    of the prompt is loaded, not recomputed; a context compressed before its question is stored compressed
    and reused whole. `Answer.reuse` says what was reused.

    `reuse`: `prefix` (the above), or, with `index` (a `kvmem.reuse.semantic_index.SemanticIndex` over the store),
    `semantic` (token recycling: the remembered prompt nearest by embedding, reused as far as its tokens agree,
    `kvmem.reuse.semantic`) or `semshare` (a similar prompt's KV aligned token by token, `recompute_ratio` of the
    matched tokens recomputed, `kvmem.reuse.semshare`). Both read and store plain rows: no method, no quant.
    """
    prompt = build_prompt(lm.tokenizer, context, question, answer_prefix, raw=raw_prompt)
    p = prepare(lm, prompt, method, keep_ratio, query_aware, quant, store, reuse=reuse, index=index,
                recompute_ratio=recompute_ratio)
    peak = p.cache.retrieved_peak_bytes()  # counted in p.kv_bytes already
    tokens = decode(lm, p.cache, p.logits, max_new_tokens)
    # an offloaded cache's working set fills as it retrieves: its bytes at their peak count as held
    return Answer(lm.tokenizer.decode(tokens), tokens, p.kv_bytes + p.cache.retrieved_peak_bytes() - peak,
                  p.kv_bytes_full, sum(map(sum, p.cache.tokens_held())), p.reuse)


@dataclass
class Prepared:
    """A prompt read into its own cache, compressed as asked, ready to decode from `logits`."""

    cache: KVCache
    logits: Tensor  # of the last prompt token
    kv_bytes_full: int  # held before compression (measured), the question excluded
    kv_bytes: int  # held after compression, before the question was fed
    reuse: object = None  # a kvmem.reuse.ReuseReport when a store was used


REUSE = ("prefix", "semantic", "semshare")  # how `prepare` reads stored KV (the server adds cacheblend, infoflow)


def check_reuse(reuse: str, index, store, method: str, keep_ratio: float, quant: str | None):
    """The store a `semantic` / `semshare` prefill uses (`store`, a policy view of the index's, or the index's own);
    refuses what cannot go together."""
    from kvmem.reuse.semantic_index import SemanticIndex

    if reuse not in REUSE:
        raise KVMemError(f"unknown reuse mode {reuse!r}; choose from {', '.join(REUSE)}")
    if reuse == "prefix":
        return store
    if not isinstance(index, SemanticIndex):
        raise KVMemError(f"reuse={reuse} looks prompts up in a semantic index: pass index=SemanticIndex(store, ...)")
    if get_method(method).name != "full" or keep_ratio < 1.0 or quant:
        raise KVMemError(f"reuse={reuse} reads and stores plain rows (an exact or aligned prefix of another prompt): no "
                         "compression method or quantization; use reuse=prefix with a method")
    if store is not None and store.tiers is not index.store.tiers:
        raise KVMemError(f"reuse={reuse}: the store given is not the semantic index's store")
    return index.store if store is None else store


def prepare(lm: LoadedModel, prompt: Prompt, method: str = "full", keep_ratio: float = 1.0, query_aware: bool = False,
            quant: str | None = None, store=None, interrupt=None, reuse: str = "prefix", index=None,
            recompute_ratio: float = 0.15) -> Prepared:
    """Prefill `prompt` into a new cache and compress its context with `method` (`answer` without the decoding;
    the server decodes with its own sampling). A prompt whose context is the template head alone has nothing to
    compress: it is read as it is. The cache comes back without scorer observations (none is planned after this),
    except for a decode-phase method (moment-kv): the prompt is kept whole and the cache evicts generated rows at every
    decoding step (`compress_while_decoding`; `query_aware` changes nothing there). With `interrupt` (the server's
    cancelled requests), the prefill runs in pieces and `interrupt()` is called before each; it raises to stop.
    `reuse`, `index`, `recompute_ratio`: see `answer` (semantic / semshare: the prompt is read whole, uncompressed).
    `kv-direct[:window=N][:checkpoint=layer|tokens]` (`kvdirect.py`) keeps the last N tokens' K/V and residual
    checkpoints of the rest: `kv_bytes` is then what it holds (both, measured), `kv_bytes_full` what its layers held after
    the first forward, before they gave the old tokens' K/V up (measured, the question included)."""
    if is_kv_direct(method):
        check_call(method, keep_ratio, quant, store, query_aware)
        if reuse != "prefix":
            raise KVMemError(f"{method} recomputes its K/V from checkpoints; it does not take reuse={reuse}")
        cache = kv_direct_cache(lm, method)
        logits = feed_pieces(lm, cache, prompt.context + prompt.question, interrupt)
        return Prepared(cache, logits, cache.prefill_kv_bytes, cache.held_bytes())
    store = check_reuse(reuse, index, store, method, keep_ratio, quant)
    if reuse != "prefix":
        return _prepare_semantic(lm, prompt, reuse, index, store, recompute_ratio, interrupt)
    m = get_method(method)
    ctx, q = prompt.context, prompt.question
    has_document = len(ctx) > prompt.head
    cache = new_cache(lm, m, quant)
    if m.evicts_while_decoding(keep_ratio):
        # a decode-phase method (moment-kv) keeps the prompt whole and evicts generated rows as they come: the prompt
        # is read as it is (a stored prefix reused), then the cache compresses itself at every decoding step
        if store is not None:
            logits, _, _, report = _prefill_with_store(lm, cache, get_method("full"), 1.0, False, quant, prompt, store,
                                                       has_document, interrupt)
        else:
            logits, report = feed_pieces(lm, cache, ctx + q, interrupt), None
        compress_while_decoding(cache, m, keep_ratio)
        return Prepared(cache, logits, cache.kv_bytes(), cache.kv_bytes(), report)
    if store is not None:
        logits, full_bytes, kept, report = _prefill_with_store(lm, cache, m, keep_ratio, query_aware, quant, prompt, store,
                                                               has_document, interrupt)
        cache.drop_observations()  # no scorer runs again: decoding records nothing (recording slowed every step)
        return Prepared(cache, logits, full_bytes, kept, report)
    if not has_document:
        logits = feed_pieces(lm, cache, ctx + q, interrupt)
        cache.drop_observations()
        return Prepared(cache, logits, cache.kv_bytes(), cache.kv_bytes())
    feed_pieces(lm, cache, ctx + q[:-1] if query_aware else ctx, interrupt)
    full_bytes = cache.kv_bytes()
    compress(cache, m, keep_ratio, protect_from=len(ctx) if query_aware else None,
             context=ModelContext(lm, ctx, prompt.head, question=q[:-1] if query_aware else []))
    kept = cache.kv_bytes()
    cache.drop_observations()
    logits = feed(lm, cache, q[-1:] if query_aware else q)
    # an offloaded cache's working set fills as it retrieves: its bytes at their peak so far count as held
    return Prepared(cache, logits, full_bytes, kept + cache.retrieved_peak_bytes())


def _prepare_semantic(lm: LoadedModel, prompt: Prompt, reuse: str, index, store, recompute_ratio: float,
                      interrupt=None) -> Prepared:
    """The prompt read by token recycling (`semantic`) or SemShareKV (`semshare`) into a plain cache."""
    ids = prompt.context + prompt.question
    if reuse == "semantic":
        from kvmem.reuse.semantic import prefill_semantic

        cache = KVCache(lm.model.config)
        logits, report = prefill_semantic(lm, cache, ids, index, store=store, interrupt=interrupt)
    else:
        from kvmem.reuse.semshare import prefill_semshare

        cache, logits, report = prefill_semshare(lm, ids, index, recompute_ratio, always_from=len(prompt.context),
                                                 store=store, interrupt=interrupt)
    return Prepared(cache, logits, cache.kv_bytes(), cache.kv_bytes(), report)


def _prefill_with_store(lm: LoadedModel, cache: KVCache, m: Method, keep_ratio: float, query_aware: bool,
                        quant: str | None, prompt, store, has_document: bool, interrupt=None):
    """`answer`'s prefill and compression through a chunk store. Returns the logits of the last prompt token,
    the bytes held before and after compression (before the question is fed; an offloaded cache's working set at
    its peak once it is) and the reuse report. Uncompressed prompts reuse any stored prefix;
    a context compressed before its question reuses its stored compressed form (valid for exactly that
    context), else its stored raw prefix (leaving the last tokens a scorer observes to be computed)."""
    import time

    from kvmem.reuse.prefix import ReuseReport, load_span, prefill, save_span

    ctx, q = prompt.context, prompt.question
    compressing = has_document and keep_ratio < 1.0 and m.name != "full"
    # a scorer that reads the last queries (or all attention) must see them computed, not loaded
    min_tail = len(ctx) + len(q) if m.needs_attention else m.observe_window + 1
    if not compressing:
        logits, report = prefill(lm, cache, ctx + q, store, context_end=len(ctx) or None, interrupt=interrupt)
        return logits, cache.kv_bytes(), cache.kv_bytes(), report
    if query_aware:  # the question is compressed with the context: only the raw prefix can be reused
        _, report = prefill(lm, cache, ctx + q[:-1], store, min_tail=min_tail, context_end=len(ctx), interrupt=interrupt)
        full_bytes = cache.kv_bytes()
        compress(cache, m, keep_ratio, protect_from=len(ctx),
                 context=ModelContext(lm, ctx, prompt.head, question=q[:-1]))
        cache.drop_observations()
        kept = cache.kv_bytes()
        logits = feed(lm, cache, q[-1:])
        return logits, full_bytes, kept + cache.retrieved_peak_bytes(), report
    compression = f"{m.spec}@{keep_ratio:g}" + (f"+{quant}" if quant else "")
    report = ReuseReport()
    # an offloaded cache is never a stored span: what it holds resident is not the context (the rest is in its tier),
    # so it is rebuilt from the raw prefix each time, and a span under its name is never read
    offloads = getattr(m, "offloads", False)
    if not offloads and load_span(lm, cache, store, ctx, compression, report):
        full_bytes = report.full_kv_bytes
    else:
        t = time.perf_counter()
        _, report = prefill(lm, cache, ctx, store, min_tail=min(min_tail, len(ctx)), report=report, context_end=len(ctx),
                            interrupt=interrupt)
        full_bytes = cache.kv_bytes()
        compress(cache, m, keep_ratio, context=ModelContext(lm, ctx, prompt.head))
        if not offloads:  # what computing this compressed context costs from scratch: the raw prefix's cost included
            save_span(lm, cache, store, ctx, compression, time.perf_counter() - t + report.saved_compute_s, full_bytes)
    cache.drop_observations()
    kept = cache.kv_bytes()
    t = time.perf_counter()
    logits = feed(lm, cache, q)
    report.prefill_s += time.perf_counter() - t
    report.computed_tokens += len(q)
    report.prompt_tokens = len(ctx) + len(q)
    return logits, full_bytes or kept, kept + cache.retrieved_peak_bytes(), report
