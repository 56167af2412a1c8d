"""What the Megatron importer does with each flag: the tables of no-op, unsupported and model flags,
the scripts it ports, and the parsed flags (:class:`Args`) the mapping code reads and reports through."""

from __future__ import annotations

from typing import Any

from jaxpar.config import ConfigError
from jaxpar.port.bash import Shell, show, unresolved_names
from jaxpar.port.report import (
    LOSS_SCALE_NOOP,
    Report,
)

NOOP_NOTE = "no-op in jaxpar: "
_LAUNCH = NOOP_NOTE + "launcher setting"
PERF = NOOP_NOTE + "kernel/runtime detail that XLA decides"
LOG = NOOP_NOTE + "logging/profiling only; jaxpar logs under train.workdir"
_DATA = NOOP_NOTE + "data loading detail"
_CKPT = NOOP_NOTE + "checkpoint detail; orbax saves sharded checkpoints under train.workdir"
_OTHER = (
    NOOP_NOTE + "read only by Megatron-LM's BERT / T5 / RETRO / ICT / vision scripts (which jaxpar port refuses "
    "by script name); pretrain_gpt.py ignores it"
)
_INFER = NOOP_NOTE + "inference / text generation only"
_UNREAD = NOOP_NOTE + "Megatron-LM's parser accepts it but no code reads it"
_CHECK = NOOP_NOTE + "a runtime check that stops or reports on a fault; it does not change what is trained"
TB = (
    "jaxpar always writes TensorBoard event files into train.workdir, every step: loss, grad norm, lr, step "
    "time, tokens/s, MFU (and validation at each evaluation)"
)
TENSORBOARD_FLAGS = (
    "--log-timers-to-tensorboard",
    "--log-batch-size-to-tensorboard",
    "--log-validation-ppl-to-tensorboard",
    "--log-memory-to-tensorboard",
    "--log-world-size-to-tensorboard",
    "--tensorboard-queue-size",
    "--tensorboard-log-interval",
)
NOOP = {
    **dict.fromkeys(
        ("--fsdp-double-buffer", "--fsdp-manual-registration", "--use-nccl-ub", "--init-model-with-meta-device"),
        "no-op in jaxpar: Megatron-FSDP buffer / communication / initialization detail (speed and memory only)",
    ),
    **dict.fromkeys(
        (
            "--node_rank",
            "--master_addr",
            "--master_port",
            "--rdzv_endpoint",
            "--rdzv_backend",
            "--rdzv_id",
            "--max_restarts",
            "--tee",
            "--wait",
            "--kill-on-bad-exit",
            "--standalone",
            "--node-rank",
            "--master-addr",
            "--master-port",
        ),
        _LAUNCH,
    ),
    **dict.fromkeys(
        (
            "--use-mcore-models",
            "--attention-backend",
            "--use-flash-attn",
            "--no-masked-softmax-fusion",
            "--no-bias-gelu-fusion",
            "--no-bias-dropout-fusion",
            "--no-gradient-accumulation-fusion",
            "--cross-entropy-loss-fusion",
            "--manual-gc",
            "--manual-gc-interval",
            "--empty-unused-memory-level",
            "--overlap-grad-reduce",
            "--overlap-param-gather",
            "--tp-comm-overlap",
            "--DDP-impl",
            "--distributed-backend",
            "--distributed-timeout-minutes",
            "--exit-duration-in-mins",
            "--exit-interval",
            "--abort-on-unmet-fused-kernel-constraints",
            "--kill-switch-path",
            "--no-query-key-layer-scaling",
            "--no-async-tensor-model-parallel-allreduce",
            "--apply-query-key-layer-scaling",
            "--attention-softmax-in-fp32",
            "--no-position-embedding",
            "--use-legacy-models",
        ),
        PERF,
    ),
    **dict.fromkeys(
        ("--loss-scale", "--initial-loss-scale", "--min-loss-scale", "--loss-scale-window", "--hysteresis"),
        LOSS_SCALE_NOOP,
    ),
    **dict.fromkeys(
        (
            "--log-throughput",
            "--log-params-norm",
            "--log-num-zeros-in-grad",
            "--wandb-project",
            "--wandb-exp-name",
            "--wandb-save-dir",
            "--timing-log-level",
            "--log-progress",
        ),
        LOG,
    ),
    **dict.fromkeys(
        (
            "--num-workers",
            "--valid-num-workers",
            "--data-impl",
            "--dataloader-type",
            "--no-create-attention-mask-in-dataloader",
            "--tokenizer-model",
            "--tokenizer-name-or-path",
            "--vocab-file",
            "--merge-file",
            "--data-cache-path",
        ),
        _DATA,
    ),
    **dict.fromkeys(
        (
            "--ckpt-format",
            "--no-load-optim",
            "--no-load-rng",
            "--no-save-optim",
            "--no-save-rng",
            "--use-checkpoint-args",
            "--async-save",
            "--finetune",
        ),
        _CKPT,
    ),
    **dict.fromkeys(
        (
            "--output-bert-embeddings",
            "--bert-no-binary-head",
            "--retro-project-dir",
            "--retro-cyclic-train-iters",
            "--retro-encoder-layers",
            "--retro-encoder-hidden-dropout",
            "--retro-encoder-attention-dropout",
            "--retro-num-neighbors",
            "--retro-num-retrieved-chunks",
            "--retro-attention-gate",
            "--retro-no-verify-neighbor-count",
            "--decoder-num-layers",
            "--decoder-seq-length",
            "--pipeline-model-parallel-split-rank",
            "--mask-prob",
            "--short-seq-prob",
            "--ict-head-size",
            "--biencoder-projection-dim",
            "--biencoder-shared-query-context-model",
            "--ict-load",
            "--bert-load",
            "--titles-data-path",
            "--query-in-block-prob",
            "--use-one-sent-docs",
            "--evidence-data-path",
            "--retriever-report-topk-accuracies",
            "--retriever-score-scaling",
            "--retriever-seq-length",
            "--sample-rate",
            "--embedding-path",
            "--indexer-batch-size",
            "--indexer-log-interval",
            "--num-classes",
            "--img-h",
            "--img-w",
            "--num-channels",
            "--patch-dim",
            "--classes-fraction",
            "--data-per-class-fraction",
            "--head-lr-mult",
            "--vision-pretraining",
            "--vision-pretraining-type",
            "--vision-backbone-type",
            "--swin-backbone-type",
            "--mask-type",
            "--mask-factor",
            "--iter-per-epoch",
            "--dino-local-img-size",
            "--dino-local-crops-number",
            "--dino-head-hidden-size",
            "--dino-bottleneck-size",
            "--dino-freeze-last-layer",
            "--dino-norm-last-layer",
            "--dino-warmup-teacher-temp",
            "--dino-teacher-temp",
            "--dino-warmup-teacher-temp-epochs",
        ),
        _OTHER,
    ),
    **dict.fromkeys(("--inference-batch-times-seqlen-threshold", "--max-tokens-to-oom"), _INFER),
    **dict.fromkeys(
        (
            "--bert-embedder-type",
            "--init-method-xavier-uniform",
            "--no-scatter-gather-tensors-in-pipeline",
            "--block-data-path",
        ),
        _UNREAD,
    ),
    **dict.fromkeys(
        (
            "--transformer-impl",
            "--onnx-safe",
            "--no-clone-scatter-output-in-embedding",
            "--tp-comm-overlap-cfg",
            "--disable-tp-comm-overlap-ag",
            "--disable-tp-comm-overlap-rs",
            "--tp-comm-overlap-rs-dgrad",
            "--disable-tp-comm-bulk-dgrad",
            "--disable-tp-comm-bulk-wgrad",
            "--disable-tp-comm-split-ag",
            "--disable-tp-comm-split-rs",
            "--no-bias-swiglu-fusion",
            "--no-rope-fusion",
            "--no-persist-layer-norm",
            "--no-manual-gc-eval",
            "--no-overlap-p2p-communication",
            "--no-delay-grad-reduce",
            "--ddp-bucket-size",
            "--ddp-average-in-collective",
            "--delay-param-gather",
            "--use-ring-exchange-p2p",
            "--nccl-communicator-config-path",
            "--use-tp-pp-dp-mapping",
        ),
        PERF,
    ),
    **dict.fromkeys(
        (
            "--log-straggler",
            "--disable-straggler-on-startup",
            "--straggler-ctrlr-port",
            "--straggler-minmax-count",
            "--no-barrier-with-level-1-timing",
            "--timing-log-option",
            "--no-log-learnig-rate-to-tensorboard",
            "--no-log-loss-scale-to-tensorboard",
            "--enable-one-logger",
            "--one-logger-project",
            "--one-logger-entity",
            "--one-logger-run-name",
            "--logging-level",
        ),
        LOG,
    ),
    **dict.fromkeys(("--local_rank", "--lazy-mpu-init", "--adlr-autoresume", "--adlr-autoresume-interval"), _LAUNCH),
    **dict.fromkeys(("--no-mmap-bin-files", "--num-dataset-builder-threads", "--no-data-sharding"), _DATA),
    **dict.fromkeys(
        (
            "--override-opt_param-scheduler",
            "--use-checkpoint-opt_param-scheduler",
            "--ckpt-step",
            "--no-initialization",
            "--exit-on-missing-checkpoint",
            "--exit-signal-handler",
            "--use-dist-ckpt",
            "--auto-detect-ckpt-format",
            "--dist-ckpt-format",
            "--ckpt-fully-parallel-save",
            "--ckpt-fully-parallel-load",
            "--ckpt-assume-constant-structure",
        ),
        _CKPT,
    ),
    **dict.fromkeys(
        ("--check-weight-hash-across-dp-replicas-interval", "--test-mode", "--no-check-for-nan-in-loss-and-grad"),
        _CHECK,
    ),
    "--use-cpu-initialization": NOOP_NOTE + "where the initial weights are computed; jaxpar initializes each shard on "
    "its device from train.seed",
    "--weight-decay-incr-style": NOOP_NOTE + "no effect unless --start-weight-decay differs from --end-weight-decay "
    "(then unsupported: jaxpar keeps weight decay constant)",
    "--sgd-momentum": NOOP_NOTE + "read only with --optimizer sgd (this port maps Adam only: see --optimizer)",
    "--rotary-interleaved": NOOP_NOTE + "interleaved and half-split rotary pairs differ by a fixed permutation of the "
    "query/key projection columns, which training from initialization absorbs (checkpoint layouts differ)",
}
_MOE = "mixture-of-experts setting this port does not map (jaxpar.models.moe has no counterpart); left out"
UNSUPPORTED = {
    "--train-weighted-split-paths-path": "no weighted multi-split data files; set data.path to one Megatron prefix",
    "--valid-weighted-split-paths-path": "no weighted multi-split data files",
    "--decoupled-lr": "one learning rate for all parameters in jaxpar (no separate embedding/output lr)",
    "--decoupled-min-lr": "one learning rate for all parameters in jaxpar",
    "--distribute-saved-activations": "saved activations are not split over tensor ranks; nearest: sequence parallel",
    **dict.fromkeys(
        (
            "--fp8-format",
            "--fp8-recipe",
            "--fp8-margin",
            "--fp8-amax-history-len",
            "--fp8-param-gather",
            "--fp8-amax-compute-algo",
        ),
        "no fp8 training in jaxpar",
    ),
    **dict.fromkeys(("--fp8-interval", "--no-fp8-wgrad"), "no fp8 training in jaxpar"),
    **dict.fromkeys(
        ("--train-data-path", "--valid-data-path", "--test-data-path"),
        "no separate train/valid/test datasets; set data.path to one Megatron prefix",
    ),
    "--batch-size": "Megatron-LM stops on it (no longer valid); use --micro-batch-size",
    "--warmup": "Megatron-LM stops on it (no longer valid); use --lr-warmup-fraction or --lr-warmup-iters",
    "--model-parallel-size": "Megatron-LM stops on it (no longer valid); use --tensor-model-parallel-size",
    "--encoder-num-layers": "Megatron-LM's other name for --num-layers (it stops when both are given); write "
    "--num-layers",
    "--encoder-seq-length": "Megatron-LM's other name for --seq-length (it stops when both are given); write "
    "--seq-length",
    "--vocab-extra-ids": "extra vocabulary tokens added by the BertWordPiece / SentencePiece tokenizers are not "
    "counted in model.vocab_size (0 adds none); set --set model.vocab_size=N",
    "--fp32-residual-connection": "jaxpar does not force the residual stream to float32 (a precision change)",
    "--fp16-lm-cross-entropy": "jaxpar computes the cross entropy in float32 (a precision change)",
    "--standalone-embedding-stage": "jaxpar keeps the embedding with the first pipeline stage's layers, no stage of "
    "its own (a speed/memory change)",
    "--data-parallel-random-init": "jaxpar initializes every data replica identically from train.seed",
    "--deterministic-mode": "jaxpar does not force deterministic kernels; set "
    "XLA_FLAGS=--xla_gpu_deterministic_ops=true",
    "--pretrained-checkpoint": "jaxpar does not load Megatron checkpoints; convert them to Hugging Face "
    "format, which jaxpar.port.weights loads",
}
# flags that make the recipe's model one jaxpar does not compute: flag -> what differs (a model change)
MODEL_FLAGS = {
    "--embed-layernorm": "a layer norm after the embedding (BLOOM); jaxpar's models have none",
    "--squared-relu": "a squared-ReLU MLP; jaxpar's MLPs are SwiGLU or GeLU",
    "--qk-layernorm": "queries and keys normalized per head (QK layer norm); jaxpar's is an RMSNorm in the qwen3 "
    "and qwen3_moe blocks only (--normalization RMSNorm, --swiglu, RoPE; experts: softmax router, no shared expert)",
    "--add-qkv-bias": "biases on the query/key/value projections; jaxpar's linear layers have none",
    "--multi-latent-attention": "multi-head latent attention (DeepSeek's MLA) in a dense model; jaxpar's MLA is "
    "in its deepseek_v3 family, whose MLPs are experts (--num-experts > 1), and its dense families' attention is "
    "multi-head / grouped-query",
    "--mtp-num-layers": "multi-token prediction (extra MTP layers and their loss); jaxpar predicts the next token",
    "--window-size": "sliding-window attention; jaxpar's attention sees the whole causal context",
    "--apply-residual-connection-post-layernorm": "residuals taken after the layer norm; jaxpar's blocks are pre-norm",
    "--rotary-scaling-factor": "scaled RoPE (YaRN); jaxpar's RoPE is plain or Llama 3.1's (--use-rope-scaling)",
    "--rotary-seq-len-interpolation-factor": "interpolated RoPE positions; jaxpar's RoPE is plain or Llama 3.1's "
    "(--use-rope-scaling)",
    "--quick-geglu": "a quick-GeLU gated MLP (gpt-oss); jaxpar's MLPs are SwiGLU or GeLU",
    "--enable-gpt-oss": "gpt-oss's block (attention sinks, clamped gated MLP, alternating sliding windows)",
    "--retro-add-retriever": "a RETRO retriever (chunked cross-attention to retrieved neighbours); jaxpar's blocks "
    "have none",
    "--reset-position-ids": "positions restart after each end-of-document token; jaxpar numbers the whole sequence",
    "--reset-attention-mask": "attention stops at each end-of-document token where Megatron's attention applies "
    "the dataloader's mask (its local transformer does; Transformer Engine's and flash attention's causal kernels "
    "ignore it: NVIDIA/Megatron-LM#2357, #415), and which backend ran is not in the recipe",
    "--eod-mask-loss": "no loss on end-of-document tokens; jaxpar's loss counts every token",
    "--spec": "a model built from the Python layer spec it names, which this port cannot read (for Megatron's "
    "standard GPT spec, --approximate ports the model the other flags describe)",
    "--yaml-cfg": "the arguments come from a YAML file this port does not read; write them as flags",
    "--skip-train": "no training (evaluation only): there is no training run to port",
}
# model changes above that jaxpar can train once the user says how: flag -> (fix, the fields that resolve it)
MODEL_FLAG_FIXES = {
    "--reset-attention-mask": (
        "give --set model.attention_mask=block_causal --set model.eos_token_id=<the tokenizer's end-of-document id: "
        "N for NullTokenizer --vocab-size N, 50256 for GPT-2 BPE> where Megatron masked, or --set "
        "model.attention_mask=causal where its kernel did not",
        ("model.attention_mask",),
    ),
}
# settings of a model change above: reported with it, not separately refused
MODEL_PARTS = {
    **dict.fromkeys(
        (
            "--q-lora-rank",
            "--kv-lora-rank",
            "--qk-head-dim",
            "--qk-pos-emb-head-dim",
            "--v-head-dim",
            "--mscale",
            "--mscale-all-dim",
            "--beta-fast",
            "--beta-slow",
            "--original-max-position-embeddings",
        ),
        "multi-head latent attention / YaRN setting (see --multi-latent-attention)",
    ),
    "--mtp-loss-scaling-factor": "multi-token prediction setting (see --mtp-num-layers)",
    **dict.fromkeys(
        ("--glu-linear-offset", "--activation-func-clamp-value", "--window-attn-skip-freq"),
        "gpt-oss block setting (see --enable-gpt-oss, --quick-geglu, --window-size)",
    ),
}
# the training scripts of Megatron-LM / Megatron-DeepSpeed that are not decoder-only language models
OTHER_SCRIPTS = {
    "pretrain_bert.py": "BERT (a bidirectional encoder trained with masked-LM and sentence-order losses)",
    "pretrain_t5.py": "T5 (an encoder-decoder)",
    "pretrain_mamba.py": "a Mamba / hybrid state-space model",
    "pretrain_hybrid.py": "a hybrid Mamba model (state-space layers mixed with attention)",
    "pretrain_vlm.py": "a vision-language model",
    "train.py": "a vision-language model (examples/multimodal)",
    "pretrain_ict.py": "an ICT retriever (two BERT encoders)",
    "pretrain_retro.py": "RETRO (retrieval with chunked cross-attention)",
    "pretrain_vision_classify.py": "a vision transformer classifier",
    "pretrain_vision_dino.py": "a vision transformer (DINO)",
    "pretrain_vision_inpaint.py": "a vision transformer (inpainting)",
}
LM_SCRIPTS = ("pretrain_gpt.py", "finetune_gpt.py")  # finetune_gpt.py: examples/detxoify_lm, GPT fine-tuning
# Pai-Megatron-Patch's examples/qwen3/pretrain_qwen.py (alibaba/Pai-Megatron-Patch at 7a91081): Megatron's GPTModel
# from core_transformer_config_from_args, as pretrain_gpt.py; with --dataset MMAP and --train-mode pretrain
# (megatron_patch/data, template/helper.py) its batches come from Megatron's GPTDataset and its loss is the
# next-token cross entropy averaged over the loss mask's tokens, as pretrain_gpt.py's. Script -> the values of
# PAI_FLAGS (flags megatron_patch/arguments.py adds) that make it so.
PAI_FLAGS = ("--patch-tokenizer-type", "--dataset", "--train-mode")
PAI_SCRIPTS = {"pretrain_qwen.py": ("Qwen3Tokenizer", "MMAP", "pretrain")}
KNOWN = (*NOOP, *UNSUPPORTED, *MODEL_FLAGS, *MODEL_PARTS)  # plus every flag the mapping code reads (Args.known)
TOKENIZER_VOCAB = {"GPT2BPETokenizer": 50257, "Llama2Tokenizer": 32000}


class Args:
    """Parsed flags with typed access; remembers what was read, reported and left unresolved."""

    def __init__(self, flags: list[tuple[str, list[str]]], shell: Shell, report: Report) -> None:
        self.flags: dict[str, list[str]] = {}
        self.dups: set[str] = set()
        for name, values in flags:
            if name in self.flags:
                self.dups.add(name)
            self.flags[name] = values
        self.shell, self.report = shell, report
        self.reported: set[str] = set()
        self.known: set[str] = set()  # flags the mapping code reads or reports
        self.unresolved: dict[str, list[str]] = {}
        self.pai = False  # Pai-Megatron-Patch's pretrain_qwen.py, ported as pretrain_gpt.py (_pai_script)

    def has(self, name: str) -> bool:
        return name in self.flags

    def get(self, name: str, kind: type = str, default: Any = None, soft: bool = False) -> Any:
        """The flag's value as ``kind``; ``default`` when absent or (``soft``) unresolved."""
        self.known.add(name)
        if name not in self.flags:
            return default
        text = " ".join(self.flags[name])
        missing = unresolved_names(text)
        if missing:
            if not soft:
                for var in missing:
                    self.unresolved.setdefault(var, []).append(name)
            return default
        if kind is bool:
            return True
        if not text:
            raise ConfigError(f"megatron: {name} needs a value; give it one or drop the flag")
        try:
            return kind(text)
        except ValueError:
            raise ConfigError(f"megatron: {name} {text!r} is not a valid {kind.__name__}; fix the value") from None

    def note(self, name: str, status: str, target: str = "", note: str = "") -> None:
        """Report flag ``name`` (only if given) under ``status``."""
        self.known.add(name)
        if name in self.flags and name not in self.reported:
            self.reported.add(name)
            value = show(" ".join(self.flags[name])) or True
            if name in self.dups:
                note = (note + "; " if note else "") + "given more than once: the last value wins, as in argparse"
            self.report.add(name, value, status, target, note)

    def model_change(self, name: str, why: str, fix: str = "", needs: tuple[str, ...] = ()) -> None:
        """Report flag ``name`` (only if given) as a model change (``needs``: the fields that resolve it)."""
        self.known.add(name)
        if name in self.flags and name not in self.reported:
            self.reported.add(name)
            self.report.model_change(name, show(" ".join(self.flags[name])) or True, why, fix, needs=needs)

    def finish(self) -> None:
        """Report every flag nobody reported: no-op, unsupported, MoE, or unknown."""
        for name in self.flags:
            if name in self.reported:
                continue
            if name in NOOP:
                self.note(name, "approximated", "", NOOP[name])
            elif name in UNSUPPORTED:
                self.note(name, "unsupported", "", UNSUPPORTED[name])
            elif name in MODEL_PARTS:
                self.note(name, "unsupported", "", MODEL_PARTS[name])
            elif name.startswith(("--moe-", "--expert-")) or name == "--num-experts":
                self.note(name, "unsupported", "", _MOE)
            elif name in self.known:
                self.note(name, "mapped", "", "read with the flags it depends on")
            else:
                self.reported.add(name)
                self.report.unknown(
                    name, show(" ".join(self.flags[name])) or True, [*KNOWN, *self.known], "Megatron-LM"
                )
