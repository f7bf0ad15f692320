"""`LocalServer`: a `kvmem serve` process of our own on a free loopback port (tests and the load benchmark):

    with LocalServer(["--store", "memory"]) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvmem.errors import KVMemError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM when the thread that started it ends (a test run that is killed, or crashes past
    its fixtures' teardown, leaves no server behind holding a port, memory and CPU)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the `with` block's stop is the only cleanup
        pass


class LocalServer:
    def __init__(self, args: list[str] = (), model: str = "smollm2-135m", log: Path | None = None,
                 startup_s: float = 120.0, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--model", model, "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning",
                     *args]
        self.argv = [sys.executable, "-m", "kvmem.cli", "serve", *self.args]
        self.log, self.startup_s, self.env, self.proc = log, startup_s, env or {}, None

    @property
    def command(self) -> str:
        return shlex.join(["kvmem", "serve", *self.args])

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self) -> LocalServer:
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env}, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise KVMemError(f"kvmem serve {' '.join(self.args)} exited with status {self.proc.returncode}"
                                 + (f" (see {self.log})" if self.log else ""))
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise KVMemError(f"kvmem serve did not answer /health within {self.startup_s:g} s")

    def stop(self) -> None:
        """SIGTERM to its process group (uvicorn shuts down within 5 s), SIGKILL if it does not."""
        if self.proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(15)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        self.proc = None

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
