"""A MaxText-equivalent tiny LLaMA, with MaxText 0.2.5's compiled numbers for it on 8 devices.

Model: embedding 256, 4 heads x 64 (4 KV heads), SwiGLU MLP 1024, 4 layers, vocabulary 1024,
untied output layer, sequence 256: 4,720,896 parameters (``jaxpar.models.inventory.count_params``). fp32
parameters and compute, full rematerialisation, one sequence per device (global batch 8, as
MaxText's per_device_batch_size=1), one microbatch (two with the pipeline), synthetic tokens.

MaxText 0.2.5 reference, per device per step (ring bytes of the compiled collectives;
memory = ``memory_analysis()`` arguments + temporaries):

=======================  ==============  ===================
layout (preset)          bytes/device    args + temps
=======================  ==============  ===================
DP-8 (``dp8``)           33.1 MB         105.8 MiB
FSDP-8 (``fsdp8``)       62.0 MB         29.6 MiB
FSDP-4 x TP-2            61.1 MB         28.7 MiB
DP-2 x TP-2 x PP-2       64.8 MB         31.2 MiB
=======================  ==============  ===================

Ideal ZeRO-3 / FSDP over 8: all-gather forward + all-gather backward + reduce-scatter,
3(n-1)/n * P * 4 bytes = 49.6 MB; DP: 2(n-1)/n * P * 4 = 33.1 MB. FSDP presets use ZeRO-3
over ``data``. tests/test_compiled.py compares all four layouts with these numbers. jaxpar (fp32, this machine):
DP-8 33.05 MB / 89.05 MiB; FSDP-8 47.73 MB / 25.83 MiB; FSDP-4 x TP-2 32.0 MB / 26.59 MiB;
DP-2 x TP-2 x PP-2 22.55 MB (busiest stage, counted per stage from the schedule) / 30.10 MiB.

Inspect (AOT compile on simulated CPU devices, compare with the formulas):
    jaxpar inspect --config configs/maxtext_tiny.py            # dp8
    jaxpar inspect --config configs/maxtext_tiny.py:fsdp8
    jaxpar inspect --config configs/maxtext_tiny.py:fsdp4_tp2 --json
Run:
    jaxpar train --config configs/maxtext_tiny.py:fsdp8 --config.train.steps=20
"""

from jaxpar.config import ConfigError, default_config

# preset -> (data, tensor, pipeline, zero_stage)
LAYOUTS = {
    "dp8": (8, 1, 1, 0),
    "fsdp8": (8, 1, 1, 3),
    "fsdp4_tp2": (4, 2, 1, 3),
    "dp2_tp2_pp2": (2, 2, 2, 0),
}


def get_config(layout: str = "dp8"):
    """The model above on one of the ``LAYOUTS`` presets (``configs/maxtext_tiny.py:<preset>``)."""
    if layout not in LAYOUTS:
        raise ConfigError(
            f"configs/maxtext_tiny.py: unknown layout '{layout}'; use one of {', '.join(LAYOUTS)} after a colon"
        )
    c = default_config()
    c.mesh.data, c.mesh.tensor, c.mesh.pipeline, c.parallel.zero_stage = LAYOUTS[layout]
    m = c.model
    m.vocab_size, m.embed_dim, m.num_layers = 1024, 256, 4
    m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = 4, 4, 64, 1024
    m.max_seq_len, m.tie_embeddings = 256, False
    # the s x s kernel the comparison above was measured with, whatever the default kernel is
    m.attention = "dot_product"
    m.compute_dtype, m.param_dtype = "float32", "float32"
    c.parallel.recompute = "full"
    c.train.seq_len = 256
    c.train.global_batch = 8  # one sequence per device, as MaxText's per_device_batch_size=1
    c.parallel.microbatches = 2 if c.mesh.pipeline > 1 else 1  # one microbatch per pipeline stage
    c.train.steps, c.train.workdir = 100, f"runs/maxtext_tiny_{layout}"
    c.data.source = "synthetic"
    return c
