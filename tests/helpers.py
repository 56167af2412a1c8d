"""Shared test helpers: small fp32 configs and a single-device reference run."""

from __future__ import annotations

import functools
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.analysis.compiled import AOT_COMPILER_OPTIONS
from jaxpar.config import load_config, validate
from jaxpar.mesh import make_mesh
from jaxpar.models import llama
from jaxpar.models.base import Model
from jaxpar.train.state import Setup
from tests.session_flags import ELEMENTAL_EMITTER, FUSION_EMITTERS, LLVM_LEVEL

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.py")
# fp32 compute, a short sequence and a small batch: numerically exact comparisons, fast compiles.
FP32_SMALL = [
    "--config.model.compute_dtype=float32",
    "--config.train.global_batch=8",
    "--config.train.seq_len=64",
    "--config.optim.warmup_steps=1",
    # Adam divides by sqrt(v): near-zero gradients turn reduction-order roundoff into O(lr) noise.
    # A small lr keeps that noise well below the 1e-5 parameter tolerance.
    "--config.optim.lr=5e-4",
]


# tests/conftest.py: the session's LLVM level, and its switch to XLA:CPU's elemental emitter (jax 0.10)
FAST_COMPILE_FLAGS = (f"{LLVM_LEVEL}=0", FUSION_EMITTERS)


# The compiler options of the tests that hold estimates against the compiled buffer assignment: plan --aot's
# (no LLVM optimisation, the same buffers) and, where tests/conftest.py switched this session to the
# elemental emitter, XLA's default emitter back, so that they measure the buffers users' compiles get (the
# elemental emitter moves 15 of seed 124's 16 memory-grid layouts by at most 0.34%, one ~1B context-parallel
# layout by +6.8%).
USER_BUFFERS = {FUSION_EMITTERS.lstrip("-"): True} if ELEMENTAL_EMITTER in os.environ.get("XLA_FLAGS", "") else {}
MEMORY_OPTIONS = AOT_COMPILER_OPTIONS | USER_BUFFERS


def child_env(*, fast_code: bool = False, **extra: str) -> dict[str, str]:
    """The environment for a Python process a test starts that sets its own device count: this
    session's, less XLA_FLAGS' simulated-device count (tests/conftest.py's other flags stay).
    ``fast_code``: also less the session's compile-time flags (LLVM optimisation level 0, the elemental
    emitter), for a process that runs many steps (measured: the 30-step default-config run 119 s at
    level 0, 37 s at the default)."""
    drop = ("--xla_force_host_platform_device_count", *(FAST_COMPILE_FLAGS if fast_code else ()))
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(drop))
    return env | extra


def tiny_config(*overrides: str):
    return load_config(TINY, [*FP32_SMALL, *overrides])


def make_setup(cfg) -> Setup:
    """``cfg``'s Setup on the first data*tensor*pipeline*context*expert devices: the config validated
    once and its layout handed to the mesh and to Setup, as ``jaxpar train`` does."""
    layout = validate(cfg)
    return Setup(cfg, layout, make_mesh(layout, jax.devices()[: layout.devices]))


def run_steps(cfg, steps: int, seed: int = 0):
    """Train ``steps`` steps on the first data*tensor*pipeline*context*expert devices with fixed random batches.

    Returns (per-step metrics, final params on host, the Setup)."""
    setup = make_setup(cfg)
    params, opt = setup.init(seed)
    rng = np.random.default_rng(seed)
    history = []
    for _ in range(steps):
        rows = rng.integers(0, cfg.model.vocab_size, size=(cfg.train.global_batch, cfg.train.seq_len + 1))
        params, opt, metrics = setup.train_step(params, opt, setup.feed.make_batch(rows))
        history.append({k: float(v) for k, v in jax.device_get(metrics).items()})
    return history, jax.device_get(params), setup


def max_rel_error(tree_a, tree_b) -> float:
    """Largest per-leaf max|a-b| / max|b| over two parameter trees."""
    errs = [
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / (np.max(np.abs(np.asarray(b))) + 1e-30))
        for a, b in zip(jax.tree.leaves(tree_a), jax.tree.leaves(tree_b), strict=True)
    ]
    return max(errs)


def tiny_hf_llama(path: pathlib.Path, **config):
    """A tiny transformers ``LlamaForCausalLM`` (fp32, eager attention, seed 0; ``config`` adds or
    overrides LlamaConfig fields), its norm scales moved away from 1 so a mixed-up norm mapping
    shows, saved at ``path``; returns the torch model. Needs torch and transformers."""
    import torch
    import transformers

    torch.manual_seed(0)
    fields = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=64,
    )
    hf_config = transformers.LlamaConfig(**(fields | config), attn_implementation="eager", dtype=torch.float32)
    model = transformers.LlamaForCausalLM(hf_config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


@functools.partial(jax.jit, static_argnums=0)
def _llama_logits(ctx, params, inputs):
    x = llama.embed_tokens(params, inputs, ctx)
    x = llama.run_blocks(x, params[Model.stacked], jnp.arange(inputs.shape[1]), ctx)
    return llama.logits_local(params, x, ctx)


def llama_logits(params, model_cfg, inputs) -> np.ndarray:
    """Single-device logits of a llama-family model (one compile per model config: the context is hashable)."""
    return np.asarray(_llama_logits(llama.shard_context_for(model_cfg), params, jnp.asarray(inputs)))
