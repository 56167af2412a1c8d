"""The config schema: every field with its default (:func:`default_config`; every config file starts
from it) and the domains :mod:`jaxpar.config.validation` checks fields against (dtypes, data sources,
learning-rate schedules, size caps)."""

from __future__ import annotations

import ml_collections

from jaxpar.axes import MESH_AXES

ConfigDict = ml_collections.ConfigDict

DTYPES = ("float32", "bfloat16", "float16")
DATA_SOURCES = ("stdlib", "synthetic", "bin", "megatron")
SCHEDULE_TYPES = ("cosine", "linear", "constant", "inverse_sqrt", "sqrt")
FILE_SOURCES = ("bin", "megatron")  # the data sources that read data.path
MAX_DEVICES = 1 << 20  # more accelerators than any cluster has: a larger mesh is a typo, not a plan
MAX_PARAMS = 10**13  # parameters: beyond any model a cluster of MAX_DEVICES trains
MAX_DIM = 1 << 24  # one model dimension (vocabulary, width, heads, layers, sequence length)
ROPE_SCALINGS = ("none", "llama3")  # model.rope_scaling


def default_config() -> ConfigDict:
    """The full schema with defaults. Every config file starts from this."""
    c = ConfigDict()

    c.mesh = ConfigDict({axis.value: 1 for axis in MESH_AXES})  # jaxpar.axes.MeshAxis: one size per axis

    # The layout (jaxpar.layout.ParallelLayout): the mesh axis sizes above and these fields, under the
    # layout's own names. The layout also carries, from other sections, train.seq_len and
    # train.global_batch (the training problem; the layout derives microbatch_size = global_batch /
    # (microbatches * data * expert)) and model.attention / model.attention_block (a kernel choice of
    # the model, which the layout carries to price it).
    c.parallel = ConfigDict()
    c.parallel.zero_stage = 0  # 0 = DP, 1 = optimizer, 2 = + grads, 3 = + params, over `data`
    c.parallel.sequence_parallel = False  # shard norms/residuals over seq on `tensor`
    c.parallel.recompute = "none"  # none | full | selective (keep weight-matmul outputs, recompute attention core)
    c.parallel.microbatches = 1  # gradient accumulation (or pipeline) microbatches per optimizer step
    # gpipe | 1f1b | interleaved | zb-h1 | zb-v (zb: backward split into B and W); acts when mesh.pipeline > 1
    c.parallel.pipeline_schedule = "1f1b"
    c.parallel.virtual_stages = 1  # model chunks per pipeline rank (interleaved: >= 2, zb-v: 2)
    c.parallel.layers_per_stage = ""  # uneven stages: layers of each stage, e.g. "1,2,1" (empty: even)
    c.parallel.first_stage_layers = 0  # layers of the first stage, the rest split evenly (0: not set)
    c.parallel.last_stage_layers = 0  # layers of the last stage (0: not set)
    c.parallel.context_exchange = "ring"  # mesh.context > 1: ring (ppermute K/V) | all_gather (gather K/V)
    c.parallel.grad_reduce_dtype = "float32"  # gradient reduction over `data` (ZeRO 0-2); ZeRO-3
    # gathers parameters and reduce-scatters their gradients in model.compute_dtype (FSDP-style)
    c.parallel.max_replicated_fraction = 0.05  # ZeRO-3 guard: share of param bytes replicated
    c.parallel.cross_node_tensor = False  # allow tensor x context groups that span nodes (slow links)

    c.model = ConfigDict()
    c.model.name = "llama"
    c.model.vocab_size = 256
    c.model.embed_dim = 128
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.num_kv_heads = 4
    c.model.head_dim = 32
    c.model.mlp_dim = 384
    c.model.max_seq_len = 256
    c.model.rope_theta = 10000.0
    # RoPE frequency scaling: none | llama3 (Llama 3.1's: jaxpar.models.llama.rope_frequencies); the four
    # fields below act only with llama3, their defaults are Llama 3.1's
    c.model.rope_scaling = "none"
    c.model.rope_scaling_factor = 8.0  # the lowest frequencies are divided by it
    c.model.rope_low_freq_factor = 1.0  # wavelengths above rope_original_max_seq_len / this are scaled
    c.model.rope_high_freq_factor = 4.0  # wavelengths below rope_original_max_seq_len / this are kept
    c.model.rope_original_max_seq_len = 8192  # the context length the unscaled model was trained at
    c.model.norm_eps = 1e-5
    c.model.tie_embeddings = False
    c.model.mlp_activation = "swiglu"  # swiglu | gelu (classic GPT)
    c.model.norm = "rmsnorm"  # rmsnorm | layernorm (classic GPT)
    c.model.position = "rope"  # rope | learned (classic GPT)
    # auto: cudnn on an NVIDIA GPU whose kernel takes the shapes, else blockwise (and always with
    # mesh.context > 1) | dot_product (s x s scores, the reference) | blockwise (flash, any backend) | cudnn
    c.model.attention = "auto"
    c.model.attention_block = 512  # blockwise: query and key/value block length
    c.model.attention_mask = "causal"  # causal | block_causal (also never across documents: torchtitan's)
    c.model.eos_token_id = -1  # block_causal: the token ending each packed document (-1: unset, refused)
    c.model.compute_dtype = "bfloat16"
    c.model.param_dtype = "float32"  # master parameters
    c.model.init_std = 0.02
    c.model.dropout = 0.0  # hidden dropout (embedding output, attention and MLP branches); 0: off (jaxpar.ops.dropout)
    c.model.attention_dropout = 0.0  # dropout on the softmax probabilities; 0: off
    c.model.qk_norm = False  # RMSNorm of each query and key head before RoPE (Qwen3; Dehghani et al. 2023)
    # mixture of experts (jaxpar.models.moe): every layer's MLP is num_experts SwiGLU experts of mlp_dim
    c.model.num_experts = 0  # 0: a dense MLP in every layer
    c.model.experts_per_token = 2  # top-k experts each token runs through
    c.model.router_score = "softmax"  # softmax (Mixtral, Qwen3-MoE) | sigmoid (DeepSeek-V3)
    c.model.router_norm_topk = True  # renormalise the top-k weights to sum 1
    c.model.moe_aux_loss_coeff = 0.0  # Switch load-balancing loss weight (Megatron --moe-aux-loss-coeff)
    c.model.moe_z_loss_coeff = 0.0  # router z-loss weight (Megatron --moe-z-loss-coeff)
    c.model.shared_expert_dim = 0  # width of a shared expert every token runs through; 0: none
    c.model.moe_dispatch = "grouped"  # grouped (ragged_dot over the routed tokens) | dense (every expert, every token)
    c.model.moe_capacity_factor = 0.0  # 0: dropless; else per-expert capacity per sequence (token dropping)
    # DeepSeek-V3 (model.name=deepseek_v3 only; jaxpar.models.deepseek): MLA, DeepSeekMoE routing
    c.model.q_lora_rank = 0  # query latent width; 0: a full-rank query projection
    c.model.kv_lora_rank = 0  # key/value latent width (MLA); 0: no MLA
    c.model.qk_nope_head_dim = 0  # per-head query/key dims without RoPE
    c.model.qk_rope_head_dim = 0  # per-head query/key dims with RoPE (one shared rotary key)
    c.model.v_head_dim = 0  # per-head value dims
    c.model.first_dense_layers = 0  # the first layers have a dense MLP of mlp_dim (first_k_dense_replace)
    c.model.moe_mlp_dim = 0  # expert width of deepseek_v3 (moe_intermediate_size)
    c.model.router_groups = 1  # group-limited routing: experts in this many groups (n_group)
    c.model.router_group_topk = 1  # only the best this many groups are eligible (topk_group)
    c.model.router_scale = 1.0  # combine weights times this (routed_scaling_factor)
    c.model.router_bias_rate = 0.0  # aux-loss-free balancing: bias += rate * sign(mean load - load) per step

    c.optim = ConfigDict()
    c.optim.name = "adamw"  # adamw | lion | sgd | adafactor | muon | path/to/file.py:fn (jaxpar.optim.registry)
    c.optim.lr = 3e-3  # peak learning rate
    c.optim.min_lr_ratio = 0.1  # end of cosine decay, as a fraction of lr
    c.optim.warmup_steps = 20
    c.optim.decay_steps = -1  # -1: decay over train.steps
    c.optim.schedule = "cosine"  # decay after warmup: cosine | linear | constant | inverse_sqrt
    c.optim.warmup_type = "linear"  # linear | log (DeepSpeed's default warmup)
    c.optim.warmup_init_lr = 0.0  # absolute learning rate at the start of warmup
    c.optim.schedule_offset = 0  # evaluate the curve at max(k - offset, 0) (DeepSpeed ports: 1)
    c.optim.decay_start_step = -1  # where decay progress is 0; -1: at the end of warmup
    c.optim.b1 = 0.9
    c.optim.b2 = 0.95
    c.optim.eps = 1e-8
    c.optim.weight_decay = 0.1  # not applied to norms (1-D params)
    c.optim.decoupled_weight_decay = True  # AdamW; False = L2 added to the gradient (Adam)
    c.optim.clip_norm = 1.0  # global-norm clipping; 0 disables
    c.optim.momentum = -1.0  # sgd momentum, muon's beta, adafactor's momentum (0: none); -1: 0.9 / 0.95 / none
    c.optim.nesterov = False  # sgd, muon

    c.train = ConfigDict()
    c.train.steps = 300
    c.train.global_batch = 16  # sequences per optimizer step
    c.train.seq_len = 256
    c.train.seed = 0
    c.train.workdir = "runs/default"
    c.train.log_every = 10
    c.train.eval_every = 0  # 0: evaluate only at start and end
    c.train.eval_batches = 8  # 0: no validation (nothing evaluated at start or end; eval_every must be 0)
    c.train.resume = "auto"  # auto | never (refused over checkpoints) | restart (delete them, start over) | a step
    c.train.init_from = ""  # HF LLaMA weights (dir, .safetensors, .index.json, torch file) when nothing resumes
    c.train.warmup_steps_excluded = 3  # first steps excluded from steady-state throughput (the first always is)
    c.train.spike_factor = 5.0  # skip an update whose loss exceeds this x the running median (0: off)
    c.train.max_bad_steps = 3  # consecutive skipped steps before rolling back to the last checkpoint
    c.train.inject_bad_steps = ""  # fault drills: comma-separated batch numbers (from 1) whose loss is made NaN
    c.train.profile_steps = ""  # "a,b": jax.profiler trace of steps a..b (from 1) into <workdir>/profile
    # fp16 loss scaling (jaxpar.train.loss_scale); acts only with model.compute_dtype=float16
    c.train.loss_scale = ConfigDict()
    c.train.loss_scale.static = 0.0  # > 0: this fixed scale; 0: dynamic, from 2**initial_scale_power
    c.train.loss_scale.initial_scale_power = 16
    c.train.loss_scale.window = 1000  # good steps before the scale doubles
    c.train.loss_scale.hysteresis = 2  # overflowing steps before the scale halves
    c.train.loss_scale.min_scale = 1.0
    c.train.loss_scale.consecutive_hysteresis = False  # deepspeed rule: every good step refills the hysteresis
    c.train.loss_scale.rule = "deepspeed"  # deepspeed | megatron: when the scale grows (jaxpar.train.loss_scale)

    c.data = ConfigDict()
    c.data.source = "stdlib"  # stdlib | synthetic | bin | megatron
    c.data.path = ""  # .bin token file or Megatron prefix (without .bin/.idx)
    c.data.token_dtype = "uint16"  # for source=bin
    c.data.val_fraction = 0.05  # share of files (stdlib) or tokens (bin) held out

    c.checkpoint = ConfigDict()
    c.checkpoint.every = 0  # 0: never
    c.checkpoint.keep = 3
    return c
