"""`kvmem serve`: an OpenAI-compatible HTTP server with the cache layer inside (app.py: routes; engine.py: the
request queue, one cache per request; metrics.py: Prometheus)."""

from kvmem.serve.app import create_app
from kvmem.serve.engine import Engine, Job, Options, Sampling

__all__ = ["Engine", "Job", "Options", "Sampling", "create_app"]
