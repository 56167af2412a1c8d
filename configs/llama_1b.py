"""A ~1B LLaMA-style model: 16 layers, hidden 2048, 32 heads x 64 with 8 KV heads (GQA), SwiGLU 8192,
vocab 32000, untied output layer, sequence 2048: 1,104,218,112 parameters.

Default layout: one 8-device node, data=8 with ZeRO-3 (the parameters, gradients and Adam state
all sharded over data), bf16 compute; ZeRO-3 gathers parameters and reduce-scatters gradients in
the compute dtype, so ``parallel.grad_reduce_dtype`` equals ``model.compute_dtype``.

Plan it (estimates only, seconds), then compile the best layouts on simulated CPU devices:
    jaxpar plan --config configs/llama_1b.py --cluster h100-80g --nodes 1
    jaxpar plan --config configs/llama_1b.py --cluster h100-80g --nodes 1 --top 3 --aot
Inspect the default layout's compiled collectives and memory (fp32 compute: XLA:CPU runs bf16
collectives in fp32, so exact byte ratios need fp32):
    jaxpar inspect --config configs/llama_1b.py --config.model.compute_dtype=float32 \
        --config.parallel.grad_reduce_dtype=float32
Train on 8 GPUs (synthetic tokens by default; point data at a token file for real runs):
    jaxpar train --config configs/llama_1b.py
    jaxpar train --config configs/llama_1b.py --config.data.source=bin --config.data.path=/data/tokens.bin
"""

from jaxpar.config import default_config


def get_config():
    c = default_config()
    c.mesh.data, c.mesh.tensor, c.mesh.pipeline = 8, 1, 1
    c.parallel.zero_stage = 3
    c.parallel.grad_reduce_dtype = "bfloat16"  # ZeRO-3 reduces in the compute dtype
    m = c.model
    m.vocab_size, m.embed_dim, m.num_layers = 32000, 2048, 16
    m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = 32, 8, 64, 8192
    m.max_seq_len, m.rope_theta, m.norm_eps = 2048, 10000.0, 1e-5
    m.tie_embeddings, m.compute_dtype = False, "bfloat16"
    c.parallel.recompute = "selective"
    c.train.seq_len, c.train.global_batch, c.parallel.microbatches = 2048, 64, 2
    c.train.steps, c.train.workdir = 20000, "runs/llama_1b"
    c.optim.lr, c.optim.warmup_steps, c.optim.min_lr_ratio = 3e-4, 1000, 0.1
    c.data.source = "synthetic"
    return c
