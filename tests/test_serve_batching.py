"""`kvmem serve` with continuous batching (`kvmem.serve.scheduler`), end to end: real servers on loopback, the
official openai client. Requests join and leave a running batch with mixed methods and give the answers they give
alone; a cancelled row leaves the others alone; admission is by KV bytes (queue, 429, a request too large for the
budget); rows past the budget are preempted to disk and resume with the same answer; memory returns to zero."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx2 as httpx
import openai
import pytest

from kvmem.prompts import chat_prompt
from kvmem.serve.local import LocalServer
from test_serve import metric, system_prompt, wait_idle

MODEL = "smollm2-135m"


def count(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Count from {i} to {i + 30}, one number per line."}]


def ask(server, messages, max_tokens: int, kvmem: dict | None = None, model: str = MODEL, **kw):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    return client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens,
                                          extra_body={"kvmem": kvmem} if kvmem else None, **kw)


def together(server, calls: list, stagger_s: float = 0.4) -> tuple[list, int]:
    """Run `calls` concurrently, one started every `stagger_s` (so they join a running batch); their results, and
    the most rows the server decoded at once (sampled from /metrics while they ran)."""
    results, most, done = [None] * len(calls), [0], threading.Event()

    def run(i):
        time.sleep(i * stagger_s)
        try:
            results[i] = calls[i]()
        except Exception as e:  # noqa: BLE001 - the test reads it
            results[i] = e

    def watch(server_url):
        while not done.is_set():
            text = httpx.get(server_url + "/metrics").text
            rows = [float(line.split()[-1]) for line in text.splitlines() if line.startswith("kvmem_batch_rows ")]
            most[0] = max(most[0], int(rows[0]) if rows else 0)
            time.sleep(0.05)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    watcher = threading.Thread(target=watch, args=(server.url,))
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watcher.join()
    return results, most[0]


@pytest.fixture(scope="module")
def server():
    with LocalServer(["--threads", "1", "--kv-budget", "1GiB", "--max-n", "2"]) as s:
        yield s


MIXED = [{"method": "full"}, {"method": "snapkv", "keep_ratio": 0.5}, {"method": "knorm:budget=adaptive", "keep_ratio": 0.5},
         {"method": "full", "quant": "kivi-4"}, {"method": "h2o", "keep_ratio": 0.25, "quant": "kivi-2"}]


def test_requests_join_and_leave_the_batch_and_answer_as_alone(server):
    """Five requests with different methods, quantization and lengths, started 0.4 s apart (each joins a running
    batch) and ending at different steps: each answer is the one it gets alone, token for token."""
    wait_idle(server)
    system = {"role": "system", "content": system_prompt(2)}
    messages = [[system, *count(i)] for i in range(len(MIXED))]
    lengths = [40, 25, 60, 30, 45]
    alone = [ask(server, m, n, o).choices[0].message.content for m, n, o in zip(messages, lengths, MIXED)]
    results, most = together(server, [lambda m=m, n=n, o=o: ask(server, m, n, o) for m, n, o in zip(messages, lengths, MIXED)])
    assert [r.choices[0].message.content for r in results] == alone
    assert most >= 3  # they really ran together
    wait_idle(server)
    assert metric(server, "kvmem_kv_bytes_held") == 0 and metric(server, "kvmem_batch_rows") == 0


def test_cancelling_one_row_leaves_the_others_decoding(server):
    wait_idle(server)
    cancelled = metric(server, "kvmem_cancelled_requests_total")
    alone = ask(server, count(3), 50).choices[0].message.content
    long = {"model": MODEL, "messages": count(7), "max_tokens": 3000, "temperature": 0, "stream": True,
            "kvmem": {"ignore_eos": True}}
    other = [None]
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=long, timeout=60) as r:
        lines = r.iter_lines()
        assert sum(1 for line, _ in zip(lines, range(8)) if line.startswith("data:")) >= 3
        t = threading.Thread(target=lambda: other.__setitem__(0, ask(server, count(3), 50)))
        t.start()
        time.sleep(1.0)  # the second request has joined the first's batch
    t.join()  # the long one was closed mid-batch; the other goes on
    assert other[0].choices[0].message.content == alone
    wait_idle(server, 10)
    assert metric(server, "kvmem_cancelled_requests_total") == cancelled + 1
    assert metric(server, "kvmem_kv_bytes_held") == 0


def test_embeddings_run_between_the_batchs_steps(server):
    """Embeddings run on the model's thread between two decode steps: asked while rows decode, they equal those
    asked on an idle server, and the rows' answers are unchanged."""
    wait_idle(server)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    texts = ["A cat sat on the mat.", "Stocks fell sharply on Monday."]
    idle = [d.embedding for d in client.embeddings.create(model=MODEL, input=texts, encoding_format="float").data]
    # the first row decodes 160 tokens whatever it says: still running when the second joins and the embeddings come
    first = {"ignore_eos": True}
    alone = ask(server, count(2), 160, first).choices[0].message.content
    results, most = together(server, [lambda: ask(server, count(2), 160, first), lambda: ask(server, count(4), 60),
                                      lambda: client.embeddings.create(model=MODEL, input=texts, encoding_format="float")],
                             stagger_s=1.0)
    assert results[0].choices[0].message.content == alone
    assert most >= 2
    busy = [d.embedding for d in results[2].data]
    assert max(abs(a - b) for u, v in zip(idle, busy) for a, b in zip(u, v)) < 1e-5


def test_the_server_process_holds_one_openmp_team():
    """Only the model's thread may hold an OpenMP team: while a second one exists, even idle, every team's threads
    wait in the kernel between parallel regions and a decode step ran ~1.7x slower (`models.on_passing_thread`).
    A team of two threads adds one native thread, so the count of native threads shows where teams were made."""
    code = """
import os, threading, time, torch
torch.set_num_threads(2)
from kvmem.models import load_model
from kvmem.serve.scheduler import Scheduler
def native():
    time.sleep(0.3)  # a team's threads leave a moment after their owner
    return len(os.listdir("/proc/self/task")) - threading.active_count()
start = native()
scheduler = Scheduler(load_model("smollm2-135m"), kv_budget=2**30)  # loads and measures a probe prefill
ready = native()
torch.randn(512, 512) @ torch.randn(512, 512)  # a team on the main thread: the count must see it
print(start, ready, native())
scheduler.close()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    start, ready, main_team = map(int, out.stdout.split())
    assert ready == start and main_team == start + 1


def test_n_choices_are_rows_of_one_batch(server):
    one = ask(server, count(1), 20).choices[0].message.content
    two = ask(server, count(1), 20, n=2)
    assert [c.message.content for c in two.choices] == [one, one]
    kw = dict(messages=[{"role": "user", "content": "Write a sentence about the sea."}], max_tokens=16)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    a = client.chat.completions.create(model=MODEL, temperature=1.2, seed=5, n=2, **kw)
    b = client.chat.completions.create(model=MODEL, temperature=1.2, seed=5, n=2, **kw)
    first = client.chat.completions.create(model=MODEL, temperature=1.2, seed=5, **kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.content == first.choices[0].message.content  # choice i samples with seed + i


def kv_bytes_per_token(lm) -> int:
    from kvmem.cache import KVCache
    from kvmem.forward import feed

    cache = KVCache(lm.model.config, observe_window=0)
    feed(lm, cache, list(range(64)))
    return cache.kv_bytes() // 64


def test_admission_by_kv_bytes_queue_429_and_a_request_too_large(smollm2):
    """A budget that holds one long uncompressed request: a second waits for it (the queue of one is then full, so
    a third gets 429), and once kvmem knows what snapkv@0.25 keeps, a compressed request of the same length runs
    beside the uncompressed one; a request that could not fit even alone gets 400."""
    per_token = kv_bytes_per_token(smollm2)
    messages = [{"role": "system", "content": system_prompt(2)}, *count(1)]
    tokens = len(chat_prompt(smollm2.tokenizer, messages).ids)
    budget = int(1.6 * tokens * per_token)
    with LocalServer(["--threads", "1", "--kv-budget", f"{budget}B", "--queue", "1"]) as server:
        compressed = {"method": "snapkv", "keep_ratio": 0.25}
        ask(server, messages, 4, compressed)  # the server measures what this configuration keeps
        long = dict(max_tokens=40, kvmem={"ignore_eos": True})
        results, most = together(server, [lambda: ask(server, messages, **long), lambda: ask(server, messages, **long),
                                  lambda: ask(server, messages, 4)], stagger_s=0.5)
        assert [type(r) for r in results[:2]] == [openai.types.chat.ChatCompletion] * 2
        assert isinstance(results[2], openai.RateLimitError) and "retry in" in str(results[2])
        assert int(results[2].response.headers["retry-after"]) >= 1
        assert most == 1  # the two uncompressed requests never ran together
        results, most = together(server, [lambda: ask(server, messages, **long),
                                  lambda: ask(server, messages, 40, compressed | {"ignore_eos": True})], stagger_s=0.5)
        assert all(r.usage.completion_tokens == 40 for r in results) and most == 2
        big = [{"role": "system", "content": system_prompt(6)}, *count(1)]
        with pytest.raises(openai.BadRequestError, match="kv-budget"):
            ask(server, big, 4)
        ask(server, big, 4, {"method": "snapkv", "keep_ratio": 0.1})  # compressed, it fits


def test_preemption_swaps_the_newest_row_to_disk_and_resumes_it(smollm2):
    """Two requests fit the budget when admitted; their growth while decoding does not: the newer is swapped out,
    resumes when the older ends, and both answers are those they get alone."""
    from kvmem.generate import prepare

    prompts = [[{"role": "system", "content": system_prompt(1)}, *count(i)] for i in (1, 2)]
    prefilled = sum(prepare(smollm2, chat_prompt(smollm2.tokenizer, m)).cache.kv_bytes() for m in prompts)
    budget = prefilled + 32 * kv_bytes_per_token(smollm2)  # both prefills, not the 65 rows a full buffer grows by
    with LocalServer(["--threads", "1", "--kv-budget", f"{budget}B"]) as server:
        alone = [ask(server, m, 80, {"ignore_eos": True}).choices[0].message.content for m in prompts]
        results, _ = together(server, [lambda m=m: ask(server, m, 80, {"ignore_eos": True}) for m in prompts], stagger_s=0.3)
        assert [r.choices[0].message.content for r in results] == alone
        assert metric(server, "kvmem_preemptions") >= 1
        wait_idle(server)
        assert metric(server, "kvmem_swapped_rows") == 0 and metric(server, "kvmem_kv_bytes_held") == 0


def test_an_offloaded_row_is_never_swapped_out(smollm2):
    """An offloaded cache (sparq) is not exported, so it cannot go to disk: when the budget is exceeded with it as the
    newest row, it stays (no other row can go: the oldest always runs) and both answer as they do alone, where
    swapping it used to fail every running request."""
    from kvmem.generate import prepare

    prompts = [[{"role": "system", "content": system_prompt(1)}, *count(i)] for i in (1, 2)]
    options = [{"ignore_eos": True}, {"ignore_eos": True, "method": "sparq", "keep_ratio": 0.25}]
    full, second = (prepare(smollm2, chat_prompt(smollm2.tokenizer, m)).cache.kv_bytes() for m in prompts)
    # both admitted (the full row with its first 64 spare rows, the second's estimate: about its full bytes x its keep
    # ratio); the full row's next 64 rows (its 65th token) exceed it
    budget = full + int(0.3 * second) + 80 * kv_bytes_per_token(smollm2)
    with LocalServer(["--threads", "1", "--kv-budget", f"{budget}B"]) as server:
        alone = [ask(server, m, 90, o).choices[0].message.content for m, o in zip(prompts, options)]
        results, most = together(server, [lambda m=m, o=o: ask(server, m, 90, o) for m, o in zip(prompts, options)])
        assert [r.choices[0].message.content for r in results] == alone and most == 2
        assert metric(server, "kvmem_preemptions") == 0


def test_gemma_rows_answer_as_alone_in_the_batch():
    """Gemma-3 (sliding and global layers): concurrent requests with different methods answer as they do alone."""
    system = {"role": "system", "content": system_prompt(2)}
    options = [{"method": "full"}, {"method": "keydiff", "keep_ratio": 0.5}, {"method": "full", "quant": "kivi-4"}]
    with LocalServer(["--threads", "1", "--kv-budget", "1GiB"], model="gemma3-270m") as server:
        messages = [[system, *count(i)] for i in range(len(options))]
        alone = [ask(server, m, 24, o, model="gemma3-270m").choices[0].message.content for m, o in zip(messages, options)]
        results, most = together(server, [lambda m=m, o=o: ask(server, m, 24, o, model="gemma3-270m")
                                  for m, o in zip(messages, options)])
        assert [r.choices[0].message.content for r in results] == alone and most >= 2
