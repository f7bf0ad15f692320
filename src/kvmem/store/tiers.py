"""Byte tiers of the chunk store: memory (LRU with a byte budget), local disk, Redis.

A tier maps a hex key to the bytes of one chunk frame (`chunk.py`) and knows nothing else. `get` returns
the bytes or None; `put` returns "ok", "full" or "read-only". A tier that cannot be reached raises (any
exception); `TierStack` (store.py) turns that into a warning, a counter and a miss.

    memory                    memory?max=512MiB
    disk:///var/cache/kvmem   disk:///path?max=20GiB&readonly=1
    redis://127.0.0.1:6379/0  redis://host:6379/0?ttl=86400   (several processes or machines share it)
    redis+cluster://host:7000,host:7001,host:7002?ttl=86400   (a Redis Cluster: chunks spread over its nodes)

A Redis Cluster tier can fail in part: a node that is down makes its own chunks misses (`NodeDown`, which the store
counts and warns about without giving up the whole tier) while the other nodes keep serving theirs.
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
import threading
import time
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
    # called with the key of each chunk the tier itself drops to make room (memory LRU, disk budget); set by the
    # ChunkStore that holds the tier, so what indexes its chunks (the semantic index) can drop its entries
    on_evict = None

    def get(self, key: str) -> bytes | None:
        raise NotImplementedError

    def contains(self, key: str) -> bool:
        """Whether the tier holds `key` now (raises like `get` when it cannot be reached)."""
        return self.get(key) is not None

    def _evicted(self, keys: list[str]) -> None:
        if self.on_evict is not None:
            for key in keys:
                self.on_evict(key)

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
        evicted = []
        with self._lock:
            old = self._items.pop(key, None)
            self.nbytes -= len(old) if old is not None else 0
            while self._items and self.nbytes + len(blob) > self.max_bytes:
                gone, data = self._items.popitem(last=False)
                self.nbytes -= len(data)
                evicted.append(gone)
            self._items[key] = bytes(blob)
            self.nbytes += len(blob)
        self._evicted(evicted)  # outside the lock: a listener may read the store
        return "ok"

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._items

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
            with open(path, "rb", buffering=0) as f:
                blob = f.readall()  # read(2) releases the GIL: a read-ahead thread overlaps the verifying one
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
        evicted = []
        for _, size, p in files:
            if total + incoming <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size
            evicted.append(p.stem)
        self._evicted(evicted)

    def contains(self, key: str) -> bool:
        return self._path(key).exists()

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
            return _refusal(e)
        return "ok"

    def delete(self, key: str) -> None:
        self.client.delete(f"kvmem:{_check_key(key)}")

    def contains(self, key: str) -> bool:
        return bool(self.client.exists(f"kvmem:{_check_key(key)}"))


def _refusal(error: Exception) -> str:
    """A write Redis refused: at its maxmemory without eviction (OOM), or a replica (READONLY); anything else raises."""
    if "OOM" in str(error):
        return "full"
    if "READONLY" in str(error):
        return "read-only"
    raise error


class NodeDown(Exception):
    """One node of a cluster tier cannot serve this key (down, or its slot has no node): the key is a miss or a
    skipped write, while the tier's other nodes still serve theirs. The store counts it and warns, and does not
    skip the whole tier as it does for other errors."""


class RedisClusterTier(Tier):
    """Chunks as strings `kvmem:<key>` in a Redis Cluster. No hash tags: a key's slot is the hash of the whole
    key, so the chunks of one prompt spread over the slots and nodes (as LMCache does).

    A node that fails (connection refused or timed out, CLUSTERDOWN, a slot with no node) raises `NodeDown` for
    its keys, and for `retry_s` seconds its keys raise `NodeDown` at once, without waiting for a timeout on every
    chunk; then the next key of that node tries it again. redis-py refreshes its slot map after such an error, so
    slots that moved (a replica promoted, a node back) are found. If no node of the cluster answers, the error is
    raised as it is and the store skips the whole tier for a while, as for a single Redis that is down.
    The client connects on first use, so a store can be built while the cluster is still down."""

    def __init__(self, nodes: list[tuple[str, int]], ttl: int | None = None, timeout: float = 2.0,
                 retry_s: float = 5.0, username: str | None = None, password: str | None = None):
        self.nodes, self.ttl, self.timeout, self.retry_s = list(nodes), ttl, timeout, retry_s
        self._credentials = {"username": username, "password": password}
        self.name = "redis+cluster://" + ",".join(f"{h}:{p}" for h, p in self.nodes)
        self._client = None
        self._connecting = threading.Lock()
        self._down: dict[str | None, tuple[float, str]] = {}  # node name -> (skipped until, why)

    def client(self):
        """The cluster client, made on first use (it reads the slot map from the first startup node that answers)."""
        from redis.backoff import NoBackoff
        from redis.cluster import ClusterNode, RedisCluster
        from redis.retry import Retry

        with self._connecting:
            if self._client is None:
                # require_full_coverage=False: a slot map with a hole still serves the slots it has. The
                # constructor sends COMMAND to one node and, with retries, to another if that one is down.
                client = RedisCluster(
                    startup_nodes=[ClusterNode(h, p) for h, p in self.nodes], require_full_coverage=False,
                    retry=Retry(NoBackoff(), retries=len(self.nodes)), socket_timeout=self.timeout,
                    socket_connect_timeout=self.timeout, **self._credentials)
                # then no retry: redis-py's default (3 retries, jittered backoff) spends ~3.5 s per key on a node
                # that refuses connections, and a timeout per attempt on one that hangs; here a failed key is a
                # miss the store recomputes, and redis-py still reads the slot map again before the next request
                client.set_retry(Retry(NoBackoff(), retries=0))
                self._client = client
            return self._client

    def _run(self, key: str, command):
        from redis.exceptions import ClusterDownError, ConnectionError, SlotNotCoveredError, TimeoutError

        client, name = self.client(), f"kvmem:{_check_key(key)}"
        try:
            node = client.get_node_from_key(name).name
        except SlotNotCoveredError:
            node = None  # the client's slot map has a hole here: one skip entry for all such slots
        down = self._down.get(node)
        if down is not None and down[0] > time.monotonic():
            raise NodeDown(down[1])
        if node is None:
            # redis-py reads the map again after a failed request, but a slot it has no node for fails before any
            # request is sent; so read it here (at most once per retry_s, the skip above)
            self._refresh(client)
        try:
            return command(client, name)
        except (ConnectionError, TimeoutError, ClusterDownError, SlotNotCoveredError) as e:
            what = f"node {node} failed" if node else "no node serves some slots"
            why = f"{what} ({type(e).__name__}: {e}); their chunks are misses for {self.retry_s:g} s"
            self._down[node] = (time.monotonic() + self.retry_s, why)
            raise NodeDown(why) from None

    @staticmethod
    def _refresh(client) -> None:
        """Read the slot map again from the first node that answers."""
        from redis.exceptions import RedisClusterException, RedisError

        try:
            client.nodes_manager.initialize()
        except (RedisClusterException, RedisError):
            pass  # no node answered: the next error tries again

    def get(self, key: str) -> bytes | None:
        return self._run(key, lambda client, name: client.get(name))

    def put(self, key: str, blob: bytes) -> str:
        from redis.exceptions import ClusterDownError, ResponseError

        def write(client, name):
            try:
                client.set(name, blob, ex=self.ttl)
            except ClusterDownError:
                raise
            except ResponseError as e:
                return _refusal(e)
            return "ok"

        return self._run(key, write)

    def delete(self, key: str) -> None:
        self._run(key, lambda client, name: client.delete(name))

    def contains(self, key: str) -> bool:
        return bool(self._run(key, lambda client, name: client.exists(name)))


def parse_tier(spec: str) -> Tier:
    """One tier from its URL-style spec (see the module doc)."""
    parts = urlsplit(spec.strip())
    options = dict(parse_qsl(parts.query))
    known = {"memory": {"max"}, "disk": {"max", "readonly"}, "redis": {"ttl"}, "rediss": {"ttl"},
             "redis+cluster": {"ttl"}}
    scheme = parts.scheme or parts.path  # "memory" has no "://"
    if scheme not in known:
        raise KVMemError(f"unknown store tier {spec!r}; use memory, disk:///path, redis://host:port/db or "
                         f"redis+cluster://host:port,host:port,...")
    if scheme in ("memory", "disk", "redis+cluster") and (unknown := set(options) - known[scheme]):
        raise KVMemError(f"store tier {spec!r}: unknown option(s) {sorted(unknown)}; {scheme} takes {sorted(known[scheme])}")
    if scheme == "memory":
        return MemoryTier(parse_bytes(options["max"]) if "max" in options else 2**30)
    if scheme == "disk":
        if not parts.path:
            raise KVMemError(f"store tier {spec!r} names no folder (disk:///absolute/path)")
        return DiskTier(parts.path, parse_bytes(options["max"]) if "max" in options else None,
                        options.get("readonly", "0").lower() in ("1", "true", "yes"))
    ttl = options.pop("ttl", None)
    if scheme == "redis+cluster":
        if parts.path not in ("", "/", "/0"):
            raise KVMemError(f"store tier {spec!r}: a Redis Cluster has only database 0")
        nodes, username, password = _cluster_nodes(spec, parts.netloc)
        return RedisClusterTier(nodes, int(ttl) if ttl else None, username=username, password=password)
    url = urlunsplit((parts.scheme, parts.netloc, parts.path, "&".join(f"{k}={v}" for k, v in options.items()), ""))
    return RedisTier(url, int(ttl) if ttl else None)


def _cluster_nodes(spec: str, netloc: str) -> tuple[list[tuple[str, int]], str | None, str | None]:
    """The startup nodes and credentials of `redis+cluster://[user:password@]host:port,host:port,...`."""
    from urllib.parse import unquote

    credentials, _, hosts = netloc.rpartition("@")
    username, _, password = credentials.partition(":") if credentials else ("", "", "")
    nodes = []
    for node in hosts.split(","):
        host, _, port = node.strip().rpartition(":")
        if not host or not port.isdigit():
            raise KVMemError(f"store tier {spec!r}: {node.strip()!r} is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    return nodes, unquote(username) or None, unquote(password) or None


def _split_stack(spec: str) -> list[str]:
    """The tier specs of a stack spec: split at commas, except those between a redis+cluster tier's nodes."""
    out: list[str] = []
    for piece in spec.split(","):
        in_cluster = bool(out) and out[-1].strip().startswith("redis+cluster://") and "?" not in out[-1]
        if in_cluster and "://" not in piece and piece.strip().split("?")[0] not in ("", "memory"):
            out[-1] += "," + piece  # another node of the cluster
        else:
            out.append(piece)
    return out


def parse_stack(spec: str) -> list[Tier]:
    """Tiers fastest first from `memory,disk:///path,redis://...` (or `...,redis+cluster://h:p,h:p,...`)."""
    tiers = [parse_tier(s) for s in _split_stack(spec) if s.strip()]
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


class LocalRedisCluster:
    """A Redis Cluster of our own: `nodes` redis-server processes on free loopback ports, no persistence, no
    replicas, every slot covered (tests and benchmarks). `kill(i)` / `restart(i)` stop node i and start it again on
    the same port and cluster config file, so it rejoins with its slots (and without its data):

        with LocalRedisCluster() as cluster:
            store = ChunkStore(f"memory,{cluster.url}")
    """

    def __init__(self, nodes: int = 3, node_timeout_ms: int = 5000):
        import shutil
        import socket

        if nodes < 3:
            raise KVMemError(f"a Redis Cluster needs at least 3 primaries, got {nodes}")
        self.binary, self.cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if self.binary is None or self.cli is None:
            raise KVMemError("redis-server or redis-cli is not installed (`make redis` installs Debian's package)")
        # a client port and a cluster bus port per node, all held open together so that none is handed out twice
        socks = [socket.socket() for _ in range(2 * nodes)]
        try:
            for s in socks:
                s.bind(("127.0.0.1", 0))
            ports = [s.getsockname()[1] for s in socks]
        finally:
            for s in socks:
                s.close()
        self.ports, self.bus_ports = ports[:nodes], ports[nodes:]
        self.node_timeout_ms = node_timeout_ms
        self.url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)
        self.dir: str | None = None
        self.procs: list = [None] * nodes

    def _spawn(self, i: int) -> None:
        import subprocess

        port = self.ports[i]
        # cluster-require-full-coverage no: with a node down (and no replica to take over) the others keep serving
        # their own slots instead of refusing every key
        self.procs[i] = subprocess.Popen(
            [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
             "--cluster-port", str(self.bus_ports[i]), "--cluster-node-timeout", str(self.node_timeout_ms),
             "--cluster-require-full-coverage", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def keys_per_node(self) -> list[int]:
        """How many keys each node holds (DBSIZE), in node order; 0 for a node that is down."""
        out = []
        for i in range(len(self.ports)):
            try:
                with self._client(i) as r:
                    out.append(r.dbsize())
            except Exception:  # noqa: BLE001 - a killed node holds nothing we can count
                out.append(0)
        return out

    def _client(self, i: int):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.ports[i], socket_timeout=1.0, socket_connect_timeout=1.0)

    def _wait(self, i: int, ready, what: str, seconds: float = 20.0) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                with self._client(i) as r:
                    if ready(r):
                        return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if self.procs[i] is not None and self.procs[i].poll() is not None:
                raise KVMemError(f"redis cluster node 127.0.0.1:{self.ports[i]} exited with status "
                                 f"{self.procs[i].returncode}")
            time.sleep(0.05)
        raise KVMemError(f"redis cluster node 127.0.0.1:{self.ports[i]} {what} within {seconds:g} s")

    def _wait_ok(self, i: int) -> None:
        self._wait(i, lambda r: r.cluster("INFO").get("cluster_state") == "ok", "did not report cluster_state:ok")

    def wait_agreed(self, seconds: float = 30.0) -> None:
        """Return once every node reports cluster_state:ok and sees every other node connected and not failed (after
        a restart the others may still flag the node `fail?`/`fail`, or have no link to it, for a while)."""
        def agreed(r) -> bool:
            if r.cluster("INFO").get("cluster_state") != "ok":
                return False
            nodes = r.execute_command("CLUSTER NODES").values()  # redis-py parses it: one dict per node
            return len(nodes) == len(self.ports) and all("fail" not in n["flags"] and n["connected"] for n in nodes)

        for i in range(len(self.ports)):
            self._wait(i, agreed, "did not see every node connected and not failed", seconds)

    def start(self) -> LocalRedisCluster:
        import subprocess

        self.dir = tempfile.mkdtemp(prefix="kvmem-redis-cluster-")
        try:
            for i in range(len(self.ports)):
                self._spawn(i)
            for i in range(len(self.ports)):
                self._wait(i, lambda r: r.ping(), "did not start")
            create = [self.cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports), "--cluster-replicas",
                      "0", "--cluster-yes"]
            done = subprocess.run(create, capture_output=True, text=True, timeout=60)
            if done.returncode != 0:
                raise KVMemError(f"redis-cli --cluster create failed: {(done.stdout + done.stderr).strip()[-500:]}")
            self.wait_agreed()
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, node: int) -> None:
        """Stop node `node` at once (SIGKILL: no goodbye to the cluster, as a crash)."""
        proc, self.procs[node] = self.procs[node], None
        if proc is not None:
            proc.kill()
            proc.wait()

    def restart(self, node: int) -> None:
        """Start a killed node again on its port and config file; returns once it says cluster_state:ok (a restarted
        primary waits about 2 s before it serves, so that the cluster can reconfigure it first) and every node sees it
        connected and not failed."""
        self.kill(node)
        self._spawn(node)
        self._wait_ok(node)
        self.wait_agreed()

    def stop(self) -> None:
        import shutil

        for i in range(len(self.procs)):
            self.kill(i)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
