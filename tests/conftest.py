"""Shared fixtures: the real embedded models (loaded once per session) and tiny random models."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

import kvmem.cache  # noqa: F401  (registers kvmem's attention)
from kvmem.models import LoadedModel, load_model

# `make test` runs the suite as two pytest-xdist workers, one per core, each on one torch thread: on a 2-core
# machine a second thread per process only thrashes, and most forwards here are too small to use it.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3() -> LoadedModel:
    return load_model("gemma3-270m")


@pytest.fixture(scope="session")
def qwen() -> LoadedModel:
    return load_model("qwen2.5-coder-0.5b")


def tiny_model(kind: str = "llama", sliding_window: int = 8):
    """A random 2-layer model (GQA) for fast property tests; `gemma` mixes sliding and global layers."""
    torch.manual_seed(0)
    if kind == "llama":
        cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    else:
        cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                               sliding_window=sliding_window, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="kvmem", dtype=torch.float32).eval()
    return model


@pytest.fixture(scope="session")
def tiny_llama():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_gemma():
    return tiny_model("gemma")


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server (Debian's package; `make test` installs it) on a free loopback port, stopped afterwards;
    tests that kill it mid-run call `start()` again."""
    from kvmem.store.tiers import LocalRedis

    with LocalRedis() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster():
    """A real Redis Cluster of three redis-servers (Debian's package) on free loopback ports, every slot covered, no
    replicas, stopped afterwards; tests that kill a node call `restart(node)`."""
    from kvmem.store.tiers import LocalRedisCluster

    with LocalRedisCluster() as cluster:
        yield cluster
