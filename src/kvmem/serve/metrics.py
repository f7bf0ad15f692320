"""The server's Prometheus metrics (`GET /metrics`), in a registry of its own (one per app, so two apps in one
process, as in the tests, count apart).

Requests by endpoint and status; time to first token (from arrival, queueing included) and time per output
token as histograms; prompt, reused and completion tokens; queue depth, running requests and the KV bytes the
running requests hold (measured from their caches); the chunk store's lookups per tier (a lookup that misses a
tier goes on to the next: a hit on tier i is a miss on every tier before it) and its other events (writes,
corrupt chunks, full or unreachable tiers) and the bytes its in-process tier holds; the process's memory
(`process_resident_memory_bytes`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)


class _StoreCollector:
    def __init__(self, store):
        self.store = store

    def describe(self):
        return []

    def collect(self):
        stats = dict(self.store.stats)
        names = [t.name for t in self.store.tiers]
        lookups = CounterMetricFamily("kvmem_store_lookups", "Chunk lookups per tier and result", labels=["tier", "result"])
        for i, name in enumerate(names):
            lookups.add_metric([name, "hit"], stats.get(f"hit:{name}", 0))
            later = sum(stats.get(f"hit:{n}", 0) for n in names[i + 1:]) + stats.get("miss", 0)
            lookups.add_metric([name, "miss"], later)
        yield lookups
        events = CounterMetricFamily("kvmem_store_events", "Chunk writes and failures", labels=["event"])
        for event in ("write", "corrupt", "unavailable", "full", "readonly"):
            events.add_metric([event], stats.get(event, 0))
        yield events
        held = GaugeMetricFamily("kvmem_store_bytes", "Bytes held by the store's in-process tiers", labels=["tier"])
        for tier in self.store.tiers:
            if tier.name == "memory":
                held.add_metric([tier.name], tier.nbytes)
        yield held


class Metrics:
    def __init__(self, engine, store=None):
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)
        self.requests = Counter("kvmem_requests", "Requests by endpoint and HTTP status", ["endpoint", "status"], registry=r)
        self.ttft = Histogram("kvmem_time_to_first_token_seconds", "Arrival to first token (queueing included)",
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram("kvmem_time_per_output_token_seconds", "Decode time per token after the first",
                              buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2), registry=r)
        self.prompt_tokens = Counter("kvmem_prompt_tokens", "Prompt tokens read", registry=r)
        self.reused_tokens = Counter("kvmem_reused_tokens", "Prompt tokens loaded from the store, not computed", registry=r)
        self.completion_tokens = Counter("kvmem_completion_tokens", "Tokens generated", registry=r)
        self.cancelled = Counter("kvmem_cancelled_requests", "Requests whose client went away before the end", registry=r)
        Gauge("kvmem_queue_depth", "Requests waiting for a worker or for KV memory", registry=r).set_function(lambda: engine.waiting)
        Gauge("kvmem_running_requests", "Requests being computed", registry=r).set_function(lambda: engine.running)
        Gauge("kvmem_kv_bytes_held", "KV cache bytes held by running requests (measured)",
              registry=r).set_function(engine.kv_bytes_held)
        if hasattr(engine, "kv_budget"):  # continuous batching (serve.scheduler)
            Gauge("kvmem_kv_budget_bytes", "KV bytes the running rows may hold (--kv-budget)",
                  registry=r).set_function(lambda: engine.kv_budget)
            Gauge("kvmem_batch_rows", "Sequences in the decoding batch", registry=r).set_function(lambda: len(engine.rows))
            Gauge("kvmem_swapped_rows", "Sequences preempted to disk, waiting to resume",
                  registry=r).set_function(lambda: len(engine.swapped))
            Gauge("kvmem_preemptions", "Sequences preempted so far", registry=r).set_function(lambda: engine.preemptions)
        if store is not None:
            r.register(_StoreCollector(store))

    def record_done(self, data: dict) -> None:
        """One finished choice (the engine's `done` event)."""
        self.ttft.observe(data["ttft_s"])
        if data.get("tpot_s") is not None:
            self.tpot.observe(data["tpot_s"])
        self.completion_tokens.inc(data["completion_tokens"])

    def record_prefill(self, prompt_tokens: int, reused_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.reused_tokens.inc(reused_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
