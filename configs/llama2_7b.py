"""LLaMA-2 7B (Touvron et al. 2023): 32 layers, hidden 4096, 32 heads, SwiGLU 11008, vocab 32000.

Plan it (no hardware needed):
    jaxpar plan --config configs/llama2_7b.py --cluster a100-80g --nodes 4
Train it on a real cluster (a layout that fits 8 x 80 GB, ZeRO-3 over data):
    jaxpar train --config configs/llama2_7b.py --config.mesh.data=8 --config.data.source=bin \
        --config.data.path=/data/tokens.bin
"""

from jaxpar.config import default_config


def get_config():
    c = default_config()
    c.mesh.data, c.mesh.tensor, c.mesh.pipeline = 8, 1, 1
    c.parallel.zero_stage = 3
    c.parallel.grad_reduce_dtype = "bfloat16"  # ZeRO-3 reduces in the compute dtype
    m = c.model
    m.vocab_size, m.embed_dim, m.num_layers = 32000, 4096, 32
    m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = 32, 32, 128, 11008
    m.max_seq_len, m.rope_theta, m.norm_eps = 4096, 10000.0, 1e-5
    c.parallel.recompute = "full"
    c.train.seq_len, c.train.global_batch, c.parallel.microbatches = 4096, 1024, 16
    c.train.steps, c.train.workdir = 500000, "runs/llama2_7b"
    c.optim.lr, c.optim.warmup_steps, c.optim.weight_decay, c.optim.min_lr_ratio = 3e-4, 2000, 0.1, 0.1
    c.data.source, c.data.token_dtype = "bin", "uint16"
    c.data.path = "tokens.bin"
    return c
