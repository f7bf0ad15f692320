"""Calibration artefacts: per-model tensors some methods fit once, offline, on shipped text (Q-Filters'
directions, retrieval-head scores, quantization codebooks), never downloaded. The shipped text is
`data/abstracts.txt`, one abstract per line (`load_abstracts`).

Each artefact is a safetensors file under `<kvmem cache>/calibration/`, named by method and model, whose
metadata holds the model fingerprint and the fitting parameters. `load_or_fit` refits (and overwrites)
when either differs, so filters fitted for other weights or settings are never used.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from kvmem.errors import KVMemError
from kvmem.models import cache_dir

ABSTRACTS = Path(__file__).parent / "data" / "abstracts.txt"

_LOADED: dict[tuple, dict[str, Tensor]] = {}  # in-process: each artefact is read once


def artefact_path(name: str, model_name: str, params: dict | None = None):
    """Where an artefact is cached: by method, model and (a short hash of) the fitting parameters, so artefacts of
    different settings live side by side instead of refitting each other."""
    tag = "" if params is None else "--" + hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]
    return cache_dir() / "calibration" / f"{name}--{model_name.replace('/', '_')}{tag}.safetensors"


def load_or_fit(lm, name: str, params: dict, fit: Callable[[], dict[str, Tensor]]) -> dict[str, Tensor]:
    """The artefact `name` for `lm` fitted with `params`: from memory, from disk if its fingerprint and
    parameters match, else fitted now by `fit()` and saved."""
    key = (name, lm.fingerprint, json.dumps(params, sort_keys=True))
    if key in _LOADED:
        return _LOADED[key]
    path = artefact_path(name, lm.name, params)
    meta = {"fingerprint": lm.fingerprint, "params": key[2]}
    tensors = None
    if path.exists():
        try:
            with safe_open(str(path), framework="pt") as f:
                if f.metadata() == meta:
                    tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception:  # noqa: BLE001 - an unreadable artefact is refitted, never trusted
            tensors = None
    if tensors is None:
        print(f"kvmem: fitting {name} for {lm.name} (once; cached in {path})", file=sys.stderr, flush=True)
        tensors = {k: v.detach().float().contiguous() for k, v in fit().items()}
        if not all(torch.isfinite(v).all() for v in tensors.values()):
            raise KVMemError(f"calibration of {name} for {lm.name} produced non-finite values")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # processes fitting side by side never share a temporary
        save_file(tensors, str(tmp), metadata=meta)
        tmp.replace(path)
    _LOADED[key] = tensors
    return tensors


def calibration_ids(tokenizer, n_sequences: int, length: int) -> list[list[int]]:
    """`n_sequences` token sequences of `length` tokens of the shipped abstracts (consecutive, no repeats
    until the text runs out)."""
    ids = tokenizer("\n\n".join(load_abstracts()), add_special_tokens=False).input_ids
    if len(ids) < n_sequences * length:
        raise KVMemError(f"the shipped text has {len(ids)} tokens; calibration asked for {n_sequences} x {length}")
    return [ids[i * length:(i + 1) * length] for i in range(n_sequences)]


@lru_cache(maxsize=1)
def load_abstracts() -> tuple[str, ...]:
    """The shipped abstracts, one string each."""
    lines = ABSTRACTS.read_text(encoding="utf-8").splitlines()
    return tuple(line.strip() for line in lines if line.strip())
