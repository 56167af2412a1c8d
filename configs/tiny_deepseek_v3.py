"""A tiny DeepSeek-V3 for CPU: 4 layers (the first dense), MLA with query latent 32, key/value
latent 32, 4 heads of 16 + 8 RoPE query-key dims and 16 value dims; 8 experts of width 64 in 4
groups (top-2 groups, top-2 experts), sigmoid routing with the selection bias, route scale 2.5, one
shared expert; 8 simulated devices laid out as data=2 x expert=4.

Run:
    jaxpar train --config configs/tiny_deepseek_v3.py
"""

from jaxpar.config import default_config


def get_config():
    c = default_config()
    c.mesh.data, c.mesh.expert = 2, 4
    m = c.model
    m.name = "deepseek_v3"
    m.vocab_size, m.embed_dim, m.num_layers, m.num_heads = 256, 128, 4, 4
    m.num_kv_heads, m.head_dim = 4, 24  # MLA: one key per head, of the query-key dim 16 + 8
    m.mlp_dim, m.moe_mlp_dim, m.shared_expert_dim = 192, 64, 64
    m.q_lora_rank, m.kv_lora_rank = 32, 32
    m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = 16, 8, 16
    m.num_experts, m.experts_per_token, m.router_score = 8, 2, "sigmoid"
    m.router_groups, m.router_group_topk, m.router_scale = 4, 2, 2.5
    m.first_dense_layers, m.norm_eps = 1, 1e-6
    m.max_seq_len = 256
    c.train.seq_len, c.train.global_batch, c.train.steps = 256, 16, 200
    c.train.workdir = "runs/tiny_deepseek_v3"
    c.optim.lr, c.optim.warmup_steps = 3e-3, 20
    c.data.source = "stdlib"
    return c
