"""Offload-and-retrieve methods: the whole context in a slower tier, a small working set attended, rows retrieved
per forward (`base.py` states the mechanism, `rows.py` the storage; one file per policy)."""

from kvmem.compress.offload.actqkv import ActQKV
from kvmem.compress.offload.base import OffloadMethod
from kvmem.compress.offload.exact_topk import ExactTopK
from kvmem.compress.offload.louiskv import LouisKV
from kvmem.compress.offload.ltri import Ltri
from kvmem.compress.offload.rows import TIERS, OffloadedRows, Tier
from kvmem.compress.offload.sentencekv import SentenceKV
from kvmem.compress.offload.sparq import SparQ

POLICIES = (SentenceKV, Ltri, LouisKV, ActQKV, SparQ, ExactTopK)  # the last: a yardstick, not a paper's policy

__all__ = ["POLICIES", "TIERS", "ActQKV", "ExactTopK", "LouisKV", "Ltri", "OffloadMethod", "OffloadedRows", "SentenceKV", "SparQ", "Tier"]
