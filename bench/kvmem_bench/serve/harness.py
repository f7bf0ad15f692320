"""What the served benchmarks (the load test, `serve/runner.py`, and continuous batching, `batching/runner.py`) share:
the workload's prompts (a knowledge base of shipped abstracts, questions about its documents), a `kvmem serve`
process on loopback and how to read it (health, /metrics, RSS), and one timed streaming request."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from kvmem_bench import DATA

QUESTION_TEMPLATES = (
    "What does document {i} propose?",
    "What problem does document {i} address?",
    "Name one result reported in document {i}.",
    "Which method is introduced in document {i}?",
    "What is the main claim of document {i}?",
    "Does document {i} report experiments? Answer yes or no.",
    "Summarize document {i} in a few words.",
    "Who would use the work described in document {i}?",
)

# ---------------------------------------------------------------- the prompts


def load_tokenizer(model: str):
    """The model's tokenizer alone (no weights), to size the system prompt in its tokens."""
    import torch

    from kvmem.models import load_tokenizer

    torch.set_num_threads(1)
    return load_tokenizer(model)


def knowledge_base(tokenizer, target_tokens: int = 1500, first: int = 0) -> tuple[str, int, int]:
    """(system prompt, its tokens, documents in it): whole abstracts in file order from the `first`, numbered, as
    many as bring the prompt closest to `target_tokens` (at least one)."""
    from kvmem.calibration import load_abstracts

    abstracts = list(load_abstracts())[first:]
    count = lambda t: len(tokenizer(t, add_special_tokens=False).input_ids)  # noqa: E731
    text = ("You are a research assistant. Answer the user's question briefly, using only the documents of this "
            "knowledge base.")
    best = None
    for i, abstract in enumerate(abstracts, 1):
        text += f"\n\n[Document {i}]\n{abstract}"
        n = count(text)
        if best is None or abs(n - target_tokens) < abs(best[1] - target_tokens):
            best = (text, n, i)
        if n >= target_tokens:
            break
    return best


def question_list(n_docs: int) -> list[str]:
    """The user questions, in the order requests take them: each template about each document, then each
    hand-written description of an abstract (`data/questions.txt`) as "which document ...?"."""
    out = [t.format(i=i) for t in QUESTION_TEMPLATES for i in range(1, n_docs + 1)]
    for line in (DATA / "questions.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#") and "\t" in line:
            out.append(f"Which document, if any, is about this: {line.split(chr(9), 1)[1].strip()}?")
    return out


def question(k: int, questions: list[str]) -> str:
    """The k-th request's question: every request of a phase asks a different one."""
    q = questions[k % len(questions)]
    return q if k < len(questions) else f"{q} (request {k})"


# ---------------------------------------------------------------- the server process


def tree_rss_kib(pid: int) -> int | None:
    """VmRSS of `pid` and its descendants (several workers are child processes), KiB; None once it is gone."""
    total, seen, todo = 0, set(), [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            if p == pid:
                return None
    return total


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


def parse_prometheus(text: str) -> dict[str, float]:
    """`name{labels}` -> value of each sample line of a Prometheus text exposition."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "}" in line:  # the value follows the labels' closing brace
            cut = line.rindex("}") + 1
            name, rest = line[:cut], line[cut:]
        else:
            name, _, rest = line.partition(" ")
        try:
            out[name.strip()] = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
    return out


def scrape_metrics(base: str) -> dict:
    """/metrics as parsed samples (and the HTTP status), or the error that prevented it."""
    try:
        status, text = get(f"{base}/metrics")
    except OSError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"status": status, "values": parse_prometheus(text) if status == 200 else {}, "bytes": len(text)}


@contextmanager
def serving(model: str, store: str | None, log_path: Path, threads: int = 1, workers: int = 1, queue: int = 16,
            timeout: float = 120, health_timeout_s: float = 600) -> Iterator[dict]:
    """`kvmem serve` on a free loopback port (`kvmem.serve.local.LocalServer`), until /health answers 200; yields
    its description (command, pid, base URL, health body). Stopped on the way out, whatever happened."""
    from kvmem.serve.local import LocalServer

    args = ["--workers", str(workers), "--queue", str(queue), "--threads", str(threads), "--timeout", f"{timeout:g}"]
    args += ["--store", store] if store else []
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.unlink(missing_ok=True)
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.monotonic()
    with LocalServer(args, model, log_path, health_timeout_s, env) as server:
        health = json.loads(get(f"{server.url}/health")[1])
        served = [m["id"] for m in json.loads(get(f"{server.url}/v1/models")[1])["data"]]
        yield dict(argv=server.argv, command=server.command, pid=server.pid, port=server.port, base=server.url,
                   health=health, ready_s=round(time.monotonic() - t0, 2), served_models=served, log=log_path.name)


# ---------------------------------------------------------------- the clients


async def one_request(client, model: str, system: str, user: str, max_tokens: int, options: dict,
                      token_times: bool = False, until: float | None = None, rec: dict | None = None,
                      extra_body: dict | None = None) -> dict:
    """One streaming chat completion, timed (with `token_times`, every content chunk's arrival too, `chunk_s`).
    At `until` (a `time.perf_counter()` instant) the stream is closed, status "cut". Never raises: a failure is the
    record's status and error. `rec`: the dict to fill (a caller that cancels the request keeps what arrived).
    `extra_body` replaces `{"kvmem": options}` (another server's own parameters)."""
    import openai

    rec = rec if rec is not None else {}
    rec |= dict(status="ok", error=None, ttft_s=None, latency_s=None, prompt_tokens=None, completion_tokens=None,
               cached_tokens=None, finish_reason=None, text="", retry_after_s=None)
    parts = []
    t0 = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
            stream=True, stream_options={"include_usage": True}, temperature=0, max_tokens=max_tokens,
            extra_body=extra_body if extra_body is not None else {"kvmem": options})
        async for chunk in stream:
            if until is not None and time.perf_counter() > until:
                rec["status"], rec["completion_tokens"] = "cut", len(rec.get("chunk_s", parts))
                await stream.close()
                break
            for choice in chunk.choices or []:
                if choice.delta is not None and choice.delta.content:
                    if rec["ttft_s"] is None:
                        rec["ttft_s"] = time.perf_counter() - t0
                    if token_times:
                        rec.setdefault("chunk_s", []).append(round(time.perf_counter() - t0, 4))
                    parts.append(choice.delta.content)
                if choice.finish_reason:
                    rec["finish_reason"] = choice.finish_reason
            if chunk.usage is not None:
                rec["prompt_tokens"], rec["completion_tokens"] = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
                details = chunk.usage.prompt_tokens_details
                rec["cached_tokens"] = getattr(details, "cached_tokens", None) if details is not None else None
        if rec["status"] == "cut":
            pass
        elif rec["ttft_s"] is None:
            rec["status"], rec["error"] = "error", "the stream ended without a content chunk"
        elif rec["completion_tokens"] is None:
            rec["status"], rec["error"] = "error", "the stream ended without a usage chunk"
    except openai.RateLimitError as e:
        rec["status"], rec["error"] = "429", _status_message(e)
        try:
            rec["retry_after_s"] = float(e.response.headers.get("retry-after"))
        except (TypeError, ValueError):
            rec["retry_after_s"] = None
    except openai.APIStatusError as e:
        rec["status"], rec["error"] = "error", _status_message(e)
    except Exception as e:  # noqa: BLE001 - connection, timeout, a broken stream: the record says which
        rec["status"], rec["error"] = "error", f"{type(e).__name__}: {e}"[:500]
    rec["latency_s"] = time.perf_counter() - t0
    rec["text"] = "".join(parts)
    return rec


def _status_message(e) -> str:
    try:
        body = e.response.text
    except Exception:  # noqa: BLE001 - a streamed body may not be readable any more
        body = str(e)
    return f"HTTP {e.status_code}: {body}"[:500]
