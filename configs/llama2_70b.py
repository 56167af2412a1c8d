"""LLaMA-2 70B: 80 layers, hidden 8192, 64 heads with 8 KV heads (GQA), SwiGLU 28672, vocab 32000.

Plan it:
    jaxpar plan --config configs/llama2_70b.py --cluster h100-80g --nodes 8 --global-batch 1024 --seq 4096
Train on 64 GPUs (TP 8 in the node, PP 8 across nodes):
    jaxpar train --config configs/llama2_70b.py
"""

from jaxpar.config import default_config


def get_config():
    c = default_config()
    c.mesh.data, c.mesh.tensor, c.mesh.pipeline = 1, 8, 8
    c.parallel.zero_stage, c.parallel.sequence_parallel = 1, True
    m = c.model
    m.vocab_size, m.embed_dim, m.num_layers = 32000, 8192, 80
    m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = 64, 8, 128, 28672
    m.max_seq_len = 4096
    c.parallel.recompute = "selective"
    c.train.seq_len, c.train.global_batch, c.parallel.microbatches = 4096, 1024, 64
    c.train.steps, c.train.workdir = 500000, "runs/llama2_70b"
    c.optim.lr, c.optim.warmup_steps, c.optim.min_lr_ratio = 1.5e-4, 2000, 0.1
    c.data.source, c.data.path = "bin", "tokens.bin"
    return c
