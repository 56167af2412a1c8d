"""Import a Megatron-LM (or Megatron-DeepSpeed) launch recipe into a jaxpar config, with a report.

Input: the ``.args`` format (shell assignments, a ``# flags`` line, then one flag per line; examples
in ``tests/fixtures/recipes/megatron``) or a raw launch script (assignments, then the command running
``pretrain_*.py``). Variables expand as bash would (``--var NAME=VALUE`` wins over the
script); a variable a *needed* flag uses but nobody sets stops the port with one line naming it.

Megatron arithmetic reproduced: DP = world / (TP * PP * CP); microbatches = GBS / (MBS * DP);
SwiGLU's default FFN size ``int(4h * 2/3 / 64) * 64``; sequence parallel off at TP = 1; the
LR schedule counts samples (``num_steps`` grows by the global batch after each update), so
sample-based settings become fractional steps ``samples / GBS``.
"""

from __future__ import annotations

import ast
import math
import pathlib
import re
from typing import Any

from jaxpar import files
from jaxpar.config import ConfigDict, ConfigError
from jaxpar.port import megatron_log
from jaxpar.port.bash import Shell, launch_flags, show, unresolved_names
from jaxpar.port.report import (
    LOSS_SCALE_NOOP,
    Report,
    apply_schedule_fields,
    build_config,
    refuse_model_changes,
)

_NOOP = "no-op in jaxpar: "
_LAUNCH = _NOOP + "launcher setting"
_PERF = _NOOP + "kernel/runtime detail that XLA decides"
_LOG = _NOOP + "logging/profiling only; jaxpar logs under train.workdir"
_DATA = _NOOP + "data loading detail"
_CKPT = _NOOP + "checkpoint detail; orbax saves sharded checkpoints under train.workdir"
_OTHER = (
    _NOOP + "read only by Megatron-LM's BERT / T5 / RETRO / ICT / vision scripts (which jaxpar port refuses "
    "by script name); pretrain_gpt.py ignores it"
)
_INFER = _NOOP + "inference / text generation only"
_UNREAD = _NOOP + "Megatron-LM's parser accepts it but no code reads it"
_CHECK = _NOOP + "a runtime check that stops or reports on a fault; it does not change what is trained"
_TB = (
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
        _PERF,
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
        _LOG,
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
        _PERF,
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
        _LOG,
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
    "--use-cpu-initialization": _NOOP + "where the initial weights are computed; jaxpar initializes each shard on "
    "its device from train.seed",
    "--weight-decay-incr-style": _NOOP + "no effect unless --start-weight-decay differs from --end-weight-decay "
    "(then unsupported: jaxpar keeps weight decay constant)",
    "--sgd-momentum": _NOOP + "read only with --optimizer sgd (this port maps Adam only: see --optimizer)",
    "--rotary-interleaved": _NOOP + "interleaved and half-split rotary pairs differ by a fixed permutation of the "
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
    "--reset-attention-mask": "attention stops at each end-of-document token; jaxpar attends across documents",
    "--eod-mask-loss": "no loss on end-of-document tokens; jaxpar's loss counts every token",
    "--spec": "a model built from the Python layer spec it names, which this port cannot read (for Megatron's "
    "standard GPT spec, --approximate ports the model the other flags describe)",
    "--yaml-cfg": "the arguments come from a YAML file this port does not read; write them as flags",
    "--skip-train": "no training (evaluation only): there is no training run to port",
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
KNOWN = (*NOOP, *UNSUPPORTED, *MODEL_FLAGS, *MODEL_PARTS)  # plus every flag the mapping code reads (_Args.known)
TOKENIZER_VOCAB = {"GPT2BPETokenizer": 50257, "Llama2Tokenizer": 32000}


class _Args:
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

    def model_change(self, name: str, why: str, fix: str = "") -> None:
        """Report flag ``name`` (only if given) as a model change."""
        self.known.add(name)
        if name in self.flags and name not in self.reported:
            self.reported.add(name)
            self.report.model_change(name, show(" ".join(self.flags[name])) or True, why, fix)

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


def port_megatron(
    path_or_text: str | pathlib.Path,
    *,
    variables: dict[str, str] | None = None,
    world_size: int | None = None,
    allow_unresolved: bool = False,
    approximate: bool | None = None,
) -> tuple[ConfigDict, Report]:
    """Port a Megatron recipe (path, or the text itself) to ``(config, report)``.

    ``variables`` set shell variables (they win over the script's assignments); ``world_size``
    overrides the launcher's ``--nproc_per_node * --nnodes``. Raises :class:`ConfigError` (one
    line) for unresolved variables that mapped flags need, or inconsistent sizes.

    What jaxpar cannot train as the recipe's model is a model change in the report
    (:data:`MODEL_FLAGS`, positions, biases, the vocabulary, a script that is not ``pretrain_gpt.py``);
    ``approximate=False`` refuses the ones no ``--set`` resolves at once, before asking for anything
    else; None leaves the decision to the caller (:func:`jaxpar.port.recipe.port_recipe`), except
    for a script that trains no decoder language model, refused unless ``approximate``.
    """
    text, source = _read(path_or_text)
    shell = Shell(variables)
    report = Report("megatron", source)
    if megatron_log.is_log(text):  # a training log's printed arguments (jaxpar.port.megatron_log)
        flags, logged_world, shell.script = megatron_log.read(text, report)
        world_size = world_size or logged_world
    else:
        flags = _flags(text, shell, report)
    a = _Args(flags, shell, report)
    values: dict[str, Any] = {}
    script = shell.script or ""
    pai = _pai_script(a, script) if script in PAI_SCRIPTS else None
    if script and script not in LM_SCRIPTS and pai != "":
        what = pai or OTHER_SCRIPTS.get(script, "a model other than a decoder-only language model")
        report.model_change(
            "(training script)",
            script,
            f"{script} trains {what}; jaxpar trains decoder-only language models (Megatron's pretrain_gpt.py)",
            target="model.*",
        )
        if not approximate:
            refuse_model_changes(report, "megatron", approximate=False, final=True)
        if a.has("--encoder-num-layers") and not a.has("--num-layers"):
            a.flags["--num-layers"] = a.flags["--encoder-num-layers"]
    sizes = _sizes(a, shell, world_size)
    mla = a.get("--multi-latent-attention", bool, False) and bool(_experts(a))
    if mla:
        a.note("--kv-channels", "approximated", "", _NOOP + "MLA's head dims are --qk-head-dim, --v-head-dim")
    layers = _model(a, values)
    if mla:
        _mla(a, values)
    _model_changes(a)
    sizes["ep"] = _moe(a, values, sizes, approximate is True)
    if approximate is False:
        refuse_model_changes(report, "megatron", approximate=False, final=True)
    _optim(a, values, sizes)
    _misc(a, values)
    _observability(a, values)
    _check_resolved(a, shell, allow_unresolved)
    _layout(a, values, sizes, layers)
    _check_resolved(a, shell, allow_unresolved)  # a flag of the layout followed by an unset variable's marker
    a.finish()
    unused = [n for n in (variables or {}) if n not in shell.read and n not in SIZE_VARIABLES]
    if unused:
        raise ConfigError(
            f"megatron: --var {unused[0]}: the recipe never uses ${unused[0]}; check the name (case matters) or drop it"
        )
    return build_config(values, report), report


def _check_resolved(a: _Args, shell: Shell, allow_unresolved: bool) -> None:
    if a.unresolved and not allow_unresolved:
        names = ", ".join(
            f"{v} ({shell.why.get(v, 'not set')}; used by {', '.join(dict.fromkeys(fs))})"
            for v, fs in a.unresolved.items()
        )
        raise ConfigError(f"megatron: unresolved shell variables: {names}; pass --var NAME=VALUE for each")


def _pai_script(a: _Args, script: str) -> str:
    """The empty string where Pai-Megatron-Patch's ``script`` ports as ``pretrain_gpt.py`` (:data:`PAI_SCRIPTS`), else
    what it trains instead."""
    want = PAI_SCRIPTS[script]
    got = tuple(a.get(n, str, d, soft=True) for n, d in zip(PAI_FLAGS, (None, None, "pretrain")))
    if got != want:
        shown = " ".join(f"{n} {v}" for n, v in zip(PAI_FLAGS, want))
        given = ", ".join(f"{n} {g}" for n, g in zip(PAI_FLAGS, got))
        return f"Pai-Megatron-Patch's model, ported as Megatron's GPT only with {shown} (given: {given})"
    a.pai = True
    a.note("--patch-tokenizer-type", "mapped", "model.vocab_size", "Pai's Qwen3 tokenizer (see --padded-vocab-size)")
    a.note("--dataset", "mapped", "data.path", "Megatron's GPTDataset over --data-path, as pretrain_gpt.py")
    a.note("--train-mode", "mapped", "", "next-token loss averaged over the loss mask's tokens, as pretrain_gpt.py")
    a.note("--max-padding-length", "approximated", "", _NOOP + "read only by Pai's JSON-SFT dataset, not by MMAP")
    return ""


# variables the world size is read from even when no expansion names them (see _sizes)
SIZE_VARIABLES = ("WORLD_SIZE", "NNODES", "NUM_NODES", "N_NODES", "GPUS_PER_NODE")


def _read(path_or_text: str | pathlib.Path) -> tuple[str, str]:
    text = str(path_or_text)
    if isinstance(path_or_text, pathlib.Path) or ("\n" not in text and not text.lstrip().startswith("--")):
        path = pathlib.Path(path_or_text)
        return files.read_text(path, "recipe", "megatron", "pass a .args recipe or a launch script"), str(path)
    return str(path_or_text), ""


def _flags(text: str, shell: Shell, report: Report) -> list[tuple[str, list[str]]]:
    """Run the assignments and return the flags, reporting repaired lines and stray words."""
    flags, stray, repaired = launch_flags(text, shell)
    if not flags and not stray:
        raise ConfigError(
            "megatron: no '# flags' section and no pretrain_*.py command found; pass a .args recipe "
            "(assignments, a '# flags' line, one flag per line) or the launch script"
        )
    for number, line in repaired:
        report.approximated(f"(line {number})", line, "", "unbalanced quote removed")
    for word in stray:
        report.unknown(word, word, KNOWN, "Megatron-LM")
    return flags


def _sizes(a: _Args, shell: Shell, world_size: int | None) -> dict[str, Any]:
    """Parallel sizes, batch sizes and the world size (None where unresolved)."""
    s = {
        "tp": a.get("--tensor-model-parallel-size", int, 1),
        "pp": a.get("--pipeline-model-parallel-size", int, 1),
        "cp": a.get("--context-parallel-size", int, 1),
        "mbs": a.get("--micro-batch-size", int, 1),
        "gbs": a.get("--global-batch-size", int),
        "world": world_size,
        "how": "--world-size",
    }
    if s["world"] is None and "WORLD_SIZE" in shell.user:
        s["world"], s["how"] = int(shell.user["WORLD_SIZE"]), "--var WORLD_SIZE"
    explicit = s["world"] is not None  # then the launcher sizes are not needed
    nproc = a.get("--nproc_per_node", int, soft=explicit) or a.get("--nproc-per-node", int, soft=explicit)
    nnodes = a.get("--nnodes", str, "1", soft=explicit)
    for name in ("--nproc_per_node", "--nproc-per-node", "--nnodes"):
        a.note(
            name,
            "mapped",
            "mesh.data",
            f"overridden by {s['how']}" if explicit else "world size = --nproc_per_node * --nnodes",
        )
    if s["world"] is None and nproc and nnodes:
        if not nnodes.rsplit(":", 1)[-1].isdigit():
            raise ConfigError(f"megatron: --nnodes {nnodes!r} is not a node count (N or MIN:MAX); fix the value")
        s["world"], s["how"] = nproc * int(nnodes.rsplit(":", 1)[-1]), f"--nproc_per_node {nproc} * --nnodes {nnodes}"
    env = {k: v for k, v in shell.env.items() if not unresolved_names(v)}
    nodes = next((env[k] for k in ("NNODES", "NUM_NODES", "N_NODES") if k in env), None)
    if s["world"] is None and env.get("WORLD_SIZE", "").isdigit():
        s["world"], s["how"] = int(env["WORLD_SIZE"]), "WORLD_SIZE"
    elif s["world"] is None and env.get("GPUS_PER_NODE", "").isdigit() and nodes and nodes.isdigit():
        s["world"], s["how"] = int(env["GPUS_PER_NODE"]) * int(nodes), "GPUS_PER_NODE * NNODES"
    if s["world"] is None and not (a.has("--nnodes") and a.unresolved):
        shell.why["WORLD_SIZE"] = "no --nproc_per_node/--nnodes or GPUS_PER_NODE/NNODES; or pass --world-size N"
        a.unresolved.setdefault("WORLD_SIZE", []).append("DP = world / (TP*PP*CP)")
    return s


def pipeline_layout_counts(text: str, pp: int) -> list[int]:
    """Decoder layers of each stage in a ``--pipeline-model-parallel-layout`` string (Megatron-core's
    ``PipelineParallelLayerLayout``: ``E`` embedding, ``t`` decoder layer, ``L`` loss, ``|`` between
    stages, ``X*n`` and ``(...)*n`` repeats, commas and spaces ignored). Only the simple forms map:
    one stage per rank (no virtual stages), ``E`` only on the first stage and ``L`` only on the last;
    anything else raises a one-line ConfigError naming the flag."""
    flag = f"megatron: --pipeline-model-parallel-layout {text!r}"
    body = text.strip().strip("\"'").replace(",", "").replace(" ", "")
    for _ in range(len(body)):  # innermost first
        expanded = re.sub(r"\(([^()]*)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), body)
        expanded = re.sub(r"([EtLm|])\*(\d+)", lambda m: m.group(1) * int(m.group(2)), expanded)
        if expanded == body:
            break
        body = expanded
    if body.endswith("|"):
        body = body[:-1]
    bad = sorted(set(body) - set("EtL|"))
    if bad:
        what = "a multi-token-prediction layer ('m')" if bad == ["m"] else f"the symbols {''.join(bad)!r}"
        raise ConfigError(f"{flag}: {what} has no jaxpar counterpart; only E, t, L, | and repeats map")
    stages = body.split("|")
    if len(stages) != pp:
        raise ConfigError(
            f"{flag}: {len(stages)} stages for --pipeline-model-parallel-size {pp}; only one stage per rank "
            "maps (jaxpar's virtual stages cut equal chunks); drop the virtual stages from the layout"
        )
    if "E" not in stages[0] or "L" not in stages[-1] or "E" in "".join(stages[1:]) or "L" in "".join(stages[:-1]):
        raise ConfigError(f"{flag}: jaxpar keeps the embedding (E) on the first stage and the loss (L) on the last")
    return [stage.count("t") for stage in stages]


def _uneven_stages(a: _Args, values: dict[str, Any], pp: int, layers: int) -> None:
    """``--decoder-first/last-pipeline-num-layers``, ``--pipeline-model-parallel-layout`` and
    Megatron-DeepSpeed's ``--pp-partition-method``."""
    method = str(a.get("--pp-partition-method", str, "parameters") or "parameters").strip("'\"")
    units = layers + 2  # type:transformer|embedding: the (tied) embedding at each end counts as a layer
    if method == "type:transformer|embedding" and pp > 1 and units % pp == 0:
        ends = units // pp - 1
        values.update({"parallel.first_stage_layers": ends, "parallel.last_stage_layers": ends})
        a.note(
            "--pp-partition-method",
            "mapped",
            "parallel.first_stage_layers, parallel.last_stage_layers",
            f"the embedding counts as a layer on the first and the last stage: {ends} layers there, "
            f"{units // pp} on the others",
        )
    a.note("--pp-partition-method", "approximated", "", "jaxpar splits the layers as evenly as it can over the stages")
    first = a.get("--decoder-first-pipeline-num-layers", int)
    last = a.get("--decoder-last-pipeline-num-layers", int)
    layout = a.get("--pipeline-model-parallel-layout")
    embedding = a.get("--account-for-embedding-in-pipeline-split", bool, False)
    loss = a.get("--account-for-loss-in-pipeline-split", bool, False)
    if (embedding or loss) and pp > 1 and not (first or last):  # Megatron: that stage builds one layer less
        units = layers + embedding + loss
        if units % pp:
            raise ConfigError(
                f"megatron: --num-layers {layers} plus the embedding / loss counted as layers ({units}) is not "
                f"divisible by --pipeline-model-parallel-size {pp}; Megatron refuses it too"
            )
        first = units // pp - 1 if embedding else None
        last = units // pp - 1 if loss else None
    for name in ("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"):
        a.note(name, "mapped", "parallel.first_stage_layers, parallel.last_stage_layers", "counted as one layer")
    if first:
        values["parallel.first_stage_layers"] = first
    if last:
        values["parallel.last_stage_layers"] = last
    a.note("--decoder-first-pipeline-num-layers", "mapped", "parallel.first_stage_layers")
    a.note("--decoder-last-pipeline-num-layers", "mapped", "parallel.last_stage_layers")
    if layout:
        counts = pipeline_layout_counts(layout, pp)
        values["parallel.layers_per_stage"] = ",".join(map(str, counts))
        a.note("--pipeline-model-parallel-layout", "mapped", "parallel.layers_per_stage", f"{len(counts)} stages")


def _layout(a: _Args, values: dict[str, Any], s: dict[str, Any], layers: int) -> None:
    """DP, microbatches, virtual stages, sequence parallel: Megatron's arithmetic."""
    tp, pp, cp, mbs, gbs, world = s["tp"], s["pp"], s["cp"], s["mbs"], s["gbs"], s["world"]
    mp = tp * pp * cp
    if world is None:
        world, s["how"] = mp, "assumed (unresolved)"
    if world % mp:
        raise ConfigError(
            f"megatron: world size {world} ({s['how']}) is not divisible by TP*PP*CP = {tp}*{pp}*{cp} "
            f"= {mp}; pass --var for the node count or --world-size with a multiple of {mp}"
        )
    dp = world // mp
    gbs = gbs or mbs * dp
    if gbs % (mbs * dp):
        raise ConfigError(
            f"megatron: --global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} * DP "
            f"{dp}; use a multiple of {mbs * dp}"
        )
    data, micro = dp, gbs // (mbs * dp)
    ep = s.get("ep", 1)
    if ep > 1:
        if dp % ep:
            raise ConfigError(
                f"megatron: --expert-model-parallel-size {ep} does not divide DP = {dp} (world {world} "
                f"({s['how']}) / (TP*PP*CP) = {mp}); expert parallelism is carved out of data parallelism "
                f"(jaxpar: devices = data*expert*tensor*pipeline*context); use a world size that is a "
                f"multiple of {mp * ep} (pass --var for the node count or --world-size)"
                + (
                    f"; Megatron-core refuses it too (world not divisible by ETP*EP*PP = {tp * ep * pp})"
                    if world % (tp * ep * pp)
                    else "; Megatron-core would take EP from CP ranks too, jaxpar from DP only"
                )
            )
        data = dp // ep
        values["mesh.expert"] = ep
    a.note(
        "--expert-model-parallel-size",
        "mapped",
        "mesh.expert, mesh.data",
        f"experts split over {ep} ranks taken from DP = {dp}: mesh.data = {data}, the batch split over data*expert",
    )
    a.note("--moe-expert-parallel-size", "mapped", "mesh.expert, mesh.data", f"DeepSpeed's EP out of DP = {dp}")
    values.update(
        {
            "mesh.data": data,
            "mesh.tensor": tp,
            "mesh.pipeline": pp,
            "mesh.context": cp,
            "train.global_batch": gbs,
            "parallel.microbatches": micro,
        }
    )
    a.note("--tensor-model-parallel-size", "mapped", "mesh.tensor")
    a.note("--micro-batch-size", "mapped", "parallel.microbatches", f"microbatches = GBS / (MBS * DP) = {micro}")
    a.note("--global-batch-size", "mapped", "train.global_batch", f"DP = {world} / (TP*PP*CP) = {dp}")
    _context(a, values, cp)
    virtual = a.get("--virtual-pipeline-model-parallel-size", int, 1)
    per_stage = a.get("--num-layers-per-virtual-pipeline-stage", int)
    if per_stage:
        if layers % (pp * per_stage):
            raise ConfigError(
                f"megatron: --num-layers {layers} is not divisible by --pipeline-model-parallel-size "
                f"{pp} * --num-layers-per-virtual-pipeline-stage {per_stage}; fix one of them"
            )
        virtual = layers // (pp * per_stage)
    if virtual > 1:
        values.update({"parallel.virtual_stages": virtual, "parallel.pipeline_schedule": "interleaved"})
    elif pp > 1:
        values["parallel.pipeline_schedule"] = "1f1b"
    for name in ("--num-layers-per-virtual-pipeline-stage", "--virtual-pipeline-model-parallel-size"):
        a.note(
            name,
            "mapped",
            "parallel.virtual_stages, parallel.pipeline_schedule",
            f"{virtual} virtual stages, interleaved",
        )
    a.note(
        "--pipeline-model-parallel-size",
        "mapped",
        "mesh.pipeline, parallel.pipeline_schedule",
        "Megatron's 1F1B" if pp > 1 and virtual == 1 else "",
    )
    _uneven_stages(a, values, pp, layers)
    sp = a.get("--sequence-parallel", bool, False) and tp > 1
    values["parallel.sequence_parallel"] = sp
    a.note(
        "--sequence-parallel",
        "mapped" if sp else "approximated",
        "parallel.sequence_parallel",
        "" if sp else "off: Megatron disables sequence parallelism when TP = 1",
    )
    deepspeed = a.get("--deepspeed", bool, False)
    stage = 1 if a.get("--use-distributed-optimizer", bool, False) else 0
    stage = max(stage, a.get("--zero-stage", int, 0) or 0) if deepspeed else stage
    strategy = a.get("--data-parallel-sharding-strategy", str, "no_shard")
    if strategy not in FSDP_STAGES:
        raise ConfigError(
            f"megatron: --data-parallel-sharding-strategy {strategy!r} is not one of {', '.join(FSDP_STAGES)}; fix it"
        )
    if a.get("--use-megatron-fsdp", bool, False):
        stage = max(stage, FSDP_STAGES[strategy])
        a.note("--use-megatron-fsdp", "mapped", "parallel.zero_stage", "Megatron-FSDP: its sharding strategy decides")
        a.note("--data-parallel-sharding-strategy", "mapped", "parallel.zero_stage", f"{strategy} = ZeRO-{stage}")
    a.note("--data-parallel-sharding-strategy", "approximated", "", "no effect without --use-megatron-fsdp")
    values["parallel.zero_stage"] = stage
    a.note("--use-distributed-optimizer", "mapped", "parallel.zero_stage", "distributed optimizer = ZeRO-1")
    a.note(
        "--zero-stage",
        "mapped" if deepspeed else "approximated",
        "parallel.zero_stage",
        "" if deepspeed else "ignored without --deepspeed",
    )
    a.note("--deepspeed", "approximated", "", "Megatron-DeepSpeed: the DeepSpeed JSON decides ZeRO and precision too")
    a.note(
        "--deepspeed_config",
        "approximated",
        "",
        "port that JSON too: jaxpar port deepspeed FILE --world-size "
        f"{world} --tensor {tp} --pipeline {pp}, and compare",
    )
    for name, note in (
        (
            "--rampup-batch-size",
            "constant global batch from step 0; Megatron ramps it up, so its "
            "sample-counted schedule and iteration count differ during the ramp",
        ),
        (
            "--step-batch-size-schedule",
            "constant global batch (the --global-batch-size value); Megatron steps the batch up at token thresholds",
        ),
    ):
        a.note(name, "approximated", "train.global_batch", note)


# Megatron-FSDP's --data-parallel-sharding-strategy: what it shards over the data ranks, as a ZeRO stage
FSDP_STAGES = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}


# --cp-comm-type -> parallel.context_exchange (jaxpar.ops.context_parallel): exact counterparts
CP_COMM_TYPES = {"p2p": "ring", "all_gather": "all_gather"}


def _context(a: _Args, values: dict[str, Any], cp: int) -> None:
    """Context parallelism: ``--context-parallel-size`` -> ``mesh.context`` (blockwise attention, the
    sequence in 2*CP load-balanced chunks as Megatron-LM's), ``--cp-comm-type`` -> the exchange:
    ``p2p`` the ring, ``all_gather`` the all-gather; ``a2a`` (Ulysses) and ``a2a+p2p`` (hierarchical)
    have no jaxpar counterpart and run as the ring (approximated). A per-layer list of types maps
    when every layer uses the same one."""
    seq = values.get("train.seq_len", 0)
    if cp > 1 and seq and seq % (2 * cp):
        raise ConfigError(
            f"megatron: --seq-length {seq} is not divisible by 2 * --context-parallel-size {cp} = "
            f"{2 * cp} (each CP rank holds two chunks of the sequence); use a multiple of {2 * cp}"
        )
    a.note(
        "--context-parallel-size",
        "mapped",
        "mesh.context, model.attention",
        ""
        if cp == 1
        else f"the sequence split over {cp} context ranks, {2 * cp} load-balanced chunks; blockwise attention",
    )
    kinds = str(a.get("--cp-comm-type", str, "p2p")).split()
    exchange = CP_COMM_TYPES.get(kinds[0], "ring") if len(set(kinds)) == 1 else "ring"
    in_pipeline = values.get("mesh.pipeline", 1) > 1 and exchange == "ring"
    if in_pipeline:  # jaxpar runs the ring only outside pipeline stages (jaxpar.layout)
        exchange = "all_gather"
    if cp > 1:
        values.update({"model.attention": "blockwise", "parallel.context_exchange": exchange})
    exact = len(set(kinds)) == 1 and kinds[0] in CP_COMM_TYPES and not in_pipeline
    if cp == 1:
        note = "no effect without --context-parallel-size > 1"
    elif in_pipeline:
        note = (
            f"{' '.join(kinds)}: jaxpar runs the ring only outside pipeline stages; with "
            "--pipeline-model-parallel-size > 1 keys and values are all-gathered instead (the same attention)"
        )
    elif exact:
        note = "ring: keys and values passed rank to rank" if exchange == "ring" else "keys and values all-gathered"
    else:
        note = (
            f"{' '.join(kinds)}: jaxpar has no all-to-all (Ulysses) or hierarchical or per-layer exchange; the "
            "ring (p2p) runs instead: the same attention, different messages"
        )
    a.note("--cp-comm-type", "mapped" if exact and cp > 1 else "approximated", "parallel.context_exchange", note)
    if in_pipeline and "--cp-comm-type" not in a.flags:  # the default changed: say so
        a.report.add("--cp-comm-type (default)", "p2p", "approximated", "parallel.context_exchange", note)
    a.note(
        "--hierarchical-context-parallel-sizes",
        "approximated",
        "parallel.context_exchange",
        "one flat ring over all context ranks",
    )


# --use-rope-scaling: Megatron-LM's RotaryEmbedding._apply_scaling (megatron/core/models/common/embeddings/
# rotary_pos_embedding.py at d98e8a6) with its defaults low_freq_factor 1, high_freq_factor 4,
# original_max_position_embeddings 8192 (no flag sets them) and the factor GPTModel is built with: 8.0, the
# default of --rope-scaling-factor in megatron/training/arguments.py and of GPTModel(rope_scaling_factor=)
ROPE_SCALING = {
    "model.rope_scaling": "llama3",
    "model.rope_scaling_factor": 8.0,
    "model.rope_low_freq_factor": 1.0,
    "model.rope_high_freq_factor": 4.0,
    "model.rope_original_max_seq_len": 8192,
}


def _rope_scaling(a: _Args, values: dict[str, Any], position: str) -> None:
    """``--use-rope-scaling`` (Llama 3.1's scaled RoPE) -> ``model.rope_scaling=llama3``
    (:data:`ROPE_SCALING`). Megatron applies it to RoPE only (``--position-embedding-type rope``).
    ``pretrain_gpt.py`` never passes ``--rope-scaling-factor`` to the model: its model config
    (``gpt_config_from_args`` in megatron/training/argument_utils.py at d98e8a6; ``gpt_builder`` and,
    since the flag came in with 8c98d2d, the model providers before them) sets ``rope_scaling`` from
    ``--use-rope-scaling`` only, so GPTModel scales by its default 8 whatever the flag says."""
    use = a.get("--use-rope-scaling", bool, False)
    if not use:
        a.note("--rope-scaling-factor", "approximated", "", _NOOP + "Megatron reads it only with --use-rope-scaling")
        return
    if position != "rope":
        why = f"Megatron scales RoPE only, not {position} positions"
        a.note("--use-rope-scaling", "approximated", "", _NOOP + why)
        a.note("--rope-scaling-factor", "approximated", "", _NOOP + why)
        return
    factor = a.get("--rope-scaling-factor", float, 8.0)
    values.update(ROPE_SCALING)
    a.note(
        "--use-rope-scaling",
        "mapped",
        "model.rope_scaling",
        "Llama 3.1's scaled RoPE: factor 8, low/high frequency factors 1/4, original context 8192 "
        "(Megatron-LM's RotaryEmbedding._apply_scaling at d98e8a6)",
    )
    if not a.has("--rope-scaling-factor"):
        a.report.mapped(
            "--rope-scaling-factor (default)", 8.0, "model.rope_scaling_factor", "Megatron default (arguments.py)"
        )
    elif factor == 8.0:
        a.note("--rope-scaling-factor", "mapped", "model.rope_scaling_factor")
    else:
        a.note(
            "--rope-scaling-factor",
            "approximated",
            "model.rope_scaling_factor",
            "Megatron-LM's pretrain_gpt.py does not pass it to the model (gpt_config_from_args at d98e8a6 reads "
            "only --use-rope-scaling): the recipe trains with GPTModel's factor 8, and so does this config; "
            f"--set model.rope_scaling_factor={factor:g} for the factor the flag names",
        )


def _model(a: _Args, values: dict[str, Any]) -> int:
    """Model shape; returns the layer count (0 when unresolved)."""
    layers, hidden = a.get("--num-layers", int, 0), a.get("--hidden-size", int, 0)
    heads, seq = a.get("--num-attention-heads", int, 0), a.get("--seq-length", int, 0)
    position = a.get(
        "--position-embedding-type", str, "rope" if a.has("--use-rotary-position-embeddings") else "learned_absolute"
    )
    if not (layers and hidden and heads and seq):
        for name in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length"):
            if not a.has(name):
                raise ConfigError(f"megatron: {name} is missing; Megatron needs it (add the flag)")
        _rope_scaling(a, values, position)
        return 0
    if not a.has("--kv-channels") and hidden % heads:
        raise ConfigError(
            f"megatron: --hidden-size {hidden} is not divisible by --num-attention-heads {heads}; give --kv-channels"
        )
    gqa = a.get("--group-query-attention", bool, False)
    kv = a.get("--num-query-groups", int, 1) if gqa else a.get("--num-key-value-heads", int, heads)
    swiglu = a.get("--swiglu", bool, False)
    ffn = a.get("--ffn-hidden-size", int) or (int((4 * hidden * 2 / 3) / 64) * 64 if swiglu else 4 * hidden)
    norm = str(a.get("--normalization", str, "LayerNorm")).lower()
    maxpos = a.get("--max-position-embeddings", int, seq)
    values.update(
        {
            "model.num_layers": layers,
            "model.embed_dim": hidden,
            "model.num_heads": heads,
            "model.num_kv_heads": kv,
            "model.head_dim": a.get("--kv-channels", int, hidden // heads),
            "model.mlp_dim": ffn,
            "model.mlp_activation": "swiglu" if swiglu else "gelu",
            "model.norm": "rmsnorm" if norm == "rmsnorm" else "layernorm",
            "model.norm_eps": a.get("--norm-epsilon", float) or a.get("--layernorm-epsilon", float, 1e-5),
            "model.position": "learned" if position == "learned_absolute" else "rope",
            # the classic GPT block is its own family (jaxpar.models.gpt); any other mix runs as llama
            "model.name": "gpt" if (not swiglu and norm != "rmsnorm" and position == "learned_absolute") else "llama",
            "model.rope_theta": a.get("--rotary-base", float, 10000.0),
            "model.max_seq_len": max(maxpos, seq),
            "model.tie_embeddings": not a.get("--untie-embeddings-and-output-weights", bool, False),
            "model.init_std": a.get("--init-method-std", float, 0.02),
            "train.seq_len": seq,
        }
    )
    for name, target in (
        ("--num-layers", "model.num_layers"),
        ("--hidden-size", "model.embed_dim"),
        ("--num-attention-heads", "model.num_heads"),
        ("--kv-channels", "model.head_dim"),
        ("--num-query-groups", "model.num_kv_heads"),
        ("--num-key-value-heads", "model.num_kv_heads"),
        ("--group-query-attention", "model.num_kv_heads"),
        ("--swiglu", "model.mlp_activation"),
        ("--norm-epsilon", "model.norm_eps"),
        ("--layernorm-epsilon", "model.norm_eps"),
        ("--rotary-base", "model.rope_theta"),
        ("--seq-length", "train.seq_len"),
        ("--max-position-embeddings", "model.max_seq_len"),
        ("--init-method-std", "model.init_std"),
        ("--untie-embeddings-and-output-weights", "model.tie_embeddings"),
        ("--use-rotary-position-embeddings", "model.position"),
    ):
        ok = not (name == "--num-query-groups" and not gqa)
        a.note(
            name, "mapped" if ok else "approximated", target, "" if ok else "ignored without --group-query-attention"
        )
    a.note("--ffn-hidden-size", "mapped", "model.mlp_dim")
    if not a.has("--ffn-hidden-size"):
        a.report.mapped(
            "--ffn-hidden-size (default)",
            ffn,
            "model.mlp_dim",
            "SwiGLU default int(4h*2/3/64)*64" if swiglu else "4 * hidden",
        )
    if norm in ("rmsnorm", "layernorm"):
        a.note("--normalization", "mapped", "model.norm")
    else:
        a.model_change("--normalization", f"{norm} normalization; jaxpar has RMSNorm and LayerNorm (LayerNorm kept)")
    if position in ("rope", "learned_absolute"):
        a.note("--position-embedding-type", "mapped", "model.position")
    else:
        a.model_change(
            "--position-embedding-type",
            f"{position} positions"
            + (" (attention biases linear in the distance)" if position == "alibi" else "")
            + f"; jaxpar's positions are RoPE or a learned table (RoPE would be used instead of {position})",
        )
    percent = a.get("--rotary-percent", float, 1.0)
    if percent == 1.0:
        a.note("--rotary-percent", "mapped", "")
    else:
        a.model_change("--rotary-percent", f"RoPE on {percent:g} of each head; jaxpar rotates the full head dimension")
    _rope_scaling(a, values, position)
    # Megatron's dropout (default 0.1 each): --hidden-dropout on the embedding output and before each
    # residual add, --attention-dropout on the softmax probabilities: jaxpar's placement (jaxpar.ops.dropout)
    for name, target in (("--attention-dropout", "model.attention_dropout"), ("--hidden-dropout", "model.dropout")):
        values[target] = a.get(name, float, 0.1)
        if not a.has(name):
            a.report.mapped(f"{name} (default)", 0.1, target, "Megatron default 0.1")
        a.note(name, "mapped", target)
    a.note("--disable-bias-linear", "mapped", "", "jaxpar linear layers have no bias")
    if not a.has("--disable-bias-linear"):
        a.report.model_change(
            "--add-bias-linear (default)",
            True,
            "Megatron adds a bias to every linear layer unless --disable-bias-linear; jaxpar's linear layers have none",
        )
    a.note("--apply-layernorm-1p", "approximated", "model.norm", "same function class: jaxpar stores the scale itself")
    qk = a.has("--qk-layernorm") and not _off("--qk-layernorm", show(" ".join(a.flags["--qk-layernorm"])).strip())
    block = (values["model.norm"], values["model.mlp_activation"], values["model.position"])
    experts = a.get("--num-experts", str, "0", soft=True) not in ("0", "None")  # "8 16": _moe refuses it
    router = a.get("--moe-router-score-function", str, "softmax", soft=True) == "softmax"
    qwen3_moe = router and not a.get("--moe-shared-expert-intermediate-size", int, 0, soft=True)
    if qk and block == ("rmsnorm", "swiglu", "rope") and (not experts or qwen3_moe):
        name = "qwen3_moe" if experts else "qwen3"  # Megatron: TENorm over kv-channels, before RoPE
        values.update({"model.qk_norm": True, "model.name": name})
        a.note("--qk-layernorm", "mapped", "model.qk_norm, model.name", f"RMSNorm of each query and key head: {name}")
    _vocab(a, values)
    return layers


def _vocab(a: _Args, values: dict[str, Any]) -> None:
    tp = a.get("--tensor-model-parallel-size", int, 1) or 1
    multiple = a.get("--make-vocab-size-divisible-by", int, 128) * tp
    tokenizer = a.get("--tokenizer-type", str, soft=True)
    # Pai's Qwen3Tokenizer reports --padded-vocab-size as its size, and Megatron-LM (6a6cd47, Pai's 250624
    # backend: build_tokenizer) pads only when it is not given
    if a.pai and a.get("--padded-vocab-size", int):
        values["model.vocab_size"] = a.get("--padded-vocab-size", int)
        a.note("--padded-vocab-size", "mapped", "model.vocab_size", "Pai's Qwen3Tokenizer: its vocabulary size")
        a.note("--extra-vocab-size", "approximated", "", _NOOP + "Qwen3Tokenizer ignores it given --padded-vocab-size")
        return
    if a.get("--pad-vocab-size-to", int):
        values["model.vocab_size"] = a.get("--pad-vocab-size-to", int)
        a.note("--pad-vocab-size-to", "mapped", "model.vocab_size")
        a.note("--tokenizer-type", "mapped", "model.vocab_size", "vocabulary padded by --pad-vocab-size-to")
        return
    size = a.get("--vocab-size", int)
    if size is not None and tokenizer == "NullTokenizer":
        size += 1  # Megatron's NullTokenizer adds an end-of-document token
    if size is None and (tokenizer in TOKENIZER_VOCAB or (not tokenizer and a.has("--merge-file"))):
        size = TOKENIZER_VOCAB.get(tokenizer or "GPT2BPETokenizer")
    if size is None:
        a.note("--tokenizer-type", "approximated", "model.vocab_size", "vocabulary size unknown from the recipe")
        a.report.model_change(
            "(vocabulary)",
            tokenizer,
            f"the recipe does not fix the vocabulary size (tokenizer {tokenizer or 'unknown'}): jaxpar's default "
            "would be trained",
            f"give the tokenizer's size, padded to a multiple of {multiple} as Megatron pads, with --set "
            "model.vocab_size=N",
            needs=("model.vocab_size",),
            target="model.vocab_size",
        )
        return
    padded = -(-size // multiple) * multiple
    values["model.vocab_size"] = padded
    how = f"{size} tokens padded to a multiple of {multiple} = {padded}, as Megatron pads"
    a.note("--vocab-size", "mapped", "model.vocab_size", how)
    a.note("--tokenizer-type", "approximated", "model.vocab_size", f"{how} (assumes the standard vocabulary)")
    a.note("--make-vocab-size-divisible-by", "mapped", "model.vocab_size", how)
    if not a.has("--vocab-size") and not a.has("--tokenizer-type"):
        a.report.approximated("(vocabulary)", size, "model.vocab_size", f"GPT-2 BPE (--vocab-file/--merge-file): {how}")


# Megatron-DeepSpeed's MoE flags (megatron/arguments.py there); any of them (or --deepspeed) selects its
# DeepSpeed MoE (deepspeed/moe/sharded_moe.py) rather than Megatron-core's
DEEPSPEED_MOE_FLAGS = (
    "--moe-expert-parallel-size",
    "--topk",
    "--moe-loss-coeff",
    "--moe-train-capacity-factor",
    "--moe-eval-capacity-factor",
    "--moe-min-capacity",
    "--disable-moe-token-dropping",
    "--mlp-type",
    "--expert-interval",
    "--create-moe-param-group",
    "--disable-moe-top2-2nd-expert-sampling",
    "--use-tutel",
    "--enable-expert-tensor-parallelism",
)
_DROPLESS = "jaxpar's MoE is dropless: every token reaches all of its k experts, no capacity, no padding"
# Megatron-core MoE flags refused when given (beyond their default): flag -> why
MOE_REFUSED = {
    "--moe-expert-capacity-factor": "a capacity factor drops tokens over each expert's capacity; " + _DROPLESS,
    "--moe-pad-expert-input-to-capacity": "pads expert inputs to a token-dropping capacity; " + _DROPLESS,
    "--moe-router-force-load-balancing": "random router logits (Megatron's load-balanced benchmarking mode: the "
    "learned router is not used to route); jaxpar routes by the learned logits",
    "--moe-router-topk-limited-devices": "device-limited routing is not in jaxpar's router",
}
# Megatron-core MoE flags that only change how the same function is computed: flag -> what jaxpar does
MOE_PERF = {
    "--moe-grouped-gemm": "jaxpar runs each rank's experts as grouped matmuls (jax.lax.ragged_dot), always",
    "--moe-permute-fusion": "XLA decides what fuses with the token permutation",
    "--moe-router-dtype": "jaxpar's router logits, scores and top-k run in fp32 always; expert outputs are "
    "weighted in the compute dtype",
    "--moe-router-fusion": "XLA decides what fuses in the router",
    "--moe-layer-recompute": "jaxpar recomputes per parallel.recompute (whole layers), not the MoE layer alone",
    "--moe-per-layer-logging": _LOG,
    "--moe-shared-expert-overlap": _PERF,
    "--overlap-moe-expert-parallel-comm": "XLA schedules the expert all-gather and reduce-scatter",
    "--moe-use-grouped-tensor": _PERF,
    "--moe-flex-dispatcher-backend": "the flex dispatcher's kernels (DeepEP / HybridEP): the same function, "
    "different messages; jaxpar's dispatch is its own (--moe-token-dispatcher-type)",
}
BALANCING_TYPES = ("aux_loss", "none")


def _off(name: str, value: str) -> bool:
    """Whether a :data:`MODEL_FLAGS` flag given with ``value`` changes nothing (a factor of 1, 0 MTP layers)."""
    if value in ("false", "False", "None"):
        return True
    try:
        number = float(value)
    except ValueError:
        return False
    return number == (0.0 if name == "--mtp-num-layers" else 1.0) and name not in MODEL_FLAGS_ON


# flags that change the model whatever value they are given (store_true switches and window sizes)
MODEL_FLAGS_ON = ("--window-size", "--multi-latent-attention", "--quick-geglu", "--enable-gpt-oss")


def _model_changes(a: _Args) -> None:
    """The flags of :data:`MODEL_FLAGS` (given and not off), ``--softmax-type`` other than vanilla, and
    GeLU's form, as report rows."""
    for name, why in MODEL_FLAGS.items():
        if a.has(name) and _off(name, show(" ".join(a.flags[name])).strip()):
            a.note(name, "approximated", "", _NOOP + "off")
        else:
            a.model_change(name, why)
    rope_type = a.get("--rope-type", str, "rope", soft=True)
    if rope_type in ("rope", None):
        a.note("--rope-type", "mapped", "model.position", "plain RoPE, as jaxpar")
    else:
        a.model_change(
            "--rope-type",
            f"{rope_type} RoPE (scaled positions); jaxpar's RoPE is plain or Llama 3.1's (--use-rope-scaling)",
        )
    softmax = a.get("--softmax-type", str, "vanilla", soft=True)
    if softmax in ("vanilla", None):
        a.note("--softmax-type", "mapped", "", "vanilla softmax, as jaxpar")
    else:
        a.model_change(
            "--softmax-type",
            f"{softmax} softmax (learnable offsets: attention sinks); jaxpar's attention softmax is vanilla",
        )
    openai = a.get("--openai-gelu", bool, False)
    a.note("--openai-gelu", "mapped", "model.mlp_activation", "the tanh approximation, as jaxpar's GeLU")
    if not a.has("--swiglu") and not openai and not a.has("--squared-relu"):
        a.report.approximated(
            "(gelu)",
            "erf",
            "model.mlp_activation",
            "Megatron's GeLU is exact (erf) unless --openai-gelu; jaxpar's is the tanh approximation (they differ "
            "by under 1e-3: a precision-level change)",
        )


# Megatron-LM at 00611e6 (megatron/core/transformer/multi_latent_attention.py, moe/moe_utils.py, moe/router.py):
# the MLA and DeepSeek-V3 router flags and the deepseek_v3 fields they are
MLA_DIMS = (
    ("--kv-lora-rank", "model.kv_lora_rank"),
    ("--qk-head-dim", "model.qk_nope_head_dim"),
    ("--qk-pos-emb-head-dim", "model.qk_rope_head_dim"),
    ("--v-head-dim", "model.v_head_dim"),
)
_ONLY_DEEPSEEK = "jaxpar has it in its deepseek_v3 family only, whose attention is MLA (add --multi-latent-attention)"


def _experts(a: _Args) -> int:
    """The routed-expert count of ``--num-experts`` (0: none or unresolved)."""
    counts = [int(x) for x in str(a.get("--num-experts", str, "", soft=True) or "").split() if x.isdigit()]
    return max(counts, default=0) if len(set(counts)) == 1 and counts[0] > 1 else 0


def _mla(a: _Args, values: dict[str, Any]) -> None:
    """Multi-head latent attention (``--multi-latent-attention`` with MoE) -> ``model.name=deepseek_v3``.

    Megatron's MLA: ``--q-lora-rank`` absent is a full-rank query projection (jaxpar's 0), the latent
    norms are the ``--qk-layernorm`` norms (on the compressed query and key/value, eps
    ``--norm-epsilon``), every head has its own key of ``qk_head_dim + qk_pos_emb_head_dim``."""
    for name, target in MLA_DIMS:
        if not a.has(name):
            raise ConfigError(f"megatron: --multi-latent-attention without {name}; give it ({target})")
        values[target] = a.get(name, int)
        a.note(name, "mapped", target)
    q_rank = a.get("--q-lora-rank", int, 0) or 0
    values["model.q_lora_rank"] = q_rank
    if a.has("--q-lora-rank"):
        a.note("--q-lora-rank", "mapped", "model.q_lora_rank")
    else:
        a.report.mapped("--q-lora-rank (default)", 0, "model.q_lora_rank", "Megatron default None: full-rank queries")
    nope, rope = values["model.qk_nope_head_dim"], values["model.qk_rope_head_dim"]
    values.update(
        {
            "model.name": "deepseek_v3",
            "model.num_kv_heads": values["model.num_heads"],
            "model.head_dim": nope + rope,
        }
    )
    a.note(
        "--multi-latent-attention",
        "mapped",
        "model.name, model.num_kv_heads, model.head_dim",
        f"deepseek_v3's MLA: one key per head of {nope} + {rope} (RoPE) dims",
    )
    for name, target in (("--attention-dropout", "model.attention_dropout"), ("--hidden-dropout", "model.dropout")):
        if values.get(target):
            a.report.model_change(
                f"({name.removeprefix('--')})",
                values[target],
                f"{name} {values[target]:g}" + ("" if a.has(name) else " (Megatron's default)") + ": jaxpar's "
                f"deepseek_v3 trains without dropout ({target}=0)",
                target=target,
            )
            values[target] = 0.0
    factor = a.get("--rotary-scaling-factor", float, 1.0) or 1.0
    if factor > 1:
        all_dim = a.get("--mscale-all-dim", float, None)
        scale = "" if all_dim is None else f" = {(0.1 * all_dim * math.log(factor) + 1) ** 2:.4g}"
        a.model_change(
            "--rotary-scaling-factor",
            f"with --multi-latent-attention Megatron's RoPE is YaRN (MLATransformerConfig's rope_type, unless "
            f"--rope-type rope): the low RoPE frequencies interpolated by {factor:g} at every sequence length, and "
            f"the attention scores times mscale^2{scale} (--mscale-all-dim); jaxpar's deepseek_v3 rotates with "
            f"plain RoPE and scales by 1/sqrt({nope + rope})",
        )
    if a.get("--qk-layernorm", bool, False):
        eps = values["model.norm_eps"]
        a.note(
            "--qk-layernorm",
            "mapped" if eps == 1e-6 else "approximated",
            "",
            "with MLA: RMSNorm of the query and key/value latents, as deepseek_v3's"
            + ("" if eps == 1e-6 else f" (eps 1e-6, Megatron's --norm-epsilon {eps:g}: a precision-level change)"),
        )
    else:
        a.report.model_change(
            "(--qk-layernorm)",
            False,
            "without --qk-layernorm Megatron's MLA has no latent norms; jaxpar's deepseek_v3 RMSNorms the query "
            "and key/value latents",
        )


def _moe(a: _Args, values: dict[str, Any], s: dict[str, Any], approximate: bool = False) -> int:
    """Mixture of experts -> ``model.num_experts`` and the router fields; returns the expert-parallel size.

    Megatron-core (``--num-experts``): softmax routing takes the softmax over the top-k logits
    (= the top-k probabilities renormalised: ``router_norm_topk``) unless ``--moe-router-pre-softmax``
    (softmax over all experts, no renormalisation); sigmoid renormalises the top-k when k > 1. Its
    ``aux_loss`` balancing is jaxpar's Switch loss, its z-loss jaxpar's. Megatron-DeepSpeed (DeepSpeed
    MoE): top-1 weights a token by its softmax probability; its ``l_aux`` is ``E * sum_e me_e * ce_e``
    with ``ce_e`` the share of tokens whose *first* choice is ``e``: jaxpar's Switch loss for top-1 and
    top-k > 2 (``ce / k``), not for top-2. Refusals raise one line naming the flag."""
    deepspeed = any(a.has(f) for f in DEEPSPEED_MOE_FLAGS) or a.get("--deepspeed", bool, False)
    text = str(a.get("--num-experts", str, "") or "")
    counts = sorted({int(x) for x in text.split() if x.isdigit()})
    if len(counts) > 1:
        raise ConfigError(
            f"megatron: --num-experts {text}: a different expert count per MoE layer (pyramid MoE); jaxpar's "
            "layers all have model.num_experts experts; give one count"
        )
    experts = counts[0] if counts else 0
    moe_flags = [
        n for n in a.flags if n.startswith(("--moe-", "--expert-")) or n in (*DEEPSPEED_MOE_FLAGS, "--num-experts")
    ]
    dense = experts == 0 or (deepspeed and experts == 1)  # Megatron-DeepSpeed's default [1] is dense
    if dense:
        for name in moe_flags:
            a.note(name, "approximated", "", _NOOP + "no mixture of experts without --num-experts > 1")
        return 1
    if experts == 1:
        raise ConfigError(
            "megatron: --num-experts 1 is one expert behind a router; jaxpar's MoE needs >= 2 experts "
            "(drop the flag for the dense model)"
        )
    refusals = _moe_deepspeed(a, values, experts) if deepspeed else _moe_core(a, values, s)
    if values.get("model.mlp_activation") != "swiglu":
        kind = "quick-GeGLU MLPs (--quick-geglu)" if a.get("--quick-geglu", bool, False) else "GeLU MLPs"
        refusals.append(
            f"--num-experts {experts} without --swiglu: the recipe's experts are {kind}; jaxpar's experts "
            "are SwiGLU (add --swiglu to port a SwiGLU MoE)"
        )
    if refusals and not approximate:
        stated = set(a.report.ported)
        others = [e.source for e in a.report.model_changes if not (e.needs and set(e.needs) <= stated)]
        raise ConfigError(
            "megatron: "
            + "; also ".join(refusals)
            + "; jaxpar would not train the recipe's model: pass --approximate to port it anyway"
            + (f" (and {len(others)} more model change(s): {', '.join(others)})" if others else "")
        )
    for refusal in refusals:  # --approximate: each one is a model change of the report
        flag = refusal.split(" ", 1)[0].rstrip(":")
        a.reported.add(flag)
        a.report.model_change(flag, show(" ".join(a.flags.get(flag, []))) or True, refusal)
    values["model.num_experts"] = experts
    values["model.name"] = (
        "deepseek_v3"
        if values.get("model.name") == "deepseek_v3"
        else "qwen3_moe"  # _model checked the router (softmax, no shared expert)
        if values.get("model.qk_norm")
        else "mixtral"
        if values.get("model.router_score", "softmax") == "softmax"
        and values.get("model.router_norm_topk", True)
        and (values["model.norm"], values["model.position"]) == ("rmsnorm", "rope")
        and not values.get("model.shared_expert_dim")
        else "llama"
    )
    a.note(
        "--num-experts",
        "mapped",
        "model.num_experts, model.name",
        (
            f"{experts} SwiGLU experts of model.moe_mlp_dim in each MoE layer; model.name=deepseek_v3"
            if values["model.name"] == "deepseek_v3"
            else f"every layer's MLP is {experts} SwiGLU experts of model.mlp_dim; model.name={values['model.name']}"
        )
        + (" (Mixtral: softmax top-k renormalised)" if values["model.name"] == "mixtral" else ""),
    )
    ep = a.get("--moe-expert-parallel-size" if deepspeed else "--expert-model-parallel-size", int, 1) or 1
    if experts % ep:
        raise ConfigError(
            f"megatron: --num-experts {experts} is not divisible by the expert-parallel size {ep}; "
            "choose an expert-parallel size that divides the expert count"
        )
    return ep


def _moe_core(a: _Args, values: dict[str, Any], s: dict[str, Any]) -> list[str]:
    """Megatron-core's MoE flags; returns the refusals (flag and reason)."""
    refusals = []
    for name, why in MOE_REFUSED.items():
        a.known.add(name)
        value = show(" ".join(a.flags.get(name, ["None"])))
        if value not in ("None", "false", "False"):
            refusals.append(f"{name} {value}".rstrip() + f": {why}")
    deepseek = values.get("model.name") == "deepseek_v3"
    refusals += _layer_freq(a, values, deepseek)
    tp = s["tp"]
    etp = a.get("--expert-tensor-parallel-size", int, tp)
    if etp != tp:
        refusals.append(
            f"--expert-tensor-parallel-size {etp} differs from --tensor-model-parallel-size {tp}: jaxpar "
            "splits the experts over the tensor axis like the dense MLP"
        )
    a.note("--expert-tensor-parallel-size", "mapped", "mesh.tensor", "experts split over tensor like the dense MLP")
    shared = a.get("--moe-shared-expert-intermediate-size", int, 0) or 0
    if shared:
        values["model.shared_expert_dim"] = shared
    a.note(
        "--moe-shared-expert-intermediate-size",
        "mapped",
        "model.shared_expert_dim",
        "a dense SwiGLU MLP of this width beside the routed experts, every token" if shared else "no shared expert",
    )
    score = a.get("--moe-router-score-function", str, "softmax")
    if score not in ("softmax", "sigmoid"):
        refusals.append(f"--moe-router-score-function {score}: jaxpar's router scores are softmax or sigmoid")
    kinds = str(a.get("--moe-router-load-balancing-type", str, "aux_loss")).split()
    coeffs = str(a.get("--moe-aux-loss-coeff", str, "0.0")).split()
    if len(kinds) > 1 or len(coeffs) > 1:
        refusals.append(
            f"--moe-router-load-balancing-type {' '.join(kinds)} with --moe-aux-loss-coeff {' '.join(coeffs)}: "
            "jaxpar has one load-balancing loss (Switch, aux_loss)"
        )
    elif kinds[0] == "seq_aux_loss" and float(coeffs[0]):
        refusals.append(
            "--moe-router-load-balancing-type seq_aux_loss: the balance loss per sequence (DeepSeek-V3's "
            "sequence-wise auxiliary loss); jaxpar's is the Switch loss over each microbatch's tokens (aux_loss)"
        )
    elif kinds[0] not in (*BALANCING_TYPES, "seq_aux_loss"):
        refusals.append(
            f"--moe-router-load-balancing-type {kinds[0]}: jaxpar's only balancing is the Switch loss "
            "(aux_loss), or none"
        )
    topk = a.get("--moe-router-topk", int, 2)
    pre = a.get("--moe-router-pre-softmax", bool, False)
    norm = (not pre) if score == "softmax" else topk > 1
    coeff = 0.0 if kinds[0] == "none" else float(coeffs[0])
    values.update(
        {
            "model.experts_per_token": topk,
            "model.router_score": score,
            "model.router_norm_topk": norm,
            "model.moe_aux_loss_coeff": coeff,
            "model.moe_z_loss_coeff": a.get("--moe-z-loss-coeff", float, 0.0) or 0.0,
        }
    )
    a.note("--moe-router-topk", "mapped", "model.experts_per_token")
    if not a.has("--moe-router-topk"):
        a.report.mapped("--moe-router-topk (default)", 2, "model.experts_per_token", "Megatron default")
    a.note("--moe-router-score-function", "mapped", "model.router_score")
    how = (
        "softmax over all experts, top-k not renormalised"
        if score == "softmax" and pre
        else "softmax over the top-k logits = top-k probabilities renormalised"
        if score == "softmax"
        else f"sigmoid top-k {'renormalised (k > 1)' if norm else 'not renormalised (k = 1)'}; pre-softmax no effect"
    )
    a.note("--moe-router-pre-softmax", "mapped", "model.router_norm_topk", how)
    if not a.has("--moe-router-pre-softmax"):
        a.report.mapped("(router weights)", norm, "model.router_norm_topk", how)
    dp_note = (
        "; jaxpar takes f_e and P_e over each microbatch's tokens on all data and expert ranks, Megatron over "
        "each DP rank's own micro-batch (the same loss at DP = 1, close at DP > 1)"
    )
    sigmoid_note = (
        "; with sigmoid scores Megatron's P_e uses the scores normalised over the experts, jaxpar the raw "
        "sigmoid probabilities"
        if score == "sigmoid"
        else ""
    )
    a.note(
        "--moe-router-load-balancing-type",
        "mapped" if kinds[0] == "none" or not coeff else "approximated",
        "model.moe_aux_loss_coeff",
        "no load-balancing loss"
        if kinds[0] == "none"
        else "the Switch loss E*sum_e f_e*P_e, as Megatron-core's switch_load_balancing_loss_func"
        + dp_note
        + sigmoid_note,
    )
    a.note("--moe-aux-loss-coeff", "mapped", "model.moe_aux_loss_coeff", "its weight, per layer, as Megatron adds it")
    a.note("--moe-z-loss-coeff", "mapped", "model.moe_z_loss_coeff", "router z-loss mean_t logsumexp(logits_t)^2")
    if deepseek:  # Megatron's default expert width is --ffn-hidden-size
        values["model.moe_mlp_dim"] = a.get("--moe-ffn-hidden-size", int) or values["model.mlp_dim"]
        a.note("--moe-ffn-hidden-size", "mapped", "model.moe_mlp_dim", "the routed and shared experts' width")
    else:
        a.note("--moe-ffn-hidden-size", "mapped", "model.mlp_dim", "every layer is MoE: the experts' width is mlp_dim")
        if a.get("--moe-ffn-hidden-size", int):
            values["model.mlp_dim"] = a.get("--moe-ffn-hidden-size", int)
    refusals += _router(a, values, deepseek, topk, score)
    dispatcher = a.get("--moe-token-dispatcher-type", str, "allgather")
    a.note(
        "--moe-token-dispatcher-type",
        "mapped" if dispatcher == "allgather" else "approximated",
        "",
        "jaxpar dispatches as Megatron's allgather: tokens all-gathered over the expert ranks, the outputs "
        "reduce-scattered back"
        + ("" if dispatcher == "allgather" else f" (not {dispatcher}): the same function, different messages"),
    )
    for name, why in MOE_PERF.items():
        a.note(name, "approximated", "", why)
    return refusals


def _layer_freq(a: _Args, values: dict[str, Any], deepseek: bool) -> list[str]:
    """``--moe-layer-freq`` (an int N: every N-th layer from the first, or a Python list expression
    such as ``[0]*3+[1]*58``, Megatron's ``moe_freq_type``) -> every layer MoE, or for deepseek_v3
    ``model.first_dense_layers``; returns the refusals."""
    freq = str(a.get("--moe-layer-freq", str, "1")).replace(" ", "")
    layers = values.get("model.num_layers", 0)
    pattern = _freq_pattern(freq, layers)
    if pattern is None:
        raise ConfigError(
            f"megatron: --moe-layer-freq {freq}: not an int or a list expression of 0/1 ([0]*3+[1]*58); fix it"
        )
    if layers and len(pattern) != layers and not freq.isdigit():
        raise ConfigError(
            f"megatron: --moe-layer-freq {freq} lists {len(pattern)} layers, --num-layers is {layers}; Megatron "
            "needs one entry per layer"
        )
    dense = pattern.index(1) if 1 in pattern else len(pattern)
    if all(pattern[dense:]) and dense < len(pattern) and (dense == 0 or deepseek):
        if dense:
            values["model.first_dense_layers"] = dense
        a.note(
            "--moe-layer-freq",
            "mapped",
            "model.first_dense_layers" if dense else "model.num_experts",
            f"the first {dense} layers dense (--ffn-hidden-size), the rest MoE" if dense else "every layer is MoE",
        )
        return []
    a.known.add("--moe-layer-freq")
    where = (
        "a dense prefix then MoE layers: only in jaxpar's deepseek_v3 (MLA)"
        if all(pattern[dense:])
        else (
            "dense layers between or after the MoE layers; jaxpar's MoE layers are every layer, or (deepseek_v3) "
            "all but a dense prefix"
        )
    )
    return [f"--moe-layer-freq {freq}: {where}"]


def _freq_pattern(freq: str, layers: int) -> list[int] | None:
    """The 0/1 per layer of a ``--moe-layer-freq`` value (None: not one Megatron reads)."""
    if freq.isdigit():
        n = int(freq)
        # an unresolved --num-layers: enough layers to tell all-MoE (1) from every n-th
        return [int(i % n == 0) for i in range(layers or max(n, 2))] if n else None
    try:
        tree = ast.parse(freq, mode="eval").body
    except SyntaxError:
        return None

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            items = [value(e) for e in node.elts]
            return items if all(x in (0, 1) for x in items) else None
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
                return left + right
            if isinstance(node.op, ast.Mult) and isinstance(left, list) and isinstance(right, int):
                return left * right if len(left) * right <= 100_000 else None
        return None

    pattern = value(tree)
    return pattern if isinstance(pattern, list) and pattern else None


def _router(a: _Args, values: dict[str, Any], deepseek: bool, topk: int, score: str) -> list[str]:
    """DeepSeek-V3's router flags -> ``model.router_*``; returns the refusals. Megatron (moe_utils.py
    at 00611e6): sigmoid scores plus the expert bias choose, the unbiased scores weigh, renormalised
    (k > 1) then times ``--moe-router-topk-scaling-factor``; group-limited routing scores a group by its
    top ``topk // group_topk`` scores; the bias moves once per step by ``rate * sign(mean load - load)``
    over the global batch (``get_updated_expert_bias``): jaxpar's rules."""
    refusals = []
    bias = a.get("--moe-router-enable-expert-bias", bool, False)
    rate = a.get("--moe-router-bias-update-rate", float, 1e-3)
    if bias and score != "sigmoid":
        refusals.append(
            f"--moe-router-enable-expert-bias: Megatron adds the bias to sigmoid scores only (here {score}); "
            "jaxpar's biased routing is sigmoid's"
        )
    elif bias and not deepseek:
        refusals.append(f"--moe-router-enable-expert-bias: aux-loss-free balancing; {_ONLY_DEEPSEEK}")
    elif bias:
        values["model.router_bias_rate"] = rate
        a.note("--moe-router-enable-expert-bias", "mapped", "model.router_bias_rate", "selection-only expert bias")
        a.note("--moe-router-bias-update-rate", "mapped", "model.router_bias_rate", "bias += rate*sign(mean-load)")
        if not a.has("--moe-router-bias-update-rate"):
            a.report.mapped("--moe-router-bias-update-rate (default)", rate, "model.router_bias_rate", "Megatron")
    if not bias:
        a.note("--moe-router-bias-update-rate", "approximated", "", _NOOP + "no expert bias")
    scale = a.get("--moe-router-topk-scaling-factor", float, None)
    if scale not in (None, 1.0) and not deepseek:
        refusals.append(f"--moe-router-topk-scaling-factor {scale:g}: a route scale; {_ONLY_DEEPSEEK}")
    elif scale is not None:
        if deepseek:
            values["model.router_scale"] = scale
        a.note("--moe-router-topk-scaling-factor", "mapped", "model.router_scale", "the combine weights times it")
    groups = a.get("--moe-router-num-groups", int, None)
    group_topk = a.get("--moe-router-group-topk", int, None)
    if group_topk:
        if not groups:
            raise ConfigError("megatron: --moe-router-group-topk without --moe-router-num-groups; give both")
        if not deepseek:
            refusals.append(f"--moe-router-group-topk {group_topk}: group-limited routing; {_ONLY_DEEPSEEK}")
        elif topk // group_topk != 2:
            refusals.append(
                f"--moe-router-group-topk {group_topk}: Megatron scores a group by the sum of its top "
                f"topk // group_topk = {topk // group_topk} scores; jaxpar's group score is its top 2"
            )
        else:
            values["model.router_groups"], values["model.router_group_topk"] = groups, group_topk
            for name in ("--moe-router-num-groups", "--moe-router-group-topk"):
                a.note(name, "mapped", "model.router_groups, model.router_group_topk", "group score: top-2 sum")
    else:
        a.note("--moe-router-num-groups", "approximated", "", _NOOP + "without --moe-router-group-topk")
    return refusals


def _moe_deepspeed(a: _Args, values: dict[str, Any], experts: int) -> list[str]:
    """Megatron-DeepSpeed's MoE flags (DeepSpeed MoE); returns the refusals (flag and reason)."""
    refusals = []
    interval = a.get("--expert-interval", int, 2)
    if interval != 1:
        refusals.append(
            f"--num-experts {experts} with --expert-interval {interval}"
            + ("" if a.has("--expert-interval") else " (Megatron-DeepSpeed's default)")
            + f": experts in one layer of every {interval}, dense MLPs between; jaxpar's MoE replaces every "
            "layer's MLP (only --expert-interval 1 ports)"
        )
    a.note("--expert-interval", "mapped", "model.num_experts", "every layer is a MoE layer")
    mlp = a.get("--mlp-type", str, "standard")
    if mlp != "standard":
        refusals.append(f"--mlp-type {mlp}: residual MoE (a dense MLP beside the experts) is not in jaxpar")
    a.note("--mlp-type", "mapped", "", "standard: routed experts only")
    dropping = not a.get("--disable-moe-token-dropping", bool, False)
    factor = a.get("--moe-train-capacity-factor", float, 1.0)
    if dropping:
        refusals.append(
            f"--moe-train-capacity-factor {factor:g} with token dropping (on unless --disable-moe-token-dropping): "
            f"tokens over each expert's capacity are dropped; {_DROPLESS}"
        )
    for name in ("--moe-train-capacity-factor", "--moe-eval-capacity-factor", "--moe-min-capacity"):
        a.note(name, "approximated", "", _NOOP + "with --disable-moe-token-dropping no token is dropped")
    a.note("--disable-moe-token-dropping", "mapped", "", "dropless, as jaxpar's MoE")
    topk = a.get("--topk", int, 1)
    coeff = a.get("--moe-loss-coeff", float, 0.1)
    sampling = topk == 2 and not a.get("--disable-moe-top2-2nd-expert-sampling", bool, False)
    if sampling:
        refusals.append(
            "--topk 2: DeepSpeed picks the second expert by Gumbel sampling (on unless "
            "--disable-moe-top2-2nd-expert-sampling); jaxpar's router takes the top-k deterministically"
        )
    if topk == 2 and coeff:
        refusals.append(
            f"--topk 2 with --moe-loss-coeff {coeff:g}: DeepSpeed's top-2 l_aux counts only each token's first "
            "choice (E * sum_e mean(gates_e) * share of first choices), not jaxpar's Switch loss over all "
            "k choices; no coefficient converts one into the other"
        )
    values.update(
        {
            "model.experts_per_token": topk,
            "model.router_score": "softmax",
            "model.router_norm_topk": topk > 1,
            "model.moe_aux_loss_coeff": coeff,
        }
    )
    a.note(
        "--topk",
        "mapped",
        "model.experts_per_token, model.router_norm_topk",
        "top-1 weights each token by its softmax probability"
        if topk == 1
        else "softmax top-k renormalised to sum 1, as DeepSpeed's gating",
    )
    if not a.has("--topk"):
        a.report.mapped("--topk (default)", 1, "model.experts_per_token", "Megatron-DeepSpeed default: top-1")
    a.note("--disable-moe-top2-2nd-expert-sampling", "mapped", "", "top-2 by argmax, as jaxpar")
    note = (
        "DeepSpeed's l_aux E*sum_e me_e*ce_e is jaxpar's Switch loss"
        + (" (ce_e / k: its topkgating divides by k)" if topk > 2 else "")
        + "; DeepSpeed takes it over each rank's own tokens, jaxpar over each microbatch on all data and "
        "expert ranks (the same loss at DP = 1, close at DP > 1)"
    )
    a.note("--moe-loss-coeff", "approximated" if coeff else "mapped", "model.moe_aux_loss_coeff", note)
    if not a.has("--moe-loss-coeff"):
        a.report.approximated("--moe-loss-coeff (default)", 0.1, "model.moe_aux_loss_coeff", note)
    a.note("--create-moe-param-group", "approximated", "", "jaxpar's optimizer treats expert weights as the others")
    a.note("--use-tutel", "approximated", "", _PERF)
    a.note("--enable-expert-tensor-parallelism", "approximated", "", "jaxpar splits experts over tensor always")
    return refusals


def schedule_fields(
    lr: float,
    min_lr: float,
    style: str,
    warmup: float,
    decay: float,
    warmup_init: float = 0.0,
    wsd_decay: float | None = None,
    wsd_style: str = "linear",
) -> dict[str, Any]:
    """optim fields reproducing Megatron's OptimizerParamScheduler; steps in iterations (may be fractional)."""
    shapes = {"constant": "constant", "linear": "linear", "cosine": "cosine", "inverse-square-root": "inverse_sqrt"}
    wsd = {"linear": "linear", "cosine": "cosine", "minus_sqrt": "sqrt"}
    if style not in shapes and not (style == "WSD" and wsd_style in wsd and wsd_decay is not None):
        raise ConfigError(
            f"megatron: --lr-decay-style {style} (wsd style {wsd_style}) has no jaxpar counterpart; "
            f"use one of {', '.join(shapes)} or WSD with linear/cosine/minus_sqrt"
        )
    if not 0 <= min_lr <= lr:
        raise ConfigError(f"megatron: --min-lr {min_lr} must lie in [0, --lr {lr}]")
    as_int = lambda x: int(x) if float(x).is_integer() else float(x)  # noqa: E731
    fields = {
        "lr": lr,
        "min_lr_ratio": min_lr / lr,
        "warmup_init_lr": warmup_init,
        "warmup_type": "linear",
        "warmup_steps": as_int(warmup),
        "decay_steps": as_int(decay),
        "decay_start_step": -1,
        "schedule_offset": 0,
        "schedule": shapes.get(style) or wsd[wsd_style],
    }
    if style == "WSD":
        fields["decay_start_step"] = as_int(decay - wsd_decay)
    return fields


def _optim(a: _Args, values: dict[str, Any], s: dict[str, Any]) -> None:
    optimizer = a.get("--optimizer", str, "adam")
    if optimizer != "adam":
        a.note(
            "--optimizer",
            "unsupported",
            "optim.name",
            f"this port maps Adam only ({optimizer} requested); pick optim.name by hand",
        )
    a.note("--optimizer", "mapped", "optim.name", "Megatron's adam is AdamW (decoupled weight decay)")
    for name, key, default in (
        ("--adam-beta1", "optim.b1", 0.9),
        ("--adam-beta2", "optim.b2", 0.999),
        ("--adam-eps", "optim.eps", 1e-8),
        ("--weight-decay", "optim.weight_decay", 0.01),
        ("--clip-grad", "optim.clip_norm", 1.0),
    ):
        values[key] = a.get(name, float, default)
        a.note(
            name, "mapped", key, "biases and 1-D parameters skip weight decay in both" if key.endswith("decay") else ""
        )
        if not a.has(name):
            a.report.mapped(f"{name} (default)", default, key, "Megatron default")
    if a.get("--start-weight-decay", float) != a.get("--end-weight-decay", float):
        for name in ("--start-weight-decay", "--end-weight-decay", "--weight-decay-incr-style"):
            a.note(name, "unsupported", "optim.weight_decay", "jaxpar keeps weight decay constant")
    lr = a.get("--lr", float)
    gbs = s["gbs"] or 0
    iters, samples = a.get("--train-iters", int), a.get("--train-samples", int)
    if lr is None or not (iters or samples) or (samples and not gbs):
        if not a.has("--lr") or not (a.has("--train-iters") or a.has("--train-samples")):
            raise ConfigError("megatron: --lr and --train-iters (or --train-samples) are required; add them")
        return
    unit = 1 if iters else gbs  # the schedule counts samples: num_steps grows by GBS per update
    decay = a.get("--lr-decay-iters" if iters else "--lr-decay-samples", int) or (iters or samples)
    fraction = a.get("--lr-warmup-fraction", float)
    warmup = (
        fraction * decay
        if fraction is not None
        else a.get("--lr-warmup-iters" if iters else "--lr-warmup-samples", int, 0)
    )
    wsd = a.get("--lr-wsd-decay-iters" if iters else "--lr-wsd-decay-samples", int)
    fields = schedule_fields(
        lr,
        a.get("--min-lr", float, 0.0),
        a.get("--lr-decay-style", str, "linear"),
        warmup / unit,
        decay / unit,
        a.get("--lr-warmup-init", float, 0.0),
        None if wsd is None else wsd / unit,
        a.get("--lr-wsd-decay-style", str, "linear"),
    )
    notes = apply_schedule_fields(fields, values)
    values["train.steps"] = iters or samples // gbs
    if fields["schedule"] == "inverse_sqrt" and warmup < unit:
        notes.append(
            "inverse-square-root with warmup under one iteration: Megatron's samples-based arithmetic "
            "makes the first steps lr/sqrt(GBS*k)"
        )
    status = "approximated" if notes else "mapped"
    a.note(
        "--lr-decay-style", status, "optim.schedule", "; ".join(notes) or "exact; update k runs at num_steps = k*GBS"
    )
    if not a.has("--lr-decay-style"):
        a.report.add("--lr-decay-style (default)", "linear", status, "optim.schedule", "Megatron default")
    targets = {
        "--lr": "optim.lr",
        "--min-lr": "optim.min_lr_ratio",
        "--lr-warmup-init": "optim.warmup_init_lr",
        "--lr-warmup-iters": "optim.warmup_steps",
        "--lr-warmup-fraction": "optim.warmup_steps",
        "--lr-warmup-samples": "optim.warmup_steps",
        "--lr-decay-iters": "optim.decay_steps",
        "--lr-decay-samples": "optim.decay_steps",
        "--lr-wsd-decay-iters": "optim.decay_start_step",
        "--lr-wsd-decay-samples": "optim.decay_start_step",
        "--lr-wsd-decay-style": "optim.schedule",
        "--train-iters": "train.steps",
        "--train-samples": "train.steps",
    }
    for name, target in targets.items():
        a.note(
            name, status if name != "--lr" else "mapped", target, "samples / global batch" if "sample" in name else ""
        )


def _observability(a: _Args, values: dict[str, Any]) -> None:
    """--tensorboard-dir and the --log-*-to-tensorboard flags -> jaxpar's event files in train.workdir;
    --profile with --profile-step-start/-end -> train.profile_steps (a jax.profiler trace)."""
    a.note("--tensorboard-dir", "approximated", "train.workdir", _TB + "; the directory given is not used")
    for name in TENSORBOARD_FLAGS:
        a.note(name, "approximated", "", _TB)
    start, end = a.get("--profile-step-start", int, 10, soft=True), a.get("--profile-step-end", int, 12, soft=True)
    if a.get("--profile", bool, False):
        # Megatron starts the profiler when `iteration` (steps done, from 0) reaches start and stops it once
        # it reaches end: steps start+1 .. end in jaxpar's numbering (from 1); nothing when end <= start
        if end > start:
            values["train.profile_steps"] = f"{start + 1},{end}"
            a.note("--profile", "mapped", "train.profile_steps", f"a jax.profiler trace of steps {start + 1}-{end}")
        else:
            a.note(
                "--profile",
                "approximated",
                "",
                _NOOP + f"--profile-step-end {end} <= start {start}: Megatron traces nothing",
            )
        for name in ("--profile-step-start", "--profile-step-end"):
            a.note(
                name, "mapped", "train.profile_steps", "Megatron counts steps done from 0: jaxpar steps start+1..end"
            )
        a.note("--profile-ranks", "approximated", "train.profile_steps", "every jaxpar process traces its own devices")
    else:
        for name in ("--profile-step-start", "--profile-step-end", "--profile-ranks"):
            a.note(name, "approximated", "", _NOOP + "without --profile Megatron traces nothing")


# Megatron's loss-scale flags -> train.loss_scale fields (megatron/training/arguments.py defaults)
LOSS_SCALE_FLAGS = {
    "--min-loss-scale": ("min_scale", float, 1.0),
    "--loss-scale-window": ("window", int, 1000),
    "--hysteresis": ("hysteresis", int, 2),
}


def _loss_scale(a: _Args, values: dict[str, Any]) -> None:
    """--fp16's loss scale: --loss-scale fixes it, else Megatron's DynamicGradScaler from
    --initial-loss-scale (default 2**32), --min-loss-scale, --loss-scale-window, --hysteresis. With
    --deepspeed the DeepSpeed JSON's fp16 section decides instead (DeepSpeed's rule)."""
    flags = ("--loss-scale", "--initial-loss-scale", *LOSS_SCALE_FLAGS)
    if a.get("--deepspeed", bool, False):
        a.note(
            "--fp16",
            "approximated",
            "model.compute_dtype",
            "float16 with DeepSpeed's loss scaler, whose settings are the DeepSpeed JSON's fp16 section (port it "
            "too); the port keeps DeepSpeed's defaults (train.loss_scale)",
        )
        for name in flags:
            a.note(name, "approximated", "", _NOOP + "with --deepspeed the DeepSpeed JSON's fp16 section decides")
        return
    static = a.get("--loss-scale", float, None)
    if static is not None and not (math.isfinite(static) and static >= 0):
        raise ConfigError(f"megatron: --loss-scale {static:g}: use a fixed scale > 0, or drop it for a dynamic one")
    if static is not None and static > 0:
        values["train.loss_scale.static"] = static
        a.note("--fp16", "mapped", "model.compute_dtype", "float16 with a fixed loss scale (--loss-scale)")
        a.note("--loss-scale", "mapped", "train.loss_scale.static")
        for name in flags[1:]:
            a.note(name, "approximated", "", _NOOP + "Megatron ignores it with a fixed --loss-scale")
        return
    values["train.loss_scale.rule"] = "megatron"
    a.note("--fp16", "mapped", "model.compute_dtype", "float16 with Megatron's dynamic loss scaling (train.loss_scale)")
    a.note("--loss-scale", "mapped", "train.loss_scale.static", "none: dynamic")
    initial = a.get("--initial-loss-scale", float, 2.0**32)
    power = round(math.log2(initial)) if initial > 0 and math.isfinite(initial) else -1
    if not 0 <= power <= 64:
        raise ConfigError(f"megatron: --initial-loss-scale {initial:g}: use a scale in [1, 2**64]; fix the value")
    values["train.loss_scale.initial_scale_power"] = power
    exact = 2.0**power == initial
    a.note(
        "--initial-loss-scale",
        "mapped" if exact else "approximated",
        "train.loss_scale.initial_scale_power",
        f"2**{power}" if exact else f"2**{power}, the nearest power of two: jaxpar starts the scale at a power of two",
    )
    if not a.has("--initial-loss-scale"):
        a.report.mapped("(initial loss scale)", "2**32", "train.loss_scale.initial_scale_power", "Megatron's default")
    for name, (field, kind, default) in LOSS_SCALE_FLAGS.items():
        values[f"train.loss_scale.{field}"] = a.get(name, kind, default)
        a.note(name, "mapped", f"train.loss_scale.{field}", "Megatron's DynamicGradScaler rule")


# Megatron's defaults of the run options _misc maps (megatron/arguments.py): a recipe without them runs these
RUN_DEFAULTS = {"--seed": 1234, "--log-interval": 100, "--eval-interval": 1000, "--eval-iters": 100}


def _misc(a: _Args, values: dict[str, Any]) -> None:
    """Precision, recompute, data, checkpoints, logging."""
    fp16 = a.get("--fp16", bool, False) and not a.get("--bf16", bool, False)
    dtype = "bfloat16" if a.get("--bf16", bool, False) else "float16" if fp16 else "float32"
    values["model.compute_dtype"] = dtype
    a.note("--bf16", "mapped", "model.compute_dtype")
    if fp16:
        _loss_scale(a, values)
    if dtype == "float32":
        a.report.mapped(
            "(precision)", "fp32", "model.compute_dtype", "neither --bf16 nor --fp16: Megatron trains in fp32"
        )
    if a.get("--grad-reduce-in-bf16", bool, False):
        values["parallel.grad_reduce_dtype"] = "bfloat16"
    a.note("--grad-reduce-in-bf16", "mapped", "parallel.grad_reduce_dtype")
    a.note("--accumulate-allreduce-grads-in-fp32", "mapped", "parallel.grad_reduce_dtype")
    granularity = a.get("--recompute-granularity", str)
    if a.get("--checkpoint-activations", bool, False):
        granularity = granularity or "full"
    if a.get("--recompute-activations", bool, False):
        granularity = granularity or "selective"
    if granularity:
        values["parallel.recompute"] = granularity if granularity in ("full", "selective") else "full"
    for name in ("--recompute-granularity", "--recompute-activations", "--checkpoint-activations"):
        a.note(name, "mapped", "parallel.recompute")
    for name, note in (
        ("--recompute-method", "jaxpar rematerializes every layer"),
        ("--recompute-num-layers", "jaxpar rematerializes every layer"),
        ("--deepspeed-activation-checkpointing", "DeepSpeed's implementation; same policy in jaxpar"),
        ("--calculate-per-token-loss", "jaxpar averages the loss over the tokens of the global batch"),
        ("--load", "train.resume=auto resumes from train.workdir"),
    ):
        a.note(name, "approximated", "train.resume" if name == "--load" else "", note)
    for name, key, kind in (
        ("--seed", "train.seed", int),
        ("--log-interval", "train.log_every", int),
        ("--eval-interval", "train.eval_every", int),
        ("--eval-iters", "train.eval_batches", int),
        ("--save-interval", "checkpoint.every", int),
        ("--save", "train.workdir", str),
    ):
        value = a.get(name, kind, soft=True)
        if value is not None:
            values[key] = value
        elif name in RUN_DEFAULTS and not a.has(name):  # absent: Megatron's default, not jaxpar's
            values[key] = RUN_DEFAULTS[name]
            a.report.mapped(f"{name} (default)", RUN_DEFAULTS[name], key, "Megatron's default")
        a.note(
            name,
            "mapped" if value is not None else "approximated",
            key,
            "" if value is not None else "value unresolved: jaxpar default kept",
        )
    if values.get("train.eval_batches") == 0:  # Megatron: --eval-iters 0 evaluates at no interval
        values["train.eval_every"] = 0
    data = a.get("--data-path", str, soft=True)
    if a.get("--mock-data", bool, False):
        values["data.source"] = "synthetic"
        a.note("--mock-data", "mapped", "data.source")
    elif data:
        parts = data.split()
        prefixes = parts[1::2] if len(parts) > 1 and len(parts) % 2 == 0 else parts
        values.update({"data.source": "megatron", "data.path": prefixes[0]})
        a.note(
            "--data-path",
            "mapped" if len(prefixes) == 1 else "approximated",
            "data.path",
            "" if len(prefixes) == 1 else f"first of {len(prefixes)} blended prefixes",
        )
    a.note("--data-path", "approximated", "data.path", "value unresolved: data left at the jaxpar default")
    # read as Megatron-core's parse_and_normalize_split does: the numbers in it (quotes a script left are ignored)
    split = [float(x) for x in re.findall(r"[.0-9]+", str(a.get("--split", str, "969,30,1")))]
    if values.get("data.source") == "synthetic":  # jaxpar's synthetic batches are not split
        a.note("--split", "approximated", "", "with --mock-data jaxpar's synthetic data has no validation share")
    elif a.has("--split") and len(split) >= 2 and 0 < sum(split[1:]) < sum(split):
        values["data.val_fraction"] = sum(split[1:]) / sum(split)
    a.note("--split", "approximated", "data.val_fraction", "validation + test share of the split")
