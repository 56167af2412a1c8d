"""DeepSeek-V3 (DeepSeek-AI 2024, arXiv:2412.19437), for the planner: 61 layers (the first 3
dense, SwiGLU 18432), hidden 7168, MLA with 128 heads (query latent 1536, key/value latent 512,
128 + 64 RoPE query-key dims, 128 value dims), 256 routed experts of 2048 plus one shared, top-8
sigmoid routing limited to 4 of 8 groups, weights renormalised and scaled by 2.5, vocab 129280;
671B parameters, 37B active per token. As the HF ``config.json`` of ``deepseek-ai/DeepSeek-V3``
without its YaRN RoPE scaling (not implemented; the 4K pre-training phase has none) and without
the multi-token-prediction module.

Plan it:
    jaxpar plan --config configs/deepseek_v3_671b.py
"""

from jaxpar.config import default_config


def get_config():
    c = default_config()
    # 2048 GPUs as the paper's run, without its 16 pipeline stages (61 layers: pipeline must divide them)
    c.mesh.data, c.mesh.expert = 32, 64
    c.parallel.zero_stage = 3
    m = c.model
    m.name = "deepseek_v3"
    m.vocab_size, m.embed_dim, m.num_layers, m.num_heads = 129280, 7168, 61, 128
    m.num_kv_heads, m.head_dim = 128, 192  # MLA: one key per head, of the query-key dim 128 + 64
    m.mlp_dim, m.moe_mlp_dim, m.shared_expert_dim = 18432, 2048, 2048
    m.q_lora_rank, m.kv_lora_rank = 1536, 512
    m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = 128, 64, 128
    m.num_experts, m.experts_per_token, m.router_score = 256, 8, "sigmoid"
    m.router_groups, m.router_group_topk, m.router_scale = 8, 4, 2.5
    m.router_bias_rate = 0.001  # the paper's bias update speed for the first 14.3T tokens
    m.first_dense_layers, m.norm_eps, m.rope_theta = 3, 1e-6, 10000.0
    m.max_seq_len = 4096
    c.parallel.recompute = "full"
    c.train.seq_len, c.train.global_batch, c.parallel.microbatches = 4096, 4096, 2  # the paper: 15360
    c.train.steps, c.train.workdir = 1000000, "runs/deepseek_v3_671b"
    c.optim.lr, c.optim.warmup_steps = 2.2e-4, 2000
    c.data.source, c.data.token_dtype, c.data.path = "bin", "uint32", "tokens.bin"
    return c
