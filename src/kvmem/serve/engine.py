"""The serving engine without batching (`kvmem serve --no-batching`), and what it shares with the batching scheduler
(`scheduler.py`): a request (`Job`), its prefill (`prefill_job`), its sampling and streamed text (`Stream`).

One shared, read-only model; per request its own cache, compressor and sampler.

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

Batch size is 1: each worker decodes one sequence (continuous batching is `scheduler.py`, the server's default).
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
from kvmem.forward import feed
from kvmem.generate import end_ids, prepare
from kvmem.models import LoadedModel
from kvmem.prompts import Prompt

REUSE_MODES = ("prefix", "semantic", "semshare", "cacheblend", "infoflow")
SEMANTIC_MODES = ("semantic", "semshare")  # through the server's semantic index (`kvmem serve --store ...`)


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
    reuse: str = "prefix"  # semantic / semshare (the server's semantic index), or cacheblend / infoflow over `documents`
    recompute_ratio: float = 0.15  # cacheblend / infoflow / semshare: the share of reused tokens recomputed
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


def prefill_job(lm: LoadedModel, store, job: Job, interrupt: Callable[[], None], index=None):
    """The job's own cache with its prompt read (and compressed): (cache, last logits, reused tokens, KV bytes before
    and after compression). `interrupt()` is called between prefill pieces (it raises `Stopped` to stop the job; the
    batching scheduler also decodes its running rows there). `index`: the server's semantic index (semantic, semshare)."""
    o = job.options
    if o.reuse in SEMANTIC_MODES:
        if index is None:
            raise KVMemError(f"reuse={o.reuse} needs the server's semantic index (start it with --store)")
        view = index.store.policy(read=o.use_store, write=o.fill_store)
        p = prepare(lm, job.prompt, o.method, o.keep_ratio, o.query_aware, o.quant, view, interrupt, o.reuse, index,
                    o.recompute_ratio)
        return p.cache, p.logits, p.reuse.reused_tokens, p.kv_bytes_full, p.kv_bytes
    if store is not None:
        store = store.policy(read=o.use_store, write=o.fill_store) if (o.use_store or o.fill_store) else None
    if o.reuse == "prefix":
        p = prepare(lm, job.prompt, o.method, o.keep_ratio, o.query_aware, o.quant, store, interrupt)
        return p.cache, p.logits, p.reuse.reused_tokens if p.reuse is not None else 0, p.kv_bytes_full, p.kv_bytes
    from kvmem.reuse.blend import assemble_and_answer, load_document, precompute, store_document

    head, question = job.prompt.context, job.prompt.question
    docs, reused = [], 0
    for ids in job.documents:
        doc = load_document(store, lm, ids, head) if store is not None and o.use_store else None
        reused += len(ids) if doc is not None else 0
        if doc is None:
            doc = precompute(lm, ids, head)
            if store is not None and o.fill_store:
                store_document(store, lm, doc)
        docs.append(doc)
    res = assemble_and_answer(lm, head, docs, question, o.reuse, o.recompute_ratio, max_new_tokens=0)
    held = res.cache.kv_bytes()
    return res.cache, res.logits, reused, held, held


def stop_if_ended(job: Job) -> Callable[[], None]:
    """An `interrupt` that raises `Stopped` once the job is cancelled or past its deadline."""
    def interrupt():
        if job.cancel.is_set() or time.monotonic() > job.deadline:
            raise Stopped()
    return interrupt


class Stream:
    """One choice being decoded: samples each token from the logits it is given, ends at an end token, a stop string
    or `limit` tokens, and emits the text as it becomes safe to send (not the start of a possible stop string)."""

    def __init__(self, lm: LoadedModel, job: Job, choice: int, emit: Callable[[Event], None], limit: int,
                 ends: set[int]):
        s = job.sampling
        self.lm, self.job, self.choice, self.emit, self.limit = lm, job, choice, emit, limit
        self.ends = set() if job.options.ignore_eos else ends
        seed = s.seed + choice if s.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.generator = torch.Generator().manual_seed(seed)
        self.out: list[int] = []
        self.text, self.sent, self.finish, self.first_token_at = "", 0, "length", None

    def push(self, logits: torch.Tensor) -> bool:
        """Sample and take the next token; False once the choice has ended (`finish` says why)."""
        s = self.job.sampling
        if len(self.out) >= self.limit:
            return False
        token = sample(logits, s.temperature, s.top_p, self.generator)
        self.first_token_at = self.first_token_at or time.monotonic()
        if token in self.ends:
            self.finish = "stop"
            return False
        self.out.append(token)
        self.text = self.lm.tokenizer.decode(self.out)
        hits = [i for i in (self.text.find(x, max(self.sent - len(x), 0)) for x in s.stop) if i >= 0]
        if hits:
            self.text, self.finish = self.text[:min(hits)], "stop"
            return False
        safe = len(self.text) - _held_back(self.text, s.stop)
        if safe > self.sent:
            self.emit(Event("delta", self.choice, self.text[self.sent:safe]))
            self.sent = safe
        return len(self.out) < self.limit

    def close(self, last: bool, reused: int, kv_full: int, kv_kept: int) -> None:
        """Send what is left of the text and the `done` event."""
        text = self.text[:-1] if self.text.endswith("\ufffd") else self.text
        if len(text) > self.sent:
            self.emit(Event("delta", self.choice, text[self.sent:]))
        done, job, n = time.monotonic(), self.job, len(self.out)
        self.emit(Event("done", self.choice, finish_reason=self.finish, data={
            "completion_tokens": n, "prompt_tokens": len(job.prompt.ids) + sum(map(len, job.documents)),
            "reused_tokens": reused, "kv_bytes": kv_kept, "kv_bytes_full": kv_full,
            "ttft_s": (self.first_token_at or done) - job.arrived,
            "tpot_s": (done - self.first_token_at) / (n - 1) if n > 1 else None, "last": last}))


async def until_last(events: asyncio.Queue) -> AsyncIterator[Event]:
    """A job's events as they come, to its error or its last choice's `done`."""
    while True:
        event = await events.get()
        yield event
        if event.kind == "error" or (event.kind == "done" and event.data.get("last")):
            return


def timeout_event(job: Job, choice: int, when: str) -> Event:
    return Event("error", choice, data={"status": 504, "type": "timeout",
                                        "message": f"timed out after {job.timeout_s:g} s {when}"})


class Engine:
    """One sequence per worker thread (`kvmem serve --no-batching`). Each worker that runs the model holds an OpenMP
    team of its own, so more than one worker on few CPUs makes every team's threads sleep between parallel regions
    (`kvmem.models.on_passing_thread`): one worker with all the threads is the fast way to decode one at a time."""

    def __init__(self, lm: LoadedModel, store=None, workers: int = 1, queue: int = 16, on_finish: Callable | None = None,
                 index=None):
        if workers < 1 or queue < 0:
            raise KVMemError(f"workers must be >= 1 and queue >= 0 (got {workers}, {queue})")
        self.lm, self.store, self.workers, self.queue_size, self.index = lm, store, workers, queue, index
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
            yield timeout_event(job, 0, "waiting in the queue")
            return
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        future = self._start(self._work, job, lambda e: loop.call_soon_threadsafe(events.put_nowait, e))
        future.add_done_callback(lambda _: self.active.discard(job))
        try:
            async for event in until_last(events):
                yield event
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

    def _generate(self, job: Job, choice: int, emit: Callable[[Event], None]) -> bool:
        """Prefill and decode one choice; False when the job ended early (cancelled, timed out)."""
        lm = self.lm
        if job.cancel.is_set():
            return False
        if time.monotonic() > job.deadline:
            emit(timeout_event(job, choice, "before prefill"))
            return False
        t0 = time.monotonic()
        try:
            cache, logits, reused, kv_full, kv_kept = prefill_job(lm, self.store, job, stop_if_ended(job), self.index)
        except Stopped:
            if not job.cancel.is_set():
                emit(timeout_event(job, choice, "during the prefill"))
            return False
        job.kv_bytes = cache.kv_bytes()
        emit(Event("prefilled", choice, data={"reused_tokens": reused, "prefill_s": time.monotonic() - t0,
                                              "kv_bytes": kv_kept, "kv_bytes_full": kv_full}))
        stream = Stream(lm, job, choice, emit, min(job.sampling.max_tokens, lm.max_context - cache.get_seq_length()),
                        self._ends)
        while True:
            if job.cancel.is_set():
                return False
            if time.monotonic() > job.deadline:
                emit(timeout_event(job, choice, f"({len(stream.out)} tokens generated)"))
                return False
            if not stream.push(logits):
                break
            logits = feed(lm, cache, [stream.out[-1]])
            if len(stream.out) % 32 == 0:
                job.kv_bytes = cache.kv_bytes()
        job.kv_bytes = cache.kv_bytes()
        stream.close(choice == job.sampling.n - 1, reused, kv_full, kv_kept)
        del cache, logits
        job.kv_bytes = 0
        return True
