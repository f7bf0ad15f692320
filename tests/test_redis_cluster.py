"""The Redis Cluster tier on a real three-node cluster (`redis_cluster` in conftest): round trips, chunks spread over
the nodes, answers on SmolLM2 identical with and without the store, a node killed in the middle of a request (its
chunks are misses and skipped writes, the other nodes keep serving, nothing raises) and the tier working again once
the node is back; `kvmem serve` takes the spec."""

from __future__ import annotations

import time
import warnings

import httpx2 as httpx
import pytest
import redis
from hypothesis import HealthCheck, given, settings

from kvmem.errors import KVMemError
from kvmem.generate import answer
from kvmem.prompts import build_prompt
from kvmem.serve.local import LocalServer
from kvmem.store import ChunkStore, StoreWarning
from kvmem.store.store import READ_AHEAD
from kvmem.store.tiers import MemoryTier, NodeDown, RedisClusterTier, Tier, parse_stack
from test_store import OPS, apply_store_ops

CONTEXT = ("The lighthouse keeper of Port Elin writes in her log every evening. On Monday the fog came in early and "
           "the ferry stayed in the harbour. On Tuesday a fishing boat brought news that the north pier had cracked. "
           "The keeper's spare key is hidden under the blue flowerpot by the door.")
QUESTION = "Where is the spare key hidden?"
CHUNK = 8  # small chunks: a short prompt still has enough of them to reach every node


def flush(cluster) -> None:
    for port in cluster.ports:
        redis.Redis(host="127.0.0.1", port=port).flushall()


def warm_reuse(lm) -> int:
    """Tokens a second run of the same prompt loads: every full chunk short of the last token (computed for its
    logits)."""
    return (len(build_prompt(lm.tokenizer, CONTEXT, QUESTION).ids) - 1) // CHUNK * CHUNK


def tier_of(cluster, retry_s: float = 0.5) -> RedisClusterTier:
    (tier,) = parse_stack(cluster.url)
    tier.retry_s = retry_s  # short, so that the test sees the node tried again soon after it is back
    return tier


def test_round_trip_ttl_and_specs(redis_cluster, tmp_path):
    tier = parse_stack(redis_cluster.url + "?ttl=100")[0]
    assert isinstance(tier, RedisClusterTier) and tier.ttl == 100 and len(tier.nodes) == 3
    key, blob = "ab" * 16, bytes(range(256)) * 40
    assert tier.put(key, blob) == "ok" and tier.get(key) == blob
    assert 0 < tier.client().ttl(f"kvmem:{key}") <= 100
    tier.delete(key)
    assert tier.get(key) is None
    # the commas between the cluster's nodes are not tier separators
    stack = parse_stack(f"memory,{redis_cluster.url}?ttl=5,disk://{tmp_path}")
    assert [t.name.split(":")[0] for t in stack] == ["memory", "redis+cluster", "disk"] and len(stack[1].nodes) == 3
    for spec, match in (("redis+cluster://127.0.0.1", "not host:port"), ("redis+cluster://h:1?max=2", "unknown option"),
                        ("redis+cluster://h:1/3", "only database 0"), ("ftp://x", "redis\\+cluster://")):
        with pytest.raises(KVMemError, match=match):
            parse_stack(spec)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_any_sequence_of_operations_returns_the_bytes_put_or_a_miss(redis_cluster, ops):
    flush(redis_cluster)
    memory = MemoryTier(max_bytes=5000)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StoreWarning)  # nothing fails on a healthy cluster, which keeps every write
        apply_store_ops(ChunkStore([memory, tier_of(redis_cluster)]), memory, ops, every_write_kept=True)


def test_unreachable_cluster_degrades_to_recompute(smollm2):
    store = ChunkStore("redis+cluster://127.0.0.1:1,127.0.0.1:2", chunk_size=CHUNK)  # nothing listens there
    with pytest.warns(StoreWarning, match="failed"):
        a = answer(smollm2, CONTEXT, QUESTION, max_new_tokens=8, store=store)
    assert a.reuse.reused_tokens == 0 and store.stats["unavailable"] >= 1
    assert a.text == answer(smollm2, CONTEXT, QUESTION, max_new_tokens=8).text


def test_answers_reuse_chunks_spread_over_every_node(smollm2, redis_cluster):
    flush(redis_cluster)
    plain = answer(smollm2, CONTEXT, QUESTION, max_new_tokens=8)
    store = ChunkStore(redis_cluster.url, chunk_size=CHUNK)
    first = answer(smollm2, CONTEXT, QUESTION, max_new_tokens=8, store=store)
    counts = redis_cluster.keys_per_node()
    assert all(n > 0 for n in counts), counts  # no hash tags: the chunks of one prompt land on every node
    assert sum(counts) == first.reuse.chunks_saved > 10
    other = ChunkStore(redis_cluster.url, chunk_size=CHUNK)  # another process's view: all from the cluster
    second = answer(smollm2, CONTEXT, QUESTION, max_new_tokens=8, store=other)
    assert first.reuse.reused_tokens == 0 and second.reuse.reused_tokens == warm_reuse(smollm2)
    assert set(second.reuse.tiers) == {redis_cluster.url}
    assert first.text == plain.text and second.tokens == first.tokens


class KillsANode(Tier):
    """The cluster tier, killing one node right after the first read it passes on: a failure in the middle of a
    request, between two chunks of the same prompt."""

    def __init__(self, tier: RedisClusterTier, cluster, node: int):
        self.tier, self.cluster, self.node, self.name, self.armed = tier, cluster, node, tier.name, True

    def get(self, key: str) -> bytes | None:
        blob = self.tier.get(key)
        if self.armed:
            self.armed = False
            self.cluster.kill(self.node)
        return blob

    def put(self, key: str, blob: bytes) -> str:
        return self.tier.put(key, blob)

    def delete(self, key: str) -> None:
        self.tier.delete(key)


def test_a_node_killed_mid_request_then_restarted(smollm2, redis_cluster):
    lm, cluster = smollm2, redis_cluster
    flush(cluster)
    plain = answer(lm, CONTEXT, QUESTION, max_new_tokens=8)
    prompt = build_prompt(lm.tokenizer, CONTEXT, QUESTION)
    answer(lm, CONTEXT, QUESTION, max_new_tokens=8, store=ChunkStore(cluster.url, chunk_size=CHUNK))  # fills it
    tier = tier_of(cluster)
    keys = ChunkStore([tier], chunk_size=CHUNK).keys(lm, prompt.ids)
    owners = [tier.client().get_node_from_key(f"kvmem:{k}").name for k in keys]
    loadable = warm_reuse(lm) // CHUNK  # the chunks a warm run loads
    # a node none of the first READ_AHEAD chunks is on: open_run reads those at once, so one of them could still
    # arrive after the kill that the first read triggers; any later chunk is read after it
    dead = next((o for o in owners[:loadable] if owners.index(o) >= READ_AHEAD), None)
    assert dead is not None, f"no node holds a loadable chunk past the first {READ_AHEAD} only: {owners[:loadable]}"
    node = [f"127.0.0.1:{p}" for p in cluster.ports].index(dead)
    first_dead = owners.index(dead)
    store = ChunkStore([KillsANode(tier, cluster, node)], chunk_size=CHUNK)
    try:
        t = time.perf_counter()
        with pytest.warns(StoreWarning, match=f"node {dead} failed"):
            a = answer(lm, CONTEXT, QUESTION, max_new_tokens=8, store=store)
        took = time.perf_counter() - t
        assert a.text == plain.text  # the chunks before the dead node's first one loaded, the rest recomputed
        assert a.reuse.reused_tokens == first_dead * CHUNK and store.stats["unavailable"] >= 1
        # the other nodes still serve: every chunk of theirs is a hit, every chunk of the dead node a miss
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StoreWarning)
            found = [store.get_bytes(k)[0] is not None for k in keys]
        assert found == [o != dead for o in owners]
        with pytest.raises(NodeDown, match=dead):
            tier.get(keys[first_dead])
        # a tier made while the node is down reads the slot map from the live nodes and serves their chunks
        late = tier_of(cluster)
        assert late.get(keys[0]) is not None
        cluster.restart(node)
        restarted_at = time.perf_counter()
    finally:
        if cluster.procs[node] is None:
            cluster.restart(node)
    time.sleep(max(0.0, tier.retry_s - (time.perf_counter() - restarted_at)))
    # back, without its data: its chunks are computed and written again, then everything is reused
    with warnings.catch_warnings():
        warnings.simplefilter("error", StoreWarning)  # no failure left
        b = answer(lm, CONTEXT, QUESTION, max_new_tokens=8, store=store)
        c = answer(lm, CONTEXT, QUESTION, max_new_tokens=8, store=ChunkStore([late], chunk_size=CHUNK))
    assert b.text == c.text == plain.text
    assert b.reuse.reused_tokens == a.reuse.reused_tokens and c.reuse.reused_tokens == warm_reuse(lm)
    assert cluster.keys_per_node()[node] > 0
    print(f"answer with a node killed mid-request: {took:.2f} s; unavailable {store.stats['unavailable']}")


def test_a_tier_made_while_a_node_is_down_serves_the_other_nodes(redis_cluster):
    """Node 0 owns slot 0, so redis-py's client sends its first request (COMMAND, while it is made) there."""
    cluster = redis_cluster
    flush(cluster)
    tier = tier_of(cluster)
    keys = [f"{i:02x}" * 16 for i in range(24)]
    for key in keys:
        assert tier.put(key, b"chunk") == "ok"
    dead = f"127.0.0.1:{cluster.ports[0]}"
    alive = [tier.client().get_node_from_key(f"kvmem:{k}").name != dead for k in keys]
    assert 0 < sum(alive) < len(keys)
    cluster.kill(0)
    try:
        late = tier_of(cluster)
        got = []
        for key in keys:
            try:
                got.append(late.get(key) == b"chunk")
            except NodeDown:
                got.append(False)
        assert got == alive
    finally:
        cluster.restart(0)


def test_a_slot_without_a_node_is_a_miss_until_the_slot_map_has_it_again(redis_cluster):
    """Every node forgets one slot (CLUSTER DELSLOTS): its chunk is a miss and its write skipped, the other slots
    still serve; once its owner takes it back, the tier reads the slot map again and serves it."""
    cluster = redis_cluster
    tier = tier_of(cluster, retry_s=0.2)
    store = ChunkStore([tier], chunk_size=CHUNK)
    key, other = "cd" * 16, "ef" * 16
    assert store.put_bytes(key, b"chunk") and store.put_bytes(other, b"other")
    client = tier.client()
    slot, owner = client.keyslot(f"kvmem:{key}"), client.get_node_from_key(f"kvmem:{key}")
    assert client.keyslot(f"kvmem:{other}") != slot
    nodes = [redis.Redis(host="127.0.0.1", port=p) for p in cluster.ports]
    covered = lambda r: any(a <= slot <= b for a, b, *_ in r.execute_command("CLUSTER SLOTS"))  # noqa: E731
    try:
        for r in nodes:
            r.execute_command("CLUSTER", "DELSLOTS", slot)
        with pytest.warns(StoreWarning, match="failed on read"):
            assert store.get_bytes(key) == (None, None)
        with pytest.warns(StoreWarning, match="failed on write"):
            assert not store.put_bytes(key, b"chunk")
        assert store.get_bytes(other)[0] == b"other"  # the tier is not given up: the other slots serve
    finally:
        nodes[cluster.ports.index(owner.port)].execute_command("CLUSTER", "ADDSLOTS", slot)
        deadline = time.monotonic() + 20
        while not all(covered(r) for r in nodes) and time.monotonic() < deadline:
            time.sleep(0.05)
    time.sleep(tier.retry_s)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StoreWarning)
        assert store.get_bytes(key)[0] == b"chunk"  # DELSLOTS keeps the keys; the refreshed map finds the node


def test_kvmem_serve_takes_a_cluster_store(redis_cluster, tmp_path):
    redis_cluster.wait_agreed()  # the tests before may have restarted a node or moved a slot
    flush(redis_cluster)
    log = tmp_path / "serve.log"  # the server's StoreWarnings, should a write fail
    with LocalServer(["--store", f"memory,{redis_cluster.url}", "--chunk-size", "16", "--threads", "1",
                      "--no-batching"], log=log) as server:
        health = httpx.get(server.url + "/health").json()
        assert f"ChunkStore(memory,{redis_cluster.url}," in health["store"]
        chat = {"model": "smollm2-135m", "messages": [{"role": "user", "content": CONTEXT + " " + QUESTION}],
                "temperature": 0, "max_tokens": 4}
        r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=120)
        assert r.status_code == 200, r.text
        events = [line for line in httpx.get(server.url + "/metrics").text.splitlines()
                  if line.startswith("kvmem_store_events")]
    # the server wrote its chunks to the cluster
    assert sum(redis_cluster.keys_per_node()) >= 1, f"{events}\n{log.read_text()[-3000:]}"
