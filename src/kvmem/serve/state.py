"""What every route of `kvmem serve` reads: the model, the store, the engine that runs jobs, the metrics, and the
server's limits and defaults (set once by `create_app`, shared read-only by the requests)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvmem.models import LoadedModel
from kvmem.serve.engine import Options

if TYPE_CHECKING:
    from kvmem.serve.engine import Engine
    from kvmem.serve.metrics import Metrics
    from kvmem.serve.scheduler import Scheduler


@dataclass
class Server:
    lm: LoadedModel
    store: Any  # a ChunkStore or None
    engine: Engine | Scheduler  # continuous batching with a KV budget, worker threads without one
    metrics: Metrics
    defaults: Options  # kvmem's options where a request gives none (`kvmem serve --method ...`)
    workers: int
    queue: int
    kv_budget: int | None
    timeout_s: float
    max_tokens: int
    max_n: int
    embed_method: str
    embedders: dict[str, Any] = field(default_factory=dict)  # reference encoders (no LLM, no hooks): loaded once
    index: Any = None  # a SemanticIndex over the store (reuse=semantic / semshare), or None

    @property
    def fingerprint(self) -> str:
        return self.lm.fingerprint[:16]
