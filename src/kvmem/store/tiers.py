"""Byte tiers of the chunk store: memory (LRU with a byte budget), local disk, Redis.

A tier maps a hex key to the bytes of one chunk frame (`chunk.py`) and knows nothing else. `get` returns
the bytes or None; `put` returns "ok", "full" or "read-only". A tier that cannot be reached raises (any
exception); `TierStack` (store.py) turns that into a warning, a counter and a miss.

    memory                    memory?max=512MiB
    disk:///var/cache/kvmem   disk:///path?max=20GiB&readonly=1
    redis://127.0.0.1:6379/0  redis://host:6379/0?ttl=86400   (several processes or machines share it)
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from kvmem.errors import KVMemError

_KEY = re.compile(r"^[0-9a-f]{16,128}$")
_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise KVMemError(f"not a size: {text!r} (e.g. 512MiB, 20GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _check_key(key: str) -> str:
    if not _KEY.match(key):
        raise KVMemError(f"not a chunk key: {key!r}")
    return key


class Tier:
    name: str

    def get(self, key: str) -> bytes | None:
        raise NotImplementedError

    def put(self, key: str, blob: bytes) -> str:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


class MemoryTier(Tier):
    """In-process LRU: the least recently read or written chunks leave first once `max_bytes` is exceeded."""

    def __init__(self, max_bytes: int = 2**30):
        self.name, self.max_bytes, self.nbytes = "memory", max_bytes, 0
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            blob = self._items.get(key)
            if blob is not None:
                self._items.move_to_end(key)
            return blob

    def put(self, key: str, blob: bytes) -> str:
        _check_key(key)
        if len(blob) > self.max_bytes:
            return "full"
        with self._lock:
            old = self._items.pop(key, None)
            self.nbytes -= len(old) if old is not None else 0
            while self._items and self.nbytes + len(blob) > self.max_bytes:
                self.nbytes -= len(self._items.popitem(last=False)[1])
            self._items[key] = bytes(blob)
            self.nbytes += len(blob)
        return "ok"

    def delete(self, key: str) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            self.nbytes -= len(old) if old is not None else 0

    def __len__(self) -> int:
        return len(self._items)


class DiskTier(Tier):
    """One file per chunk, `root/<key[:2]>/<key>.kvc`. Writes are atomic (a unique temporary name in the same
    folder, fsync, rename, fsync of the folder): readers and concurrent writers of the same chunk see a whole
    old file, a whole new one, or none. Reads map the file. With `max_bytes`, the least recently used files
    (by modification time, refreshed on read) are removed when a write would exceed it."""

    def __init__(self, root: str | Path, max_bytes: int | None = None, readonly: bool = False):
        self.root, self.max_bytes, self.readonly = Path(root), max_bytes, readonly
        self.name = f"disk://{self.root}"
        if not readonly:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise KVMemError(f"store tier {self.name}: cannot create the folder ({e.strerror})") from None

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{_check_key(key)}.kvc"

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    return b""
                with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
                    blob = m[:]
        except FileNotFoundError:
            return None
        if not self.readonly and self.max_bytes is not None:
            try:
                os.utime(path)  # recency for the LRU
            except OSError:
                pass
        return blob

    def put(self, key: str, blob: bytes) -> str:
        if self.readonly:
            return "read-only"
        path = self._path(key)
        if self.max_bytes is not None:
            if len(blob) > self.max_bytes:
                return "full"
            self._make_room(len(blob))
        try:
            path.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:12]}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as e:
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                return "read-only"
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                return "full"
            raise
        return "ok"

    def _files(self) -> list[tuple[float, int, Path]]:
        out = []
        for p in self.root.glob("??/*.kvc"):
            try:
                st = p.stat()
            except FileNotFoundError:  # removed by another process meanwhile
                continue
            out.append((st.st_mtime, st.st_size, p))
        return out

    def _make_room(self, incoming: int) -> None:
        files = sorted(self._files())
        total = sum(size for _, size, _ in files)
        for _, size, p in files:
            if total + incoming <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size

    def delete(self, key: str) -> None:
        if not self.readonly:
            self._path(key).unlink(missing_ok=True)


class RedisTier(Tier):
    """Chunks as Redis strings `kvmem:<key>` (SET is atomic: readers see a whole chunk or none), optionally
    expiring after `ttl` seconds. A Redis at its maxmemory without eviction answers OOM: reported as full."""

    def __init__(self, url: str, ttl: int | None = None, timeout: float = 2.0):
        import redis

        self.name, self.ttl = url, ttl
        self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)

    def get(self, key: str) -> bytes | None:
        return self.client.get(f"kvmem:{_check_key(key)}")

    def put(self, key: str, blob: bytes) -> str:
        import redis

        try:
            self.client.set(f"kvmem:{_check_key(key)}", blob, ex=self.ttl)
        except redis.exceptions.ResponseError as e:
            if "OOM" in str(e):
                return "full"
            if "READONLY" in str(e):
                return "read-only"
            raise
        return "ok"

    def delete(self, key: str) -> None:
        self.client.delete(f"kvmem:{_check_key(key)}")


def parse_tier(spec: str) -> Tier:
    """One tier from its URL-style spec (see the module doc)."""
    parts = urlsplit(spec.strip())
    options = dict(parse_qsl(parts.query))
    known = {"memory": {"max"}, "disk": {"max", "readonly"}, "redis": {"ttl"}, "rediss": {"ttl"}}
    scheme = parts.scheme or parts.path  # "memory" has no "://"
    if scheme not in known:
        raise KVMemError(f"unknown store tier {spec!r}; use memory, disk:///path or redis://host:port/db")
    if scheme in ("memory", "disk") and (unknown := set(options) - known[scheme]):
        raise KVMemError(f"store tier {spec!r}: unknown option(s) {sorted(unknown)}; {scheme} takes {sorted(known[scheme])}")
    if scheme == "memory":
        return MemoryTier(parse_bytes(options["max"]) if "max" in options else 2**30)
    if scheme == "disk":
        if not parts.path:
            raise KVMemError(f"store tier {spec!r} names no folder (disk:///absolute/path)")
        return DiskTier(parts.path, parse_bytes(options["max"]) if "max" in options else None,
                        options.get("readonly", "0").lower() in ("1", "true", "yes"))
    ttl = options.pop("ttl", None)
    url = urlunsplit((parts.scheme, parts.netloc, parts.path, "&".join(f"{k}={v}" for k, v in options.items()), ""))
    return RedisTier(url, int(ttl) if ttl else None)


def parse_stack(spec: str) -> list[Tier]:
    """Tiers fastest first from `memory,disk:///path,redis://...`."""
    tiers = [parse_tier(s) for s in spec.split(",") if s.strip()]
    if not tiers:
        raise KVMemError("an empty store spec; e.g. --store memory,disk:///tmp/kvmem")
    return tiers


class LocalRedis:
    """A redis-server of our own on a free loopback port, no persistence (tests and benchmarks):

        with LocalRedis() as server:
            store = ChunkStore(f"memory,{server.url}")
    """

    def __init__(self):
        import shutil
        import socket

        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise KVMemError("redis-server is not installed (`make redis` installs Debian's package)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None

    def start(self) -> LocalRedis:
        import socket
        import subprocess
        import time

        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.1).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise KVMemError(f"redis-server did not start on port {self.port}")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()
