"""A tiny Mixtral for CPU: the ``tiny`` LLaMA with 8 SwiGLU experts of width 192 per layer, top-2
softmax routing, the Switch load-balancing loss at 0.01; 8 simulated devices laid out as
data=2 x expert=4 (each expert rank holds 2 experts; attention and embeddings see data=8).

Run:
    jaxpar train --config configs/tiny_mixtral.py
    jaxpar train --config configs/tiny_mixtral.py --config.mesh.expert=2 --config.mesh.tensor=2
"""

from jaxpar.config import default_config


def get_config():
    c = default_config()
    c.mesh.data, c.mesh.expert = 2, 4
    c.model.name = "mixtral"
    c.model.vocab_size = 256
    c.model.embed_dim = 128
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.head_dim = 32
    c.model.mlp_dim = 192
    c.model.num_experts = 8
    c.model.experts_per_token = 2
    c.model.moe_aux_loss_coeff = 0.01
    c.model.max_seq_len = 256
    c.train.seq_len = 256
    c.train.global_batch = 16
    c.train.steps = 200
    c.train.workdir = "runs/tiny_mixtral"
    c.optim.lr = 3e-3
    c.optim.warmup_steps = 20
    c.data.source = "stdlib"
    return c
