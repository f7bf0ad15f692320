"""kvpress's side of the race, the part that touches kvpress: its presses by kvmem's names, and one sample's
prefill with every press's scores, KVzip's replay, and the answers decoded from each press's cache (see
`kvpress_runner.py`, which runs this under `.venv-race`; nothing here imports kvmem)."""

from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import dataclass, field, fields

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from the hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
)

# Importing kvpress patches transformers' attention functions so that masked_key_indices mask keys.
from kvpress import (  # noqa: E402
    AdaKVPress,
    ExpectedAttentionPress,
    FinchPress,
    KeyDiffPress,
    KnormPress,
    KVzipPress,
    ObservedAttentionPress,
    PyramidKVPress,
    RandomPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)
from kvpress.presses import base_press  # noqa: E402
from kvpress.presses.base_press import is_prefilling  # noqa: E402
from kvpress.utils import extract_keys_and_values  # noqa: E402

transformers.utils.logging.disable_progress_bar()
# kvpress skips Gemma-3's sliding-window layers only for Gemma3ForConditionalGeneration (see the docstring):
# its check, `isinstance(model, Gemma3ForConditionalGeneration)`, now also matches our Gemma3ForCausalLM.
base_press.Gemma3ForConditionalGeneration = (Gemma3ForConditionalGeneration, Gemma3ForCausalLM)

PRESSES = {
    "random": RandomPress,
    "streaming-llm": StreamingLLMPress,
    "snapkv": SnapKVPress,
    "tova": TOVAPress,
    "knorm": KnormPress,
    "observed-attention": ObservedAttentionPress,
    "expected-attention": ExpectedAttentionPress,
    "ada-expected-attention": lambda compression_ratio: AdaKVPress(ExpectedAttentionPress(compression_ratio)),
    "keydiff": KeyDiffPress,
    "pyramidkv": PyramidKVPress,
    "kvzip": KVzipPress,
    # kvmem's finch: FinchPress with its query set as kvmem's (`make_press`), normalised scores (both defaults) and
    # the kept keys left at their positions, as kvmem keeps them (rerotate_keys=False; its default moves them to
    # consecutive positions). chunk_length stays None (one ranking over the context): FinchPress's chunk_length
    # is not Finch's chunked reading but a quota, each 512-token block keeping exactly its share of one pass's
    # scores, where kvmem's 512-token chunks only cap what the blocks read so far may hold and the rows then
    # compete: kvmem's kept rows agree far better with FinchPress's without chunks (README, the race). A short last
    # block also evicts query rows (it keeps its share, window or not).
    "finch": lambda compression_ratio: FinchPress(compression_ratio, normalize_scores=True, rerotate_keys=False),
}
# Presses whose score() does not read compression_ratio: one score per layer serves all their ratios.
RATIO_FREE_SCORES = (SnapKVPress, TOVAPress, KnormPress, KeyDiffPress, ObservedAttentionPress, ExpectedAttentionPress,
                     FinchPress)
EAGER = {"observed-attention"}  # needs attention weights: kvpress requires attn_implementation="eager"
RATIOS = (0.5, 0.25, 0.1)


@dataclass(eq=False)
class Job:
    """One (method, keep ratio) on one sample: its press and, once run, its cache and answer."""

    method: str
    keep_ratio: float
    press: object = None  # None: the full cache
    kv: list = field(default_factory=list)  # per layer (keys, values) as kvpress's cache holds them
    masks: list = field(default_factory=list)  # per layer masked_key_indices (head-wise presses) or None
    prefill_s: float = 0.0
    press_s: float = 0.0
    answer_s: float = 0.0
    tokens: list | None = None
    error: str | None = None

    @property
    def eager(self) -> bool:
        return self.method in EAGER


def make_press(method: str, keep_ratio: float, s: dict):
    """kvpress's press for `method` at `keep_ratio`, set up for sample `s`.

    FinchPress takes as its query the tokens after a delimiter token that its embedding hook finds and drops
    (kvpress's evaluation appends the delimiter and the question to the context). The harness calls the press's
    compress() itself, so it sets the window that hook would find: the last s["query_window"] tokens of the
    context, which the exporter sets to the question's tokens (aware) or to kvmem finch's stand-in for a question
    (agnostic: the context's last 32 tokens). The check (`kvpress_runner.check`) runs kvpress's own flow with the
    delimiter and compares."""
    press = PRESSES[method](compression_ratio=1 - keep_ratio)
    if isinstance(press, FinchPress):
        window = s.get("query_window")
        if not isinstance(window, int) or not 0 < window < len(s["context_ids"]):
            raise ValueError(f"finch needs the sample's query_window, the context's last tokens it reads as the query, "
                             f"between 1 and {len(s['context_ids']) - 1}; sample {s.get('sample')} of {s.get('task')} has "
                             f"{window!r}: export the tasks again (`kvmem race` does)")
        press.window_size = window
    return press


def make_jobs(methods: list[str], ratios: list[float], s: dict) -> list[Job]:
    jobs = [Job("full", 1.0)]
    return jobs + [Job(m, k, make_press(m, k, s)) for m in methods for k in ratios]


def held_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a view holds its whole storage)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def normalize(text: str) -> str:
    return " ".join(text.casefold().split())


_NEWLINES: dict[int, set[int]] = {}


def newline_ids(tok) -> set[int]:
    if id(tok) not in _NEWLINES:
        _NEWLINES[id(tok)] = {i for t, i in tok.get_vocab().items() if "\n" in tok.convert_tokens_to_string([t])}
    return _NEWLINES[id(tok)]


@torch.no_grad()
def decode(model, tok, cache, s: dict, batch: int) -> list[list[int]]:
    """Feed the question on top of `cache` (`batch` identical rows) and decode greedily by the shared rule."""
    question = torch.tensor([s["question_ids"]] * batch)
    position = len(s["context_ids"])  # as kvpress: positions continue after the original context
    # one forward for the question, as kvpress's pipeline, unless transformers would mask it wrongly (short_layers)
    pieces = question.split(1, dim=1) if short_layers(model, cache) else (question,)
    for piece in pieces:
        positions = torch.arange(position, position + piece.shape[1]).expand(batch, -1)
        logits = model(input_ids=piece, past_key_values=cache, position_ids=positions, logits_to_keep=1).logits[:, -1]
        position += piece.shape[1]
    ends, newlines, answers = set(s["eos_ids"]), newline_ids(tok), [normalize(a) for a in s["answers"]]
    outs, done = [[] for _ in range(batch)], [False] * batch
    for _ in range(s["max_new_tokens"]):
        next_ids = logits.argmax(-1)
        for b, token in enumerate(next_ids.tolist()):
            if done[b]:
                continue
            if token in ends or (s.get("one_line", True) and token in newlines
                                 and any(c.isalnum() for c in tok.decode(outs[b]))):
                done[b] = True
                continue
            outs[b].append(token)
            text = normalize(tok.decode(outs[b]))
            done[b] = (bool(answers) and all(a in text for a in answers)) or len(outs[b]) == s["max_new_tokens"] \
                or position >= model.config.max_position_embeddings  # the model's context is full
        if all(done):
            break
        step = torch.full((batch, 1), position)
        logits = model(input_ids=next_ids[:, None], past_key_values=cache, position_ids=step).logits[:, -1]
        position += 1
    return outs


def short_layers(model, cache) -> bool:
    """Does a full-attention layer hold other than the cache's sequence length in rows? transformers 5.2 takes a
    forward's query positions from that length and sizes each layer type's mask from one layer, so a multi-token
    forward is then masked wrongly: not causally on Gemma-3, whose compressed global layers sit beside whole
    sliding windows (every question token sees every later one: changing only the question's last token moves
    its first tokens' logits by up to 9.8, `results/race/question-mask-check.py`), and with mismatched sizes
    under PyramidKV's per-layer budgets (it raises). A single token needs no mask, so one at a time is right."""
    sliding = [getattr(layer.self_attn, "is_sliding", False) for layer in model.model.layers]
    seen = cache.get_seq_length()
    return any(not sl and layer.keys.shape[-2] != seen for sl, layer in zip(sliding, cache.layers))


def new_cache(model) -> DynamicCache:
    """The pipeline's DynamicCache(); Gemma-3 needs the model's config (sliding-window layers, see above)."""
    return DynamicCache(config=model.config) if getattr(model.config, "sliding_window", None) else DynamicCache()


def attention_modules(model) -> list:
    language_model = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return [layer.self_attn for layer in language_model.layers]


def clear_masks(model) -> None:
    # A head-wise press's masked_key_indices would mask every later forward that is not a prefill.
    for module in attention_modules(model):
        module.masked_key_indices = None


def share_scores(job: Job, scores: dict) -> None:
    """Let presses of one class and the same parameters but different ratios compute score() once per layer
    (a copy each: AdaKV changes its scores in place). Each job is still charged the scoring time."""
    scorer = job.press.press if isinstance(job.press, AdaKVPress) else job.press
    if not isinstance(scorer, RATIO_FREE_SCORES):
        return
    key = (type(scorer), *(getattr(scorer, f.name) for f in fields(scorer) if f.name != "compression_ratio"))
    score = scorer.score

    def shared_score(*args):
        if key in scores:
            job.press_s += scores[key][1]
        else:
            start = time.perf_counter()
            scores[key] = score(*args), time.perf_counter() - start
        return scores[key][0].clone()

    scorer.score = shared_score


@torch.no_grad()
def prefill(model, context_ids: torch.Tensor, jobs: list[Job], seed: int) -> tuple[DynamicCache, float]:
    """One prefill in which every job's press compresses every layer it would compress in kvpress (into
    job.kv / job.masks); the real cache stays full. Returns the cache and the prefill's own seconds."""
    language_model = model.model.language_model if hasattr(model.model, "language_model") else model.model
    # Each press draws from its own copy of the global RNG seeded with `seed`: the stream it would see
    # alone after torch.manual_seed(seed) (RandomPress's default seed=None uses the global RNG).
    rng = {job: torch.manual_seed(seed).get_state() for job in jobs}
    n_layers, scores, hook_s = len(language_model.layers), {}, [0.0]
    for job in jobs:
        job.kv, job.masks = [None] * n_layers, [None] * n_layers
        job.press.post_init_from_model(model)
        share_scores(job, scores)

    def hook(module, args, kwargs, output):  # what BasePress.forward_hook does, for every job
        hidden_states = kwargs["hidden_states"]
        if not is_prefilling(kwargs["cache_position"], hidden_states.shape[1]):
            return output
        scores.clear()  # a new layer
        hook_start = time.perf_counter()
        keys, values = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
        for job in jobs:
            if job.error:
                continue
            torch.set_rng_state(rng[job])
            start = time.perf_counter()
            try:
                job.kv[module.layer_idx] = job.press.compress(module, hidden_states, keys, values, output[1], kwargs)
            except Exception as e:  # kvpress cannot run this press on this model: record it, don't fake it
                job.error = f"{type(e).__name__}: {e}"
            job.press_s += time.perf_counter() - start
            rng[job] = torch.get_rng_state()
            job.masks[module.layer_idx] = module.masked_key_indices  # set by head-wise presses, else None
            module.masked_key_indices = None
        hook_s[0] += time.perf_counter() - hook_start
        return output

    hooks = []
    for layer in language_model.layers:
        if isinstance(model, base_press.Gemma3ForConditionalGeneration) and layer.self_attn.is_sliding:
            continue  # as kvpress's BasePress.__call__ (see the Gemma-3 note above)
        layer.self_attn.rotary_emb = language_model.rotary_emb  # as BasePress.__call__: some presses need it
        hooks.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
    clear_masks(model)
    cache = new_cache(model)
    start = time.perf_counter()
    try:
        model.model(input_ids=context_ids, past_key_values=cache)  # as the pipeline: no lm head
    finally:
        for h in hooks:
            h.remove()
    seconds = time.perf_counter() - start - hook_s[0]
    full = [(layer.keys, layer.values) for layer in cache.layers]
    for job in jobs:  # layers a press leaves alone (Gemma-3's sliding layers) stay full
        job.kv = [kv if kv is not None else full[i] for i, kv in enumerate(job.kv)]
        job.prefill_s = seconds
    return cache, seconds


@torch.no_grad()
def kvzip(model, context_ids: torch.Tensor, cache: DynamicCache, jobs: list[Job]) -> None:
    """KVzip's own flow, once for all ratios, on the cache `prefill` left full."""
    press = jobs[0].press
    compress_post = press.compress_post

    def compress_post_for_every_ratio(model):  # its scores (press.score_val) do not depend on the ratio
        scores = press.score_val.clone()  # compress_post changes them in place (sink scores)
        for job in jobs:
            press.compression_ratio, press.score_val = 1 - job.keep_ratio, scores.clone()
            compress_post(model)
            job.masks = [module.masked_key_indices for module in attention_modules(model)]

    press.compress_post = compress_post_for_every_ratio
    clear_masks(model)
    start = time.perf_counter()
    try:
        with press(model):
            # KVzip's prefill is a plain forward over the context (it only records the ids and the cache):
            # the one `prefill` already ran, so hand it that instead of prefilling again.
            press._context_ids, press._cache = context_ids, cache
    except Exception as e:  # KVzipPress refuses Gemma-3
        for job in jobs:
            job.error = f"{type(e).__name__}: {e}"
    finally:
        clear_masks(model)
    for job in jobs:
        job.press_s = time.perf_counter() - start
        job.kv = [(layer.keys, layer.values) for layer in cache.layers]  # views into the last replay pass


def batched_masks(masks: list) -> tuple | None:
    """Each batch row's masked_key_indices (batch, head, position) for one layer, or None, as one triple."""
    rows = [(m[0] + b, m[1], m[2]) for b, m in enumerate(masks) if m is not None]
    return tuple(torch.cat(parts) for parts in zip(*rows)) if rows else None


@torch.no_grad()
def answer(model, tok, s: dict, jobs: list[Job]) -> None:
    """Decode every job's answer; jobs whose caches have the same shapes (and attention) share a batch."""
    groups = defaultdict(list)
    for job in jobs:
        if not job.error:
            groups[job.eager, tuple(k.shape for k, _ in job.kv)].append(job)
    for (eager, _), group in groups.items():
        cache = new_cache(model)
        for i in range(len(group[0].kv)):
            cache.update(torch.cat([job.kv[i][0] for job in group]), torch.cat([job.kv[i][1] for job in group]), i)
            if cache.layers[i].is_sliding:  # it has seen the whole context and holds the window
                cache.layers[i].cumulative_length = len(s["context_ids"])
        for i, module in enumerate(attention_modules(model)):
            module.masked_key_indices = batched_masks([job.masks[i] if job.masks else None for job in group])
        model.set_attn_implementation("eager" if eager else "sdpa")
        start = time.perf_counter()
        try:
            outs = decode(model, tok, cache, s, len(group))
        except Exception as e:  # e.g. PyramidKV: see the docstring
            if len(group) == 1:
                group[0].error = f"{type(e).__name__}: {e}"
                continue
            outs = None
        finally:
            model.set_attn_implementation("sdpa")
            clear_masks(model)
        if outs is None:  # find out which job fails by answering each alone
            for job in group:
                answer(model, tok, s, [job])
            continue
        for job, tokens in zip(group, outs):
            job.tokens, job.answer_s = tokens, (time.perf_counter() - start) / len(group)
