"""The serving engine: one shared, read-only model; per request its own cache, compressor and sampler.

    engine = Engine(lm, store=ChunkStore("memory,redis://127.0.0.1:6379/0"), workers=1, queue=16)
    job = Job(prompt, Sampling(max_tokens=64), Options(method="snapkv", keep_ratio=0.25))
    engine.admit(job)                      # raises Busy when the queue is full (the server answers 429)
    async for event in engine.run(job):    # "prefilled", then "delta"s, then "done" (or one "error")
        ...

A request runs in a worker thread (torch releases the GIL inside its kernels, so the event loop keeps
serving while a forward runs); at most `workers` run at once, at most `queue` more wait, the rest are
refused at once. Nothing mutable is shared between requests except the chunk store, which is made for it
(locked counters, thread-safe tiers): each job builds its cache (`kvmem.generate.prepare`), its compressor,
its random generator and, for embeddings, its hooks (`kvmem.embed.base.this_thread_only`). A job is
cancelled (the client went away) or times out between two tokens, or between two pieces of its prefill (512
tokens, or the store's chunks): its worker returns and its KV is freed. (cacheblend/infoflow prefills are not
interrupted.)

Batch size is 1: each worker decodes one sequence. On 2 CPU cores the forward of one token already uses
both, so batching would buy little here; on a GPU it is most of the throughput (see the README).
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import torch

from kvmem.errors import KVMemError
from kvmem.generate import end_ids, feed, prepare
from kvmem.models import LoadedModel
from kvmem.prompts import Prompt

REUSE_MODES = ("prefix", "cacheblend", "infoflow")


class Stopped(Exception):
    """A job's prefill stopped between two pieces: cancelled (the client went away) or past its deadline."""


class Busy(Exception):
    """The queue is full; retry after `retry_after` seconds."""

    def __init__(self, retry_after: int, message: str):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class Options:
    """kvmem's per-request options (the body's `kvmem` object); the server's command line gives the defaults."""

    method: str = "full"
    keep_ratio: float = 1.0
    quant: str | None = None
    query_aware: bool = False
    use_store: bool = True  # read stored KV
    fill_store: bool = True  # store what this request computes
    reuse: str = "prefix"  # or cacheblend / infoflow over `documents`
    recompute_ratio: float = 0.15
    ignore_eos: bool = False


@dataclass
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    n: int = 1


@dataclass
class Event:
    kind: str  # prefilled | delta | done | error
    choice: int = 0
    text: str = ""
    finish_reason: str | None = None
    data: dict = field(default_factory=dict)


@dataclass(eq=False)  # hashed by identity: the engine keeps a set of active jobs
class Job:
    """One request: a prompt (or, for cacheblend/infoflow, a head, documents and a question) and how to answer it."""

    prompt: Prompt
    sampling: Sampling
    options: Options
    documents: list[list[int]] = field(default_factory=list)
    timeout_s: float = 120.0
    arrived: float = field(default_factory=time.monotonic)
    cancel: threading.Event = field(default_factory=threading.Event)
    kv_bytes: int = 0  # held right now (for the metrics)

    @property
    def deadline(self) -> float:
        return self.arrived + self.timeout_s


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """Greedy at temperature 0; else a draw from softmax(logits / temperature) cut to the top-p nucleus."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(0) - sorted_probs >= top_p  # the tokens after the nucleus is full
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def _held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters not to stream yet: the start of a stop string, or a half-decoded character."""
    if text.endswith("\ufffd"):
        return 1
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])), default=0)


class Engine:
    def __init__(self, lm: LoadedModel, store=None, workers: int = 1, queue: int = 16, on_finish: Callable | None = None):
        if workers < 1 or queue < 0:
            raise KVMemError(f"workers must be >= 1 and queue >= 0 (got {workers}, {queue})")
        self.lm, self.store, self.workers, self.queue_size = lm, store, workers, queue
        self.waiting = self.running = 0
        self.active: set[Job] = set()  # jobs admitted and not finished (queued or running)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvmem-request")
        self._slots: asyncio.Semaphore | None = None
        self._mean_s = 1.0  # running mean of a request's duration, for Retry-After
        self._ends = end_ids(lm)
        self.on_finish = on_finish or (lambda job, events: None)

    def kv_bytes_held(self) -> int:
        return sum(j.kv_bytes for j in list(self.active))

    # -- admission and the queue (event-loop side) ----------------------------------------------------
    def admit(self, job: Job | None = None) -> None:
        """Take a request into the queue, or raise `Busy` when `workers` run and `queue` wait already."""
        if self.waiting + self.running >= self.workers + self.queue_size:
            wait = max(1, math.ceil(self._mean_s * (self.waiting + 1) / self.workers))
            raise Busy(wait, f"the server is busy: {self.running} requests running and {self.waiting} waiting "
                             f"(queue of {self.queue_size}); retry in {wait} s")
        self.waiting += 1
        if job is not None:
            self.active.add(job)

    async def _take_slot(self, deadline: float) -> bool:
        """Wait for a worker (an admitted request leaves the queue either way); False when `deadline` passed first."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        try:
            await asyncio.wait_for(self._slots.acquire(), max(deadline - time.monotonic(), 0.001))
            self.running += 1
            return True
        except TimeoutError:
            return False
        finally:
            self.waiting -= 1

    def _start(self, fn, *args) -> asyncio.Future:
        """Run `fn(*args)` on a worker; the slot is released when the thread returns, not before."""
        started, future = time.monotonic(), asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

        def finished(_):
            self.running -= 1
            self._slots.release()
            self._mean_s = 0.8 * self._mean_s + 0.2 * (time.monotonic() - started)

        future.add_done_callback(finished)
        return future

    async def call(self, fn: Callable, timeout_s: float):
        """`fn()` on a worker, for a request `admit()`ted without a job (embeddings)."""
        if not await self._take_slot(time.monotonic() + timeout_s):
            raise KVMemError(f"timed out after {timeout_s:g} s waiting in the queue")
        return await asyncio.shield(self._start(fn))

    async def run(self, job: Job) -> AsyncIterator[Event]:
        """The events of an admitted job. Leaving the loop early (the client disconnected) cancels the job; its
        worker slot is released when its thread has returned."""
        try:
            slot = await self._take_slot(job.deadline)
        except BaseException:
            self.active.discard(job)
            raise
        if not slot:
            self.active.discard(job)
            yield Event("error", data={"status": 504, "type": "timeout",
                                       "message": f"timed out after {job.timeout_s:g} s waiting in the queue"})
            return
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        future = self._start(self._work, job, lambda e: loop.call_soon_threadsafe(events.put_nowait, e))
        future.add_done_callback(lambda _: self.active.discard(job))
        try:
            while True:
                event = await events.get()
                yield event
                if event.kind == "error" or (event.kind == "done" and event.data.get("last")):
                    return
        finally:
            job.cancel.set()  # a no-op when the job has finished; else its worker stops at the next token

    # -- one request (worker thread) -------------------------------------------------------------------
    def _work(self, job: Job, emit: Callable[[Event], None]) -> None:
        torch.set_grad_enabled(False)
        try:
            for choice in range(job.sampling.n):
                if not self._generate(job, choice, emit):
                    return
        except KVMemError as e:
            emit(Event("error", data={"status": 400, "type": "invalid_request_error", "message": str(e)}))
        except Exception as e:  # noqa: BLE001 - the server stays up; the client gets the reason
            emit(Event("error", data={"status": 500, "type": "server_error", "message": f"{type(e).__name__}: {e}"}))
        finally:
            job.kv_bytes = 0

    def _prefill(self, job: Job):
        """The job's own cache with the prompt read (and compressed), the last logits and the reused token count."""
        o, store = job.options, self.store
        if store is not None:
            store = store.policy(read=o.use_store, write=o.fill_store) if (o.use_store or o.fill_store) else None
        if o.reuse == "prefix":
            def interrupt():
                if job.cancel.is_set() or time.monotonic() > job.deadline:
                    raise Stopped()

            p = prepare(self.lm, job.prompt, o.method, o.keep_ratio, o.query_aware, o.quant, store, interrupt)
            return p.cache, p.logits, p.reuse.reused_tokens if p.reuse is not None else 0, p.kv_bytes_full, p.kv_bytes
        from kvmem.reuse.blend import load_document, precompute, store_document, assemble_and_answer

        head, question = job.prompt.context, job.prompt.question
        docs, reused = [], 0
        for ids in job.documents:
            doc = load_document(store, self.lm, ids, head) if store is not None and o.use_store else None
            reused += len(ids) if doc is not None else 0
            if doc is None:
                doc = precompute(self.lm, ids, head)
                if store is not None and o.fill_store:
                    store_document(store, self.lm, doc)
            docs.append(doc)
        res = assemble_and_answer(self.lm, head, docs, question, o.reuse, o.recompute_ratio, max_new_tokens=0)
        held = res.cache.kv_bytes()
        return res.cache, res.logits, reused, held, held

    def _generate(self, job: Job, choice: int, emit: Callable[[Event], None]) -> bool:
        """Prefill and decode one choice; False when the job ended early (cancelled, timed out)."""
        s, lm = job.sampling, self.lm
        if job.cancel.is_set():
            return False
        if time.monotonic() > job.deadline:
            emit(Event("error", data={"status": 504, "type": "timeout",
                                      "message": f"timed out after {job.timeout_s:g} s before prefill"}))
            return False
        t0 = time.monotonic()
        try:
            cache, logits, reused, kv_full, kv_kept = self._prefill(job)
        except Stopped:
            if not job.cancel.is_set():
                emit(Event("error", choice, data={"status": 504, "type": "timeout",
                                                  "message": f"timed out after {job.timeout_s:g} s during the prefill"}))
            return False
        job.kv_bytes = cache.kv_bytes()
        emit(Event("prefilled", choice, data={"reused_tokens": reused, "prefill_s": time.monotonic() - t0,
                                              "kv_bytes": kv_kept, "kv_bytes_full": kv_full}))
        seed = s.seed + choice if s.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        generator = torch.Generator().manual_seed(seed)
        ends = set() if job.options.ignore_eos else self._ends
        limit = min(s.max_tokens, lm.max_context - cache.get_seq_length())
        out: list[int] = []
        text, sent, finish, first_token_at = "", 0, "length", None
        while len(out) < limit:
            if job.cancel.is_set():
                return False
            if time.monotonic() > job.deadline:
                emit(Event("error", choice, data={"status": 504, "type": "timeout", "message":
                                                  f"timed out after {job.timeout_s:g} s ({len(out)} tokens generated)"}))
                return False
            token = sample(logits, s.temperature, s.top_p, generator)
            first_token_at = first_token_at or time.monotonic()
            if token in ends:
                finish = "stop"
                break
            out.append(token)
            text = lm.tokenizer.decode(out)
            hits = [i for i in (text.find(x, max(sent - len(x), 0)) for x in s.stop) if i >= 0]
            if hits:
                text, finish = text[:min(hits)], "stop"
                break
            safe = len(text) - _held_back(text, s.stop)
            if safe > sent:
                emit(Event("delta", choice, text[sent:safe]))
                sent = safe
            if len(out) < limit:
                logits = feed(lm, cache, [token])
                if len(out) % 32 == 0:
                    job.kv_bytes = cache.kv_bytes()
        if text.endswith("\ufffd"):
            text = text[:-1]
        if len(text) > sent:
            emit(Event("delta", choice, text[sent:]))
        done = time.monotonic()
        job.kv_bytes = cache.kv_bytes()
        emit(Event("done", choice, finish_reason=finish, data={
            "completion_tokens": len(out), "prompt_tokens": len(job.prompt.ids) + sum(map(len, job.documents)),
            "reused_tokens": reused, "kv_bytes": kv_kept, "kv_bytes_full": kv_full,
            "ttft_s": (first_token_at or done) - job.arrived,
            "tpot_s": (done - first_token_at) / (len(out) - 1) if len(out) > 1 else None,
            "last": choice == s.n - 1}))
        del cache, logits
        job.kv_bytes = 0
        return True
