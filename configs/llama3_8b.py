"""LLaMA-3 8B: 32 layers, hidden 4096, 32 heads with 8 KV heads, SwiGLU 14336, vocab 128256, RoPE 500000.

Plan it:
    jaxpar plan --config configs/llama3_8b.py --cluster h100-80g --nodes 2
Train on a node of 8 GPUs (FSDP / ZeRO-3 over data):
    jaxpar train --config configs/llama3_8b.py
"""

from jaxpar.config import default_config


def get_config():
    c = default_config()
    c.mesh.data, c.mesh.tensor, c.mesh.pipeline = 8, 1, 1
    c.parallel.zero_stage = 3
    c.parallel.grad_reduce_dtype = "bfloat16"  # ZeRO-3 reduces in the compute dtype
    m = c.model
    m.vocab_size, m.embed_dim, m.num_layers = 128256, 4096, 32
    m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = 32, 8, 128, 14336
    m.max_seq_len, m.rope_theta = 8192, 500000.0
    c.parallel.recompute = "full"
    c.train.seq_len, c.train.global_batch, c.parallel.microbatches = 8192, 512, 8
    c.train.steps, c.train.workdir = 500000, "runs/llama3_8b"
    c.optim.lr, c.optim.warmup_steps = 3e-4, 2000
    c.data.source, c.data.token_dtype, c.data.path = "bin", "uint32", "tokens.bin"
    return c
