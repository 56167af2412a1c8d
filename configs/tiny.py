"""The CPU default: a small LLaMA-style model on the Python standard library's bytes.

Byte vocabulary (256), sequence 256, 4 layers of width 128; trains in a few minutes on 2
CPU cores with 8 simulated devices laid out as data=4 x tensor=2.

Run:
    jaxpar train --config configs/tiny.py
    jaxpar train --config configs/tiny.py --config.mesh.data=8 --config.mesh.tensor=1
"""

from jaxpar.config import default_config


def get_config():
    c = default_config()
    c.mesh.data, c.mesh.tensor, c.mesh.pipeline = 4, 2, 1
    c.model.vocab_size = 256
    c.model.embed_dim = 128
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.head_dim = 32
    c.model.mlp_dim = 384
    c.model.max_seq_len = 256
    c.train.seq_len = 256
    c.train.global_batch = 16
    c.train.steps = 200  # ~2-3 minutes on 2 cores; validation bits/byte falls by ~60%
    c.train.workdir = "runs/tiny"
    c.optim.lr = 3e-3
    c.optim.warmup_steps = 20
    c.data.source = "stdlib"
    return c
