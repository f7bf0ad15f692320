"""Continuous batching: every running request decodes in one batch, admitted by the KV bytes it holds.

    scheduler = Scheduler(lm, store, kv_budget=512 * 2**20, queue=16)
    scheduler.admit(job)                   # raises Busy when `queue` requests already wait (the server answers 429)
    async for event in scheduler.run(job): # "prefilled", then "delta"s, then "done" (or one "error"), as Engine's
        ...

One thread owns the model. Each turn it (1) drops rows whose request was cancelled or timed out, (2) resumes
preempted rows that fit again, (3) starts the oldest waiting request if its KV fits, else (4) decodes one token for
every running row in one forward (`kvmem.batch.RowBatch`: each row keeps its own cache, positions, method,
quantization and ragged heads; the weights are read once for all of them).

* **Chunked prefill, interleaved.** A request's prefill (with its store loads and its compression, exactly
  `kvmem.generate.prepare`) runs in pieces of 512 tokens (or the store's chunks); before each piece the running
  rows decode one token, so a long prompt delays everyone's next token by one piece, not by the whole prefill.
* **Join and leave.** After its prefill and compression a request's choices (`n` of them: the cache is cloned)
  sample their first token and join the batch; a row leaves at an end token, a stop string, `max_tokens`, the
  model's context, cancellation or its deadline, and its cache is freed at once.
* **Admission by KV bytes.** `kv_budget` bounds the bytes the rows hold (measured after every step,
  `KVCache.kv_bytes`). A waiting request starts when its estimate fits beside them: the full cache of its prompt
  (per layer bytes per token measured once on the model, sliding layers capped at their window) times the share its
  configuration (method, keep ratio, quantization) was measured to keep the last time; before the first of its kind
  has run, its keep ratio (quantization not counted). So compressed and quantized requests fit more at once; a
  wrong estimate costs a preemption, never a wrong answer. A request that could not fit even alone is refused (400);
  past `queue` waiting requests, new ones get 429. The prefill in flight holds its uncompressed cache outside the
  budget (one at a time; its peak is reported as `prefill_bytes`).
* **Preemption.** Decoding grows every row; when the rows exceed the budget the newest rows are swapped out to a
  disk tier (`kvmem.store.swap`: the rows as held, quantized ones still encoded, checksummed) until the rest fit,
  and swapped rows resume, oldest first, before any new request starts. The last running row is never preempted.

When the last row has left, the heap the caches used is handed back to the OS (`return_freed_memory`), so the
server's RSS returns towards where it was before the load.

Greedy outputs do not depend on the batch: each row's attention reads only its own rows, so a row's logits are
those it gets alone up to float rounding (the batched linear layers sum in another order, and a batch's attention
runs in kvmem's kernel where a sequence alone keeps transformers' SDPA); tests check the tokens on both model
families, for full, evicted, ragged and quantized caches.

Embedding requests run on the same thread, between two steps or two prefill pieces: a second thread running torch
would slow every step (`kvmem.models.on_passing_thread`).
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import shutil
import tempfile
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import torch

from kvmem.batch import RowBatch
from kvmem.cache import KVCache
from kvmem.compress import compress_while_decoding, get_method
from kvmem.errors import KVMemError
from kvmem.forward import feed, step
from kvmem.generate import end_ids, new_cache
from kvmem.models import LoadedModel, on_passing_thread
from kvmem.serve.engine import (Busy, Event, Job, Stopped, Stream, echo_logprobs, prefill_job, stop_if_ended,
                                timeout_event, until_last)
from kvmem.store.swap import pack_cache, unpack_cache
from kvmem.store.tiers import DiskTier


def return_freed_memory() -> None:
    """Hand the heap that freed caches leave in glibc's arenas back to the OS (`malloc_trim`): without it a server's
    RSS stays at its peak after a load (measured: +690 MiB after 16 clients of kivi-4 at 4k, all KV freed). Nothing
    where the C library has no malloc_trim."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclass(eq=False)
class Row:
    """One choice of a request in the batch (or swapped out)."""

    job: Job
    stream: Stream
    cache: KVCache | None
    reused: int
    kv_full: int
    kv_kept: int
    kv_bytes: int = 0  # measured after the last step (0 while swapped out)
    swapped: str | None = None  # the swap tier's key while preempted
    swapped_bytes: int = 0


@dataclass(eq=False)
class Request:
    job: Job
    emit: Callable[[Event], None]
    choices_left: int = 0
    rows: list[Row] = field(default_factory=list)


class Scheduler:
    workers = 1  # one thread runs the model (for /health)

    def __init__(self, lm: LoadedModel, store=None, kv_budget: int = 2**30, queue: int = 16, max_rows: int = 64,
                 swap_dir: str | None = None, index=None):
        if kv_budget <= 0 or queue < 0 or max_rows < 1:
            raise KVMemError(f"kv_budget must be > 0 bytes, queue >= 0 and max_rows >= 1 (got {kv_budget}, {queue}, "
                             f"{max_rows})")
        self.lm, self.store, self.kv_budget, self.queue_size, self.max_rows = lm, store, kv_budget, queue, max_rows
        self.index = index  # the semantic index of reuse=semantic / semshare (kvmem.reuse.semantic_index)
        self.batch = RowBatch(lm.model.config)
        self.rows: list[Row] = []  # decoding, in the batch's order
        self.swapped: deque[Row] = deque()  # preempted, oldest first
        self.queue: deque[Request] = deque()  # admitted, not started
        self.requests: dict[Job, Request] = {}
        self.prefilling: Request | None = None
        self.prefill_bytes = 0  # the largest uncompressed prefill held so far (outside the budget)
        self.preemptions = self.resumptions = self.steps = 0
        self._own_swap_dir = swap_dir is None
        self._swap_dir = swap_dir or tempfile.mkdtemp(prefix="kvmem-swap-")
        self._swap = DiskTier(self._swap_dir)
        # per layer, with its window; measured on a passing thread, so that only the model's thread holds an OpenMP team
        self._bytes_per_token = on_passing_thread(_bytes_per_token, lm)
        self._kept_share: dict[tuple, float] = {}  # measured kept / full-cache estimate, per configuration
        self._ends = end_ids(lm)
        self._mean_s = 1.0  # running mean of a request's duration, for Retry-After
        self._idle_trimmed = True
        self._wake = threading.Condition()
        self._stopped = False
        self._calls: deque[tuple[Callable, Future]] = deque()  # embeddings, run between two steps
        self._calls_owe_s = 0.0  # the time embeddings took while rows decoded, not yet given back to the steps
        self._thread = threading.Thread(target=self._loop, name="kvmem-scheduler", daemon=True)
        self._thread.start()

    # -- what the server reads ----------------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return len(self.queue)

    @property
    def running(self) -> int:
        return len(self.rows) + len(self.swapped) + (self.prefilling is not None)

    def kv_bytes_held(self) -> int:
        return sum(r.kv_bytes for r in list(self.rows))

    def close(self) -> None:
        self._stopped = True
        with self._wake:
            self._wake.notify()
        self._thread.join(timeout=30)
        for _, future in self._calls:
            future.cancel()
        if self._own_swap_dir:
            shutil.rmtree(self._swap_dir, ignore_errors=True)

    # -- admission (event-loop side) -----------------------------------------------------------------------------
    def admit(self, job: Job | None = None) -> None:
        """Take a request into the queue, or raise `Busy` when `queue` requests wait already."""
        if len(self.queue) >= self.queue_size:
            wait = max(1, math.ceil(self._mean_s))
            raise Busy(wait, f"the server is busy: {len(self.rows)} sequences decoding and {len(self.queue)} requests "
                             f"waiting for KV memory (queue of {self.queue_size}); retry in {wait} s")

    async def call(self, fn: Callable, timeout_s: float):
        """`fn()` on the model's thread between two steps (requests `admit()`ted without a job, i.e. embeddings).

        Not on a thread of their own: a second thread running torch would hold a second OpenMP team, which slows
        every decode step (see `kvmem.models.on_passing_thread`)."""
        future: Future = Future()
        with self._wake:
            self._calls.append((fn, future))
            self._wake.notify()
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout_s)
        except TimeoutError:
            future.cancel()  # a no-op once it has started
            raise KVMemError(f"timed out after {timeout_s:g} s") from None

    async def run(self, job: Job) -> AsyncIterator[Event]:
        """The events of an admitted job; leaving the loop early (the client went away) cancels it."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        request = Request(job, lambda e: loop.call_soon_threadsafe(events.put_nowait, e), job.sampling.n)
        with self._wake:
            self.requests[job] = request
            self.queue.append(request)
            self._wake.notify()
        try:
            async for event in until_last(events):
                yield event
        finally:
            job.cancel.set()  # a no-op when it has finished; else its rows leave at the next turn
            with self._wake:
                self._wake.notify()

    # -- the model's thread -----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stopped:
            try:
                self._turn()
            except Exception as e:  # noqa: BLE001 - a failed step ends its requests, not the server
                for request in list(self.requests.values()):
                    self._fail(request, 500, "server_error", f"{type(e).__name__}: {e}")

    def _run_calls(self) -> None:
        """The waiting embeddings; while rows decode, they share the thread with the steps in equal time (a call
        runs once the steps since the last one took as long as it did), so a stream of them cannot stall the rows."""
        if not self.rows:
            self._calls_owe_s = 0.0
        while self._calls and (not self.rows or self._calls_owe_s <= 0):
            fn, future = self._calls.popleft()
            if future.set_running_or_notify_cancel():
                t0 = time.monotonic()
                try:
                    future.set_result(fn())
                except Exception as e:  # noqa: BLE001 - the caller gets it
                    future.set_exception(e)
                if self.rows:
                    self._calls_owe_s += time.monotonic() - t0

    def _turn(self) -> None:
        self._run_calls()
        self._drop_ended()
        self._resume()
        request = self._next_request()
        if request is not None:
            self._start(request)
        elif self.rows:
            self._step()
            self._idle_trimmed = False
        else:
            if not self._idle_trimmed:  # the load is over: what the rows held goes back to the OS
                return_freed_memory()
                self._idle_trimmed = True
            with self._wake:
                if not self.queue and not self._calls and not self._stopped:
                    self._wake.wait(0.5)

    def _full_bytes(self, job: Job) -> float:
        """What one uncompressed cache of the job's prompt holds (per-layer bytes per token, measured)."""
        tokens = len(job.prompt.ids) + sum(map(len, job.documents))
        return sum(b * min(tokens, w or tokens) for b, w in self._bytes_per_token)

    def _estimate(self, job: Job) -> int:
        """The KV bytes the job's rows will hold after its method and quantization (see the module doc)."""
        share = self._kept_share.get(_configuration(job), job.options.keep_ratio)
        return int(self._full_bytes(job) * share) * job.sampling.n

    def _next_request(self) -> Request | None:
        """The oldest waiting request when its KV fits beside the rows (and no preempted row waits to resume)."""
        with self._wake:
            if not self.queue or self.swapped:
                return None
            request = self.queue[0]
            need = self._estimate(request.job)
            if not self.rows and need > self.kv_budget:
                self.queue.popleft()
                self._fail(request, 400, "invalid_request_error",
                           f"this request needs about {need / 2**20:.1f} MiB of KV cache; the server's --kv-budget is "
                           f"{self.kv_budget / 2**20:.1f} MiB (compress it: kvmem.method / keep_ratio / quant)",
                           code="kv_budget_exceeded")
                return None
            if self.rows and (self.kv_bytes_held() + need > self.kv_budget or len(self.rows) + request.job.sampling.n
                              > self.max_rows):
                return None
            return self.queue.popleft()

    def _start(self, request: Request) -> None:
        job, lm = request.job, self.lm
        if job.cancel.is_set():
            self.requests.pop(job, None)
            return
        if time.monotonic() > job.deadline:
            self._fail(request, 504, "timeout", timeout_event(job, 0, "waiting in the queue").data["message"])
            return
        ended = stop_if_ended(job)

        def interrupt():  # between prefill pieces: the running rows get their next token, embeddings their turn
            ended()
            self._run_calls()
            self._drop_ended()
            if self.rows:
                self._step()

        self.prefilling = request
        t0 = time.monotonic()
        try:
            cache, logits, reused, kv_full, kv_kept = prefill_job(lm, self.store, job, interrupt, self.index)
        except Stopped:
            if not job.cancel.is_set():
                self._fail(request, 504, "timeout", timeout_event(job, 0, "during the prefill").data["message"])
            self.requests.pop(job, None)
            return
        except KVMemError as e:
            self._fail(request, 400, "invalid_request_error", str(e))
            return
        except Exception as e:  # noqa: BLE001 - this request fails; the rows and the server go on
            self._fail(request, 500, "server_error", f"{type(e).__name__}: {e}")
            return
        finally:
            self.prefilling = None
        self.prefill_bytes = max(self.prefill_bytes, kv_full)
        self._kept_share[_configuration(job)] = cache.kv_bytes() / max(self._full_bytes(job), 1.0)  # the latest
        limit = min(job.sampling.max_tokens, lm.max_context - cache.get_seq_length())
        try:  # a grammar that fails to build, a prompt too long to echo: this request fails, not the rows
            streams = [Stream(lm, job, choice, request.emit, limit, self._ends) for choice in range(job.sampling.n)]
            echoed = echo_logprobs(lm, job, 0)
        except KVMemError as e:
            self._fail(request, 400, "invalid_request_error", str(e))
            return
        caches = [cache] + [cache.clone() for _ in range(job.sampling.n - 1)]
        for choice, (c, stream) in enumerate(zip(caches, streams)):
            request.emit(Event("prefilled", choice, data={"reused_tokens": reused, "prefill_s": time.monotonic() - t0,
                                                          "kv_bytes": kv_kept, "kv_bytes_full": kv_full}
                               | (echoed if choice == 0 else {})))
            row = Row(job, stream, c, reused, kv_full, kv_kept)
            request.rows.append(row)
            if row.stream.push(logits):
                row.kv_bytes = c.kv_bytes()
                self.batch.join(c)
                self.rows.append(row)
            else:
                self._finish(row)

    def _step(self) -> None:
        """One token for every running row, in one forward."""
        t0 = time.monotonic()
        logits = step(self.lm, self.batch, [[r.stream.out[-1]] for r in self.rows])
        self._calls_owe_s = max(0.0, self._calls_owe_s - (time.monotonic() - t0))
        self.steps += 1
        for row, row_logits in zip(list(self.rows), logits):
            if not row.stream.push(row_logits):
                self._leave(row)
                self._finish(row)
            else:
                row.kv_bytes = row.cache.kv_bytes()
        while len(self.rows) > 1 and self.kv_bytes_held() > self.kv_budget:
            # the newest row that can be swapped: an offloaded cache (compress/offload/) splits its rows between a tier
            # and a bounded working set and is not exported; it stays, over the budget if nothing else can go
            movable = [r for r in self.rows[1:] if not any(getattr(layer.rows, "retrieves", False)
                                                          for layer in r.cache.layers)]
            if not movable:
                break
            self._swap_out(movable[-1])

    # -- rows leaving, preempted, resumed -------------------------------------------------------------------------
    def _leave(self, row: Row) -> None:
        self.batch.leave(row.cache)
        self.rows.remove(row)
        row.cache, row.kv_bytes = None, 0

    def _finish(self, row: Row) -> None:
        request = self.requests.get(row.job)
        if request is None:
            return
        request.choices_left -= 1
        row.stream.close(request.choices_left == 0, row.reused, row.kv_full, row.kv_kept)
        if request.choices_left == 0:
            self.requests.pop(row.job, None)
            self._mean_s = 0.8 * self._mean_s + 0.2 * (time.monotonic() - row.job.arrived)

    def _swap_out(self, row: Row) -> None:
        key = uuid.uuid4().hex
        self._swap.put(key, pack_cache(row.cache, self.lm.fingerprint))
        row.swapped, row.swapped_bytes = key, row.kv_bytes
        self._leave(row)
        self.swapped.append(row)
        self.preemptions += 1

    def _resume(self) -> None:
        while self.swapped and (not self.rows or self.kv_bytes_held() + self.swapped[0].swapped_bytes <= self.kv_budget):
            row = self.swapped.popleft()
            blob = self._swap.get(row.swapped)
            self._swap.delete(row.swapped)
            o = row.job.options
            try:
                if blob is None:
                    raise KVMemError("its swap file is gone")
                cache = unpack_cache(blob, new_cache(self.lm, get_method(o.method), o.quant), self.lm.fingerprint)
            except KVMemError as e:  # never decode from KV that failed verification: this request fails, not the rest
                if (request := self.requests.get(row.job)) is not None:
                    self._fail(request, 500, "server_error", f"a preempted sequence could not resume: {e}")
                continue
            method = get_method(o.method)
            if method.evicts_while_decoding(o.keep_ratio):  # its momentum came back with it: it goes on evicting
                compress_while_decoding(cache, method, o.keep_ratio, cache.layers[0].observation.prompt_end)
            else:
                cache.drop_observations()  # as after its prefill: no scorer runs again
            row.cache, row.swapped, row.kv_bytes = cache, None, cache.kv_bytes()
            self.batch.join(cache)
            self.rows.append(row)
            self.resumptions += 1

    def _drop_ended(self) -> None:
        """Rows and waiting requests of cancelled or timed-out jobs leave; a timeout is reported (504)."""
        now = time.monotonic()
        for row in [*self.rows, *self.swapped]:
            job = row.job
            if not job.cancel.is_set() and now > job.deadline:
                request = self.requests.get(job)
                if request is not None:
                    self._fail(request, 504, "timeout", timeout_event(job, row.stream.choice,
                                                                      f"({len(row.stream.out)} tokens generated)")
                               .data["message"])
            if job.cancel.is_set():
                if row in self.rows:
                    self._leave(row)
                else:
                    self.swapped.remove(row)
                    self._swap.delete(row.swapped)
                self.requests.pop(job, None)
        with self._wake:
            for request in [r for r in self.queue if r.job.cancel.is_set() or now > r.job.deadline]:
                self.queue.remove(request)
                if not request.job.cancel.is_set():
                    self._fail(request, 504, "timeout", timeout_event(request.job, 0, "waiting in the queue")
                               .data["message"])
                self.requests.pop(request.job, None)

    def _fail(self, request: Request, status: int, kind: str, message: str, code: str | None = None) -> None:
        request.emit(Event("error", data={"status": status, "type": kind, "message": message} |
                           ({"code": code} if code else {})))
        request.job.cancel.set()  # its other rows leave at the next turn
        self.requests.pop(request.job, None)  # an error is a request's last event
        if request in self.queue:
            self.queue.remove(request)


def _configuration(job: Job) -> tuple:
    o = job.options
    return (o.method, o.keep_ratio, o.quant, o.query_aware, o.reuse)


def _bytes_per_token(lm: LoadedModel) -> list[tuple[float, int | None]]:
    """Per layer: KV bytes per token, measured on a 64-token prefill of this model, and the layer's window."""
    probe = KVCache(lm.model.config, observe_window=0)
    with torch.no_grad():
        feed(lm, probe, list(range(64)))
    return [(storage / 64, layer.sliding_window)
            for layer, storage in zip(probe.layers, (sum(t.nbytes for t in layer.kv_tensors()) for layer in probe.layers))]
