"""GPT-3 175B (Brown et al. 2020) in Megatron's layout (Narayanan et al. 2021, Table 1).

96 layers, hidden 12288, 96 heads of 128, GeLU MLP 4h = 49152, LayerNorm, learned positions,
vocab 51200 (GPT-2 BPE padded), tied embeddings, seq 2048, global batch 1536. Megatron ran it on
1024 A100 as tensor 8 (inside a node) x pipeline 8 (across nodes) x data 16, microbatch 1 with
activation recompute: 140 TFLOP/s per GPU achieved end to end, ~34 days for 300B tokens.
Linear layers carry no biases here (our classic-GPT block), a ~0.1% difference.

Plan it (no hardware needed):
    jaxpar plan --config configs/gpt3_175b.py --cluster a100-80g --nodes 128
Check Megatron's own layout:
    jaxpar plan --config configs/gpt3_175b.py --cluster a100-80g --nodes 128 \
        --layout data=16,tensor=8,pipeline=8 --microbatches 96 --recompute full --zero 0
"""

from jaxpar.config import default_config


def get_config():
    c = default_config()
    c.mesh.data, c.mesh.tensor, c.mesh.pipeline = 16, 8, 8  # 1024 devices
    c.parallel.zero_stage, c.parallel.sequence_parallel = 0, False  # the 2021 run predates both in Megatron
    m = c.model
    m.name = "gpt"
    m.vocab_size, m.embed_dim, m.num_layers = 51200, 12288, 96
    m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = 96, 96, 128, 49152
    m.mlp_activation, m.norm, m.position = "gelu", "layernorm", "learned"
    m.tie_embeddings, m.max_seq_len = True, 2048
    c.parallel.recompute = "full"
    m.init_std = 0.006  # as in Megatron-LM's GPT-3 175B example script (~sqrt(2 / (5h)))
    c.train.seq_len, c.train.global_batch, c.parallel.microbatches = 2048, 1536, 96  # microbatch size 1 per data shard
    c.train.steps, c.train.workdir = 95367, "runs/gpt3_175b"  # 300B tokens / (1536 * 2048)
    c.optim.lr, c.optim.warmup_steps, c.optim.min_lr_ratio = 6e-5, 119, 0.1  # GPT-3: 375M warmup tokens
    c.optim.b1, c.optim.b2, c.optim.weight_decay = 0.9, 0.95, 0.1
    c.parallel.pipeline_schedule, c.parallel.virtual_stages = "1f1b", 1
    c.data.source, c.data.path = "bin", "tokens.bin"
    return c
