"""LLaMA-2 13B: 40 layers, hidden 5120, 40 heads, SwiGLU 13824, vocab 32000.

Plan it:
    jaxpar plan --config configs/llama2_13b.py --cluster a100-80g --nodes 8
Train on a cluster (TP inside the node, ZeRO-1 across):
    jaxpar train --config configs/llama2_13b.py --config.mesh.data=8 --config.mesh.tensor=8
"""

from jaxpar.config import default_config


def get_config():
    c = default_config()
    c.mesh.data, c.mesh.tensor, c.mesh.pipeline = 8, 8, 1
    c.parallel.zero_stage = 1
    m = c.model
    m.vocab_size, m.embed_dim, m.num_layers = 32000, 5120, 40
    m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = 40, 40, 128, 13824
    m.max_seq_len = 4096
    c.parallel.recompute = "selective"
    c.train.seq_len, c.train.global_batch, c.parallel.microbatches = 4096, 1024, 16
    c.train.steps, c.train.workdir = 500000, "runs/llama2_13b"
    c.optim.lr, c.optim.warmup_steps = 3e-4, 2000
    c.data.source, c.data.path = "bin", "tokens.bin"
    return c
