"""Compression methods, one file each, on the shared base in `base.py`; budget allocators in `budget.py`.

`get_method(spec)` returns a method by its canonical name or a spec with options, e.g. `snapkv`,
`snapkv:window=64`, `kvzip:budget=adaptive` (the same spelling the CLI, results and plots use). Every method
also takes `sliding=keep` (sliding-window layers are left whole, their window bounds them already; the keep
ratio then applies to the global layers, as kvpress and KVzip's reference do on Gemma-3) or `sliding=compress`.
The offload-and-retrieve policies (`offload/`: sentencekv, ltri, louiskv, actqkv, sparq) are named the same way; they keep
every row in a slower tier and their keep ratio is the resident fraction.
"""

from kvmem.compress.attention_matching import AttentionMatching
from kvmem.compress.base import SLIDING, HeadView, Method, ModelContext
from kvmem.compress.budget import BUDGETS
from kvmem.compress.curdkv import CurDKV
from kvmem.compress.dapq import DapQ
from kvmem.compress.evict import CompressionResult, Compressor, compress, compress_while_decoding
from kvmem.compress.expected_attention import ExpectedAttention
from kvmem.compress.fastgen import FastGen
from kvmem.compress.finch import Finch
from kvmem.compress.full import Full
from kvmem.compress.h2o import H2O
from kvmem.compress.keydiff import KeyDiff
from kvmem.compress.keyformer import Keyformer
from kvmem.compress.knorm import KNorm
from kvmem.compress.kvcrush import KVCrush
from kvmem.compress.moment_kv import MomentKV
from kvmem.compress.offload import POLICIES as OFFLOAD_POLICIES
from kvmem.compress.q_filters import QFilters
from kvmem.compress.kvzip import KVzip
from kvmem.compress.kvzip_head import KVzipHead
from kvmem.compress.random import Random
from kvmem.compress.rcstat import RCStat
from kvmem.compress.snapkv import SnapKV
from kvmem.compress.streaming_llm import StreamingLLM
from kvmem.compress.subgen import SubGen
from kvmem.compress.tova import TOVA
from kvmem.compress.vatp import VATP
from kvmem.errors import KVMemError
from kvmem.spec import check_options, parse_spec

METHODS: dict[str, type[Method]] = {m.name: m for m in (Full, Random, StreamingLLM, H2O, SnapKV, TOVA, KNorm, KeyDiff,
                                                        CurDKV, ExpectedAttention, QFilters, KVzip, KVzipHead, VATP,
                                                        RCStat, AttentionMatching, Keyformer, DapQ, FastGen,
                                                        MomentKV, Finch, KVCrush, SubGen)}
# offload-and-retrieve (offload/): named like the methods, kept apart because nothing is evicted (the benchmark's and
# the tests' sweeps over METHODS are eviction's)
OFFLOAD: dict[str, type[Method]] = {m.name: m for m in OFFLOAD_POLICIES}
KVCrush.methods = METHODS  # kvcrush names its base method by name


def get_method(spec: str, **options) -> Method:
    """A method by name or spec (`name:option=value:...`); keyword `options` come after the spec's. `budget`
    chooses the allocator (see `budget.py`); the rest go to the method's constructor."""
    name, spec_options = parse_spec(spec, {**METHODS, **OFFLOAD}, "method")
    options = {**spec_options, **options}
    cls = METHODS.get(name) or OFFLOAD[name]
    if cls.budgets == () and "budget" in options:
        raise KVMemError(f"method {name!r} sizes its heads itself (its own policies choose the tokens); it takes no "
                         f"budget option (got budget={options['budget']!r})")
    budget, sliding = options.pop("budget", cls.budget), options.pop("sliding", cls.sliding)
    if budget not in BUDGETS:
        raise KVMemError(f"unknown budget {budget!r} in {spec!r}; choose from {', '.join(BUDGETS)}")
    if sliding not in SLIDING:
        raise KVMemError(f"sliding={sliding!r} in {spec!r}: choose {' or '.join(SLIDING)} (what happens to sliding-window layers)")
    if cls.budgets and budget not in cls.budgets:
        raise KVMemError(f"method {name!r} decides how many tokens each head keeps itself: budget={budget!r} is not "
                         f"one it takes; choose {' or '.join(cls.budgets)}")
    if name == "full" and (budget != "uniform" or sliding != cls.sliding):
        raise KVMemError("method 'full' keeps every token; it takes no budget or sliding option")
    check_options(name, cls, options)
    method = cls(**options)
    if budget == "prefixkv" and method.signed_scores:  # on the instance: kvcrush's are its base method's
        raise KVMemError(f"budget=prefixkv sizes layers by their share of score mass, and {name}'s scores are "
                         "signed; use it with a scorer of attention mass (h2o, snapkv, tova, vatp, expected-attention, "
                         "kvzip, ...)")
    if budget == "global" and method.signed_scores:
        # the scale of a key-geometry score moves with depth: on a Gemma-3 2k context keydiff:kernel_size=33:budget=global
        # gave layer 17 1534 of 1536 rows and layers 5 and 11 one each; at 8k it answered 0 of 30 (README, "Of note")
        raise KVMemError(f"budget=global ranks the tokens of every layer on one scale, and {name}'s scores (signed, "
                         "from key geometry) are not comparable across layers; use budget=pyramid or adaptive, or a "
                         "scorer of attention mass (h2o, snapkv, tova, vatp, expected-attention, kvzip, ...)")
    method.budget, method.sliding, method.options = budget, sliding, options
    return method


__all__ = ["BUDGETS", "METHODS", "OFFLOAD", "CompressionResult", "Compressor", "HeadView", "Method", "ModelContext", "compress",
           "compress_while_decoding", "get_method"]
