"""Megatron's model flags -> jaxpar's ``model.*`` fields: shapes, RoPE and its scaling, the vocabulary,
multi-latent attention, and the flags that would change the model trained (model changes)."""

from __future__ import annotations

import math
from typing import Any

from jaxpar.config import ConfigError
from jaxpar.port.bash import show
from jaxpar.port.megatron_flags import MODEL_FLAG_FIXES, MODEL_FLAGS, NOOP_NOTE, TOKENIZER_VOCAB, Args

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


def _rope_scaling(a: Args, values: dict[str, Any], position: str) -> None:
    """``--use-rope-scaling`` (Llama 3.1's scaled RoPE) -> ``model.rope_scaling=llama3``
    (:data:`ROPE_SCALING`). Megatron applies it to RoPE only (``--position-embedding-type rope``).
    ``pretrain_gpt.py`` never passes ``--rope-scaling-factor`` to the model: its model config
    (``gpt_config_from_args`` in megatron/training/argument_utils.py at d98e8a6; ``gpt_builder`` and,
    since the flag came in with 8c98d2d, the model providers before them) sets ``rope_scaling`` from
    ``--use-rope-scaling`` only, so GPTModel scales by its default 8 whatever the flag says."""
    use = a.get("--use-rope-scaling", bool, False)
    if not use:
        a.note(
            "--rope-scaling-factor", "approximated", "", NOOP_NOTE + "Megatron reads it only with --use-rope-scaling"
        )
        return
    if position != "rope":
        why = f"Megatron scales RoPE only, not {position} positions"
        a.note("--use-rope-scaling", "approximated", "", NOOP_NOTE + why)
        a.note("--rope-scaling-factor", "approximated", "", NOOP_NOTE + why)
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


def map_model(a: Args, values: dict[str, Any]) -> int:
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
    qk = a.has("--qk-layernorm") and not flag_off("--qk-layernorm", show(" ".join(a.flags["--qk-layernorm"])).strip())
    block = (values["model.norm"], values["model.mlp_activation"], values["model.position"])
    experts = a.get("--num-experts", str, "0", soft=True) not in ("0", "None")  # "8 16": map_moe refuses it
    router = a.get("--moe-router-score-function", str, "softmax", soft=True) == "softmax"
    qwen3_moe = router and not a.get("--moe-shared-expert-intermediate-size", int, 0, soft=True)
    if qk and block == ("rmsnorm", "swiglu", "rope") and (not experts or qwen3_moe):
        name = "qwen3_moe" if experts else "qwen3"  # Megatron: TENorm over kv-channels, before RoPE
        values.update({"model.qk_norm": True, "model.name": name})
        a.note("--qk-layernorm", "mapped", "model.qk_norm, model.name", f"RMSNorm of each query and key head: {name}")
    _vocab(a, values)
    return layers


def _vocab(a: Args, values: dict[str, Any]) -> None:
    tp = a.get("--tensor-model-parallel-size", int, 1) or 1
    multiple = a.get("--make-vocab-size-divisible-by", int, 128) * tp
    tokenizer = a.get("--tokenizer-type", str, soft=True)
    # Pai's Qwen3Tokenizer reports --padded-vocab-size as its size, and Megatron-LM (6a6cd47, Pai's 250624
    # backend: build_tokenizer) pads only when it is not given
    if a.pai and a.get("--padded-vocab-size", int):
        values["model.vocab_size"] = a.get("--padded-vocab-size", int)
        a.note("--padded-vocab-size", "mapped", "model.vocab_size", "Pai's Qwen3Tokenizer: its vocabulary size")
        a.note(
            "--extra-vocab-size", "approximated", "", NOOP_NOTE + "Qwen3Tokenizer ignores it given --padded-vocab-size"
        )
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


def flag_off(name: str, value: str) -> bool:
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


def report_model_changes(a: Args) -> None:
    """The flags of :data:`MODEL_FLAGS` (given and not off), ``--softmax-type`` other than vanilla, and
    GeLU's form, as report rows."""
    for name, why in MODEL_FLAGS.items():
        if a.has(name) and flag_off(name, show(" ".join(a.flags[name])).strip()):
            a.note(name, "approximated", "", NOOP_NOTE + "off")
        else:
            a.model_change(name, why, *MODEL_FLAG_FIXES.get(name, ()))
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
ONLY_DEEPSEEK = "jaxpar has it in its deepseek_v3 family only, whose attention is MLA (add --multi-latent-attention)"


def map_mla(a: Args, values: dict[str, Any]) -> None:
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
