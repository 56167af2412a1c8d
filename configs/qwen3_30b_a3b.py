"""Qwen3-30B-A3B (Qwen Team 2025): 48 layers, hidden 2048, 32 query heads of 128 with 4 KV heads
and QK-norm, 128 SwiGLU experts of 768 per layer with top-8 softmax routing (top-k weights
renormalised), vocab 151936, RoPE 1e6; 30.5B parameters, 3.3B active per token. As the HF
``config.json`` of ``Qwen/Qwen3-30B-A3B``.

Train on 2 nodes of 8 GPUs: experts over expert=8, attention and embeddings data-parallel over
data x expert = 16, ZeRO-3:
    jaxpar train --config configs/qwen3_30b_a3b.py
"""

from jaxpar.config import default_config


def get_config():
    c = default_config()
    c.mesh.data, c.mesh.expert = 2, 8
    c.parallel.zero_stage = 3
    c.parallel.grad_reduce_dtype = "bfloat16"  # ZeRO-3 reduces in the compute dtype
    m = c.model
    m.name = "qwen3_moe"
    m.vocab_size, m.embed_dim, m.num_layers = 151936, 2048, 48
    m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = 32, 4, 128, 768
    m.qk_norm, m.num_experts, m.experts_per_token, m.router_norm_topk = True, 128, 8, True
    m.max_seq_len, m.rope_theta, m.norm_eps = 40960, 1e6, 1e-6
    c.parallel.recompute = "full"
    c.train.seq_len, c.train.global_batch, c.parallel.microbatches = 4096, 256, 4
    c.train.steps, c.train.workdir = 250000, "runs/qwen3_30b_a3b"
    c.optim.lr, c.optim.warmup_steps = 3e-4, 2000
    c.data.source, c.data.token_dtype, c.data.path = "bin", "uint32", "tokens.bin"
    return c
