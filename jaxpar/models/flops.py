"""Training FLOPs of the decoder families: model FLOPs per token (the MFU numerator), hardware FLOPs
with recomputation (HFU) and Megatron-LM's per-iteration count, for the planner
(:mod:`jaxpar.analysis.estimate`) and the trainer's MFU (:mod:`jaxpar.metrics`).
"""

from __future__ import annotations

from jaxpar.config import ConfigDict
from jaxpar.models.inventory import count_params, stacked_layers


def flops_params(model: ConfigDict) -> int:
    """Parameters doing matmul work for one token: all but the input-embedding lookup and the
    position table (the output projection counts even when tied: the tied table does a V x h
    matmul); with experts, only the ``experts_per_token`` experts a token runs through (the
    active-parameter convention of Mixtral's "12.9B active" and of MoE MFU in Megatron-core and
    MaxText)."""
    lookup = 0 if model.tie_embeddings else model.vocab_size * model.embed_dim
    positions = model.max_seq_len * model.embed_dim if model.position == "learned" else 0
    idle = 0
    if model.num_experts:  # the experts a token does not run through
        width = model.get("moe_mlp_dim", 0) or model.mlp_dim  # deepseek_v3's experts: moe_mlp_dim
        idle = stacked_layers(model) * (model.num_experts - model.experts_per_token) * 3 * model.embed_dim * width
    return count_params(model) - lookup - positions - idle


def flops_per_token(model: ConfigDict, seq_len: int, causal: bool = False) -> float:
    """Training FLOPs per token: 6N + 12*L*(heads*hd)*s (PaLM, Chowdhery et al. 2022, appendix B;
    6N from Kaplan et al. 2020: forward 2N, backward 4N). The attention term counts QK^T and AV
    without the causal mask, as PaLM reports MFU (and jaxpar/metrics.py); ``causal=True`` halves it
    as MaxText does."""
    attention = 12 * model.num_layers * model.num_heads * model.head_dim * seq_len
    return 6 * flops_params(model) + attention * (0.5 if causal else 1.0)


def hardware_flops_per_token(
    model: ConfigDict, seq_len: int, recompute: str, causal: bool = False, model_flops: float | None = None
) -> float:
    """FLOPs actually executed (HFU numerator): full recompute reruns the forward (+2N + 4Lqs, the
    8TP of Narayanan 2021), selective reruns the attention core (+4Lqs). ``model_flops`` skips a recount."""
    attention_fwd = 4 * model.num_layers * model.num_heads * model.head_dim * seq_len * (0.5 if causal else 1.0)
    extra = {"none": 0.0, "selective": attention_fwd, "full": 2 * flops_params(model) + attention_fwd}[recompute]
    return (model_flops if model_flops is not None else flops_per_token(model, seq_len, causal)) + extra


def megatron_flops_per_iteration(model: ConfigDict, global_batch: int, seq_len: int, recompute: bool = False) -> float:
    """Megatron's count for a GPT layer (f = 4h, heads*hd = h), B in sequences, no causal discount:
    72*B*s*L*h^2*(1 + s/(6h) + V/(12*h*L)) (Megatron-LM's num_floating_point_operations); with the
    recomputed forward 96*B*s*L*h^2*(1 + s/(6h) + V/(16*h*L)) (Narayanan et al. 2021,
    arXiv:2104.04473, sec. 5.1; the logit layer is not recomputed)."""
    h, n_layers, v = model.embed_dim, model.num_layers, model.vocab_size
    k, vocab_div = (96, 16) if recompute else (72, 12)
    return k * global_batch * seq_len * n_layers * h * h * (1 + seq_len / (6 * h) + v / (vocab_div * h * n_layers))
