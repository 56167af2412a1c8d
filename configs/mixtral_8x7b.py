"""Mixtral 8x7B (Jiang et al. 2024): 32 layers, hidden 4096, 32 heads with 8 KV heads, 8 SwiGLU
experts of 14336 per layer with top-2 routing, vocab 32000, RoPE 1e6; 46.7B parameters, 12.9B
active per token. As the HF ``config.json`` of ``mistralai/Mixtral-8x7B-v0.1``.

Train on 2 nodes of 8 GPUs: experts over expert=8 inside a node is not needed; 8 experts split
over expert=2 with ZeRO-3 over data=8 (each rank holds 4 experts' shards):
    jaxpar train --config configs/mixtral_8x7b.py
"""

from jaxpar.config import default_config


def get_config():
    c = default_config()
    c.mesh.data, c.mesh.expert = 8, 2
    c.parallel.zero_stage = 3
    c.parallel.grad_reduce_dtype = "bfloat16"  # ZeRO-3 reduces in the compute dtype
    m = c.model
    m.name = "mixtral"
    m.vocab_size, m.embed_dim, m.num_layers = 32000, 4096, 32
    m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = 32, 8, 128, 14336
    m.num_experts, m.experts_per_token = 8, 2
    m.max_seq_len, m.rope_theta = 32768, 1e6
    c.parallel.recompute = "full"
    c.train.seq_len, c.train.global_batch, c.parallel.microbatches = 4096, 256, 4
    c.train.steps, c.train.workdir = 250000, "runs/mixtral_8x7b"
    c.optim.lr, c.optim.warmup_steps = 3e-4, 2000
    c.data.source, c.data.token_dtype, c.data.path = "bin", "uint16", "tokens.bin"
    return c
