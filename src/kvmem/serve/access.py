"""What wraps every request of `kvmem serve`: its id, one access-log line, and the API key.

- `x-request-id`: the client's (when it is 1 to 128 characters of letters, digits and `-_.:/+=`) or a new one,
  echoed on every response, errors and streams included, and in the log line.
- `--api-key` (`require_key`, a dependency of every route): `Authorization: Bearer <key>` on /v1/*; without it or
  with another key, 401 with an OpenAI-style body (/health and /metrics stay open, for probes and Prometheus; CORS
  preflights carry no key and are answered before). The key is compared in constant time.
- Access log: one JSON line per request on the `kvmem.access` logger, written once the response has ended (a
  stream's too): id, method, path, status, duration_s, and where the route knew them model, user, prompt_tokens
  and completion_tokens (`note`).
- A crash in a route is logged with its traceback and answered as a 500 OpenAI-style body (`on_crash`), with the
  request's id.

A plain ASGI middleware rather than Starlette's `BaseHTTPMiddleware`: that one runs the route in a task of its own,
so a stream's end and a client that goes away would reach the route (and the engine's cancellation) through it.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
import uuid
from typing import Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvmem.serve.schemas import fail

log = logging.getLogger("kvmem.access")
crashes = logging.getLogger("kvmem.serve")
_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")
NOTE = "kvmem.access"  # the request scope's key for what the route tells the log


def note(request: Request, **fields) -> None:
    """Add fields (model, user, prompt_tokens, completion_tokens, or a completion's job) to this request's access-log
    line."""
    request.scope.setdefault(NOTE, {}).update(fields)


def require_key(api_key: str | None) -> Callable[[Request], None]:
    """A dependency that refuses /v1/* requests without `Authorization: Bearer <api_key>` (nothing without a key)."""
    def check(request: Request) -> None:
        if api_key is None or not request.url.path.startswith("/v1/"):
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            fail(401, "a valid API key is needed: send it as 'Authorization: Bearer <key>'", code="invalid_api_key",
                 headers={"WWW-Authenticate": "Bearer"})
    return check


class Access:
    """The ASGI middleware, outermost: request id, access log, crashes as 500 bodies."""

    def __init__(self, app: ASGIApp, on_crash: Callable[[Request, Exception], Response]):
        self.app, self.on_crash = app, on_crash

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        given = request.headers.get("x-request-id", "")
        rid = given if _ID.fullmatch(given) else uuid.uuid4().hex
        scope[NOTE] = {"id": rid}
        started, status, t0 = False, 500, time.monotonic()

        async def send_with_id(message: Message) -> None:
            nonlocal started, status
            if message["type"] == "http.response.start":
                started, status = True, message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as e:
            crashes.exception("request %s (%s %s) failed", rid, scope["method"], scope["path"])
            if started:  # a stream already under way: nothing else can be sent
                raise
            await self.on_crash(request, e)(scope, receive, send_with_id)
        finally:
            self._log(scope, status, time.monotonic() - t0)

    @staticmethod
    def _log(scope: Scope, status: int, duration: float) -> None:
        fields = scope.get(NOTE, {})
        line = {"id": fields.get("id"), "method": scope["method"], "path": scope["path"], "status": status,
                "duration_s": round(duration, 4)}
        job = fields.get("job")  # a completion's: its tokens as the engine counted them
        if job is not None:
            fields |= {"prompt_tokens": len(job.prompt.ids) + sum(map(len, job.documents)),
                       "completion_tokens": job.completion_tokens}
        line |= {k: fields.get(k) for k in ("model", "user", "prompt_tokens", "completion_tokens")}
        log.info(json.dumps(line))
