"""torchtitan's ``[model]`` section -> jaxpar's ``model.*`` fields: the flavors of each family (llama3,
llama2, qwen3, deepseek_v3) at the pinned torchtitan commits, and the mapping of a job's model."""

from __future__ import annotations

from typing import Any

from jaxpar.port.report import Report
from jaxpar.port.torchtitan_keys import KNOWN, NOOP, count

# torchtitan's Llama 3 flavors at 238fa99 (torchtitan/models/llama3/__init__.py and model/args.py there:
# TransformerModelArgs defaults n_kv_heads = n_heads, multiple_of 256, ffn_dim_multiplier None, norm_eps
# 1e-5, vocab_size 128256): flavor -> (dim, layers, heads, kv_heads, ffn_dim_multiplier, multiple_of,
# vocabulary); rope_theta 500000 in all. Since 5bbda42 (2025-10, "Add scaled RoPE support for Llama 3
# and 4") every flavor rotates with Llama 3.1's scaled RoPE (TransformerModelArgs.rope_scaling_args =
# RoPEScalingArgs(): scaling_factor 8, low_freq_factor 1, high_freq_factor 4,
# original_max_position_embeddings 8192, applied in precompute_freqs_cis): model.rope_scaling=llama3
# (LLAMA3_ROPE_SCALING).
LLAMA3_FLAVORS = {
    "debugmodel": (256, 6, 16, 16, None, 256, 2048),
    "debugmodel_flex_attn": (256, 6, 16, 16, None, 256, 2048),
    "debugmodel_varlen_attn": (256, 6, 16, 16, None, 256, 2048),
    "8B": (4096, 32, 32, 8, 1.3, 1024, 128256),
    "8B_flex": (4096, 32, 32, 8, 1.3, 1024, 128256),
    "8B_varlen": (4096, 32, 32, 8, 1.3, 1024, 128256),
    "70B": (8192, 80, 64, 8, 1.3, 4096, 128256),
    "405B": (16384, 126, 128, 8, 1.2, 4096, 128256),
}
# flavors with attn_mask_type="block_causal": attention stops at document boundaries (model.attention_mask)
LLAMA3_BLOCK_CAUSAL = ("debugmodel_flex_attn", "debugmodel_varlen_attn", "8B_flex", "8B_varlen")
LLAMA3_ROPE_SCALING = {
    "model.rope_scaling": "llama3",
    "model.rope_scaling_factor": 8.0,
    "model.rope_low_freq_factor": 1.0,
    "model.rope_high_freq_factor": 4.0,
    "model.rope_original_max_seq_len": 8192,
}
# the 2024 schema's Llama 3 flavors (torchtitan/models/llama/__init__.py at a99d2e5, llama3_configs;
# plain RoPE, theta 500000): flavor -> (dim, layers, heads, kv_heads, ffn_dim_multiplier, multiple_of);
# the vocabulary is the tokenizer's (ModelArgs.vocab_size = tokenizer.n_words in train.py there)
LLAMA3_2024_FLAVORS = {
    "debugmodel": (256, 8, 16, 16, None, 256),
    "8B": (4096, 32, 32, 8, 1.3, 1024),
    "70B": (8192, 80, 64, 8, 1.3, 4096),
    "405B": (16384, 126, 128, 8, 1.2, 4096),
}
LLAMA3_VOCAB = 128256  # the Llama 3 tokenizer: 128000 BPE ranks + 256 special tokens
# a99d2e5's test/assets/test_tiktoken.model: 2000 BPE ranks + the TikTokenizer's 256 special tokens
TEST_TIKTOKEN_VOCAB = 2256
# torchtitan's 2024 Llama 2 flavors (torchtitan/models/llama/__init__.py at a99d2e5; ModelArgs
# defaults: n_kv_heads = n_heads, multiple_of 256, rope_theta 10000): flavor ->
# (dim, layers, heads, kv_heads, ffn_dim_multiplier, multiple_of); vocabulary: the Llama 2
# tokenizer's 32000 (the tokenizer file is not read)
LLAMA2_FLAVORS = {
    "debugmodel": (256, 8, 16, 16, None, 256),
    "271M": (1024, 16, 8, 8, None, 256),
    "1B": (2048, 18, 16, 16, None, 256),
    "7B": (4096, 32, 32, 32, None, 256),
    "13B": (5120, 40, 40, 40, None, 256),
    "26B": (5120, 80, 40, 40, None, 256),
    "70B": (8192, 80, 64, 8, 1.3, 4096),
}
LLAMA2_VOCAB = 32000
# torchtitan's dense Qwen3 flavors (torchtitan/models/qwen3/__init__.py at 238fa99): flavor ->
# (dim, layers, heads, kv_heads, hidden_dim, tied embeddings); every one: head_dim 128, QK-norm,
# RoPE 1e6, RMSNorm eps 1e-6, vocabulary 151936 (debugmodel: 2048)
QWEN3_FLAVORS = {
    "debugmodel": (256, 8, 16, 8, 3072, True),
    "0.6B": (1024, 28, 16, 8, 3072, True),
    "1.7B": (2048, 28, 16, 8, 6144, True),
    "4B": (2560, 36, 32, 8, 9728, True),
    "8B": (4096, 36, 32, 8, 12288, False),
    "14B": (5120, 40, 40, 8, 17408, False),
    "32B": (5120, 64, 64, 8, 25600, False),
}
# torchtitan's DeepSeek-V3 flavors (torchtitan/models/deepseek_v3/__init__.py and model/args.py at 238fa99):
# flavor -> (vocab, dim, inter_dim, moe_inter_dim, n_layers, n_dense_layers, n_heads, num_experts,
# num_shared_experts, top_k, score_func, route_norm, route_scale, num_expert_groups, num_limited_groups,
# q_lora_rank, kv_lora_rank, qk_nope, qk_rope, v_head_dim). Every one: RMSNorm eps 1e-5, RoPE theta 10000
# with YaRN (rope_factor 40) only past original_seq_len 4096, score_before_experts False, load_balance_coeff
# 1e-3 (MoEArgs' default), attn_mask_type block_causal.
DEEPSEEK_V3_FLAVORS = {
    "16B": (102400, 2048, 10944, 1408, 27, 1, 16, 64, 2, 6, "softmax", False, 1.0, 1, 1, 0, 512, 128, 64, 128),
    "671B": (129280, 7168, 18432, 2048, 61, 3, 128, 256, 1, 8, "sigmoid", True, 2.5, 8, 4, 1536, 512, 128, 64, 128),
}
# block_causal ends each document at tokenizer.eos_id (get_document_mask_mod in torchtitan/models/attention.py at
# 238fa99), the EOS of the tokenizer under model.hf_assets_path, which jaxpar does not read: the EOS ids
# of the tokenizers torchtitan's own TOMLs name there (each repository's config.json eos_token_id, the id
# of its tokenizer_config.json eos_token), by the path's last component
EOS_IDS = {
    "deepseek-moe-16b-base": 100001,  # deepseek-ai/deepseek-moe-16b-base (deepseek_v3_16b.toml)
    "DeepSeek-V3.1-Base": 1,  # deepseek-ai/DeepSeek-V3.1-Base (deepseek_v3_671b.toml)
    "Llama-3.1-8B": 128001,  # meta-llama/Llama-3.1-8B (llama3_8b.toml), <|end_of_text|>
}
DEEPSEEK_V3_ORIGINAL_SEQ = 4096  # original_seq_len: YaRN scales RoPE past it
DEEPSEEK_V3_BALANCE = 1e-3  # MoEArgs.load_balance_coeff's default at 238fa99
# torchtitan's MoE families: what keeps each from jaxpar's Mixtral-like MoE (model.num_experts); without
# --approximate each is refused (its dense stand-in would not be the recipe's model)
MOE_FAMILIES = {
    # reached only by a flavor without a row in DEEPSEEK_V3_FLAVORS (the family itself maps to deepseek_v3)
    "deepseek_v3": "a DeepSeek-V3 flavor whose shapes jaxpar has no table for (it knows 16B and 671B): "
    "port it with --approximate and set the model.* shapes",
    "llama4": "the router's sigmoid score multiplies each expert's input, not its output (MoEArgs'"
    " score_before_experts, True by default), and a shared expert with an aux-loss-free routing bias in a"
    " grouped-query-attention model (jaxpar has those two only in deepseek_v3, with MLA)",
    "qwen3": "its MoE flavors balance experts with a per-expert routing bias (MoEArgs' load_balance_coeff 1e-3 at "
    "238fa99, aux-loss-free), which jaxpar's qwen3_moe lacks (jaxpar has that bias in deepseek_v3 only); the dense flavors "
    "port (model.name=qwen3)",
    "gpt_oss": "attention sinks and biased experts",
}


def ffn_dim(dim: int, multiplier: float | None, multiple_of: int) -> int:
    """torchtitan/Meta LLaMA FeedForward hidden size: 2/3 of 4*dim, scaled, rounded up to multiple_of."""
    hidden = int(2 * (4 * dim) / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def _llama_shape(
    dim: int, layers: int, heads: int, kv: int, mult: float | None, multiple: int, theta: float, vocab: int
) -> dict[str, Any]:
    """The ``model.*`` shape of a torchtitan Llama flavor (head dim = dim / heads, untied, eps 1e-5)."""
    return {
        "model.embed_dim": dim,
        "model.num_layers": layers,
        "model.num_heads": heads,
        "model.num_kv_heads": kv,
        "model.head_dim": dim // heads,
        "model.mlp_dim": ffn_dim(dim, mult, multiple),
        "model.rope_theta": theta,
        "model.vocab_size": vocab,
        "model.norm_eps": 1e-5,
        "model.tie_embeddings": False,
    }


def _flavors(name: str, old: bool) -> str:
    """The flavors jaxpar knows for family ``name`` (``old``: in the 2024 schema's tables)."""
    llama3 = LLAMA3_2024_FLAVORS if old else LLAMA3_FLAVORS
    table = {"llama3": llama3, "llama2": LLAMA2_FLAVORS, "llama": LLAMA2_FLAVORS, "qwen3": QWEN3_FLAVORS}
    return ", ".join(table.get(name, {})) or "none"


def _block_causal(flavor: str, assets: str, values: dict, report: Report) -> None:
    """A flavor with ``attn_mask_type="block_causal"``: ``model.attention_mask=block_causal`` with
    the EOS id of the tokenizer ``assets`` (``model.hf_assets_path``) names (:data:`EOS_IDS`); an
    unknown tokenizer is a model change that ``--set model.eos_token_id=`` resolves."""
    values["model.attention_mask"] = "block_causal"
    report.mapped(
        "(attention mask)",
        "block_causal",
        "model.attention_mask",
        f"flavor {flavor}: attention also stops at document boundaries (each document ends at the tokenizer's EOS)",
    )
    name = assets.rstrip("/").rsplit("/", 1)[-1]
    if name in EOS_IDS:
        values["model.eos_token_id"] = EOS_IDS[name]
        report.mapped(
            "(document separator)",
            name,
            "model.eos_token_id",
            f"EOS id {EOS_IDS[name]} of the {name} tokenizer (its config.json eos_token_id), which torchtitan's "
            "tokenizer.eos_id is; jaxpar does not read the tokenizer: another one needs --set model.eos_token_id=",
        )
        return
    values["model.attention_mask"] = "causal"  # until the separator is given (or --approximate keeps it so)
    report.model_change(
        "(document separator)",
        assets or "(no model.hf_assets_path)",
        f"flavor {flavor} masks attention at document boundaries (attn_mask_type block_causal), which end at the "
        "tokenizer's EOS id; jaxpar does not read the tokenizer and does not know this one's",
        "give --set model.attention_mask=block_causal --set model.eos_token_id=<the tokenizer's EOS id>",
        needs=("model.attention_mask", "model.eos_token_id"),
        target="model.eos_token_id",
    )


def _deepseek_v3(flavor: str, seq: int, values: dict, report: Report, assets: str = "") -> None:
    """A DeepSeek-V3 flavor: ``model.name=deepseek_v3`` with the flavor's shape (:data:`DEEPSEEK_V3_FLAVORS`)."""
    (vocab, dim, inter, moe_inter, layers, dense, heads, experts, shared, top_k, score, norm, scale, groups,
     limited, q_lora, kv_lora, nope, rope, v) = DEEPSEEK_V3_FLAVORS[flavor]  # fmt: skip
    values.update(
        {
            "model.name": "deepseek_v3",
            "model.vocab_size": vocab,
            "model.embed_dim": dim,
            "model.mlp_dim": inter,
            "model.moe_mlp_dim": moe_inter,
            "model.num_layers": layers,
            "model.first_dense_layers": dense,
            "model.num_heads": heads,
            "model.num_kv_heads": heads,
            "model.head_dim": nope + rope,
            "model.num_experts": experts,
            "model.shared_expert_dim": shared * moe_inter,
            "model.experts_per_token": top_k,
            "model.router_score": score,
            "model.router_norm_topk": norm,
            "model.router_scale": scale,
            "model.router_groups": groups,
            "model.router_group_topk": limited,
            "model.q_lora_rank": q_lora,
            "model.kv_lora_rank": kv_lora,
            "model.qk_nope_head_dim": nope,
            "model.qk_rope_head_dim": rope,
            "model.v_head_dim": v,
            "model.norm_eps": 1e-5,
            "model.rope_theta": 10000.0,
            "model.router_bias_rate": DEEPSEEK_V3_BALANCE,
        }
    )
    report.mapped("model.name", "deepseek_v3", "model.name", "deepseek_v3: MLA, DeepSeekMoE, dense first layers")
    report.mapped(
        "model.flavor",
        flavor,
        "model.*",
        f"DeepSeek-V3 {flavor} (torchtitan's table at 238fa99): {layers} layers ({dense} dense), {experts} experts "
        f"top-{top_k} {score}, {shared} shared; vocabulary {vocab}",
    )
    report.approximated(
        "(load_balance_coeff)",
        DEEPSEEK_V3_BALANCE,
        "model.router_bias_rate",
        "torchtitan's default aux-loss-free bias update; torchtitan also subtracts the update's mean over the "
        "experts, jaxpar applies the paper's rate * sign(mean load - load) as it is",
    )
    if seq > DEEPSEEK_V3_ORIGINAL_SEQ:
        report.model_change(
            "training.seq_len",
            seq,
            f"past original_seq_len {DEEPSEEK_V3_ORIGINAL_SEQ} torchtitan's DeepSeek-V3 rotates with YaRN "
            "(rope_factor 40, mscale), which jaxpar does not implement",
            f"train at seq_len <= {DEEPSEEK_V3_ORIGINAL_SEQ}",
            target="model.rope_scaling",
        )
    _block_causal(flavor, assets, values, report)


def model_section(m: dict, t: dict, values: dict, report: Report, old: bool = False) -> None:
    """The model: a flavor of torchtitan's tables with its shape, or a model change naming why not
    (``old``: the TOML is in the 2024 schema, whose tables are a99d2e5's)."""
    name, flavor = str(m.get("name", "llama3")), str(m.get("flavor", "debugmodel"))
    seq = count(t, "training.seq_len", 2048)
    values.update({"train.seq_len": seq, "model.max_seq_len": seq})
    report.mapped("training.seq_len", seq, "train.seq_len, model.max_seq_len")
    tokenizer = str(m.get("tokenizer_path", ""))
    if name in ("llama2", "llama") and flavor in LLAMA2_FLAVORS:  # the 2024 schema names it llama2 (or llama)
        values.update(_llama_shape(*LLAMA2_FLAVORS[flavor], 10000.0, LLAMA2_VOCAB))
        report.mapped("model.name", name, "model.*")
        report.approximated(
            "model.flavor",
            flavor,
            "model.*",
            f"Llama 2 {flavor} (torchtitan's 2024 table); vocabulary {LLAMA2_VOCAB}, the Llama 2 tokenizer's, "
            "assumed: the tokenizer file is not read (set --set model.vocab_size= for another)",
        )
    elif name == "llama3" and old and flavor in LLAMA3_2024_FLAVORS:
        test_tokenizer = tokenizer.endswith("test_tiktoken.model")
        vocab = TEST_TIKTOKEN_VOCAB if test_tokenizer else LLAMA3_VOCAB
        values.update(
            _llama_shape(*LLAMA3_2024_FLAVORS[flavor], 500000.0, vocab)
            | {"model.mlp_activation": "swiglu", "model.norm": "rmsnorm", "model.position": "rope"}
        )
        report.mapped("model.name", name, "model.*")
        report.mapped(
            "model.flavor",
            flavor,
            "model.*",
            f"Llama 3 {flavor} (torchtitan's 2024 table at a99d2e5, plain RoPE); vocabulary {vocab} from "
            + (
                "torchtitan's test tokenizer (2000 ranks + 256 special tokens)"
                if test_tokenizer
                else "the Llama 3 tokenizer"
            ),
        )
    elif name == "llama3" and not old and flavor in LLAMA3_FLAVORS:
        dim, layers, heads, kv, mult, multiple, vocab = LLAMA3_FLAVORS[flavor]
        values.update(
            _llama_shape(dim, layers, heads, kv, mult, multiple, 500000.0, vocab)
            | {"model.mlp_activation": "swiglu", "model.norm": "rmsnorm", "model.position": "rope"}
        )
        report.mapped("model.name", name, "model.*")
        report.mapped(
            "model.flavor",
            flavor,
            "model.*",
            f"Llama 3 {flavor}'s shape (torchtitan's table at 238fa99); vocabulary {vocab}",
        )
        values.update(LLAMA3_ROPE_SCALING)
        report.mapped(
            "(rope scaling)",
            "Llama 3.1",
            "model.rope_scaling",
            "torchtitan's Llama 3 (this TOML is in its current schema; since 5bbda42, 2025-10) rotates with Llama "
            "3.1's scaled RoPE (RoPEScalingArgs at 238fa99: factor 8, low/high frequency factors 1/4, original "
            "context 8192), as model.rope_scaling=llama3 does; for a torchtitan before 5bbda42 (plain RoPE) "
            "--set model.rope_scaling=none",
        )
        if flavor in LLAMA3_BLOCK_CAUSAL:
            _block_causal(flavor, str(m.get("hf_assets_path", "")), values, report)
    elif name == "qwen3" and flavor in QWEN3_FLAVORS:
        dim, layers, heads, kv, hidden, tied = QWEN3_FLAVORS[flavor]
        vocab = 2048 if flavor == "debugmodel" else 151936
        values.update(
            {
                "model.name": "qwen3",
                "model.qk_norm": True,
                "model.embed_dim": dim,
                "model.num_layers": layers,
                "model.num_heads": heads,
                "model.num_kv_heads": kv,
                "model.head_dim": 128,
                "model.mlp_dim": hidden,
                "model.rope_theta": 1e6,
                "model.vocab_size": vocab,
                "model.norm_eps": 1e-6,
                "model.tie_embeddings": tied,
                "model.mlp_activation": "swiglu",
                "model.norm": "rmsnorm",
                "model.position": "rope",
            }
        )
        report.mapped("model.name", name, "model.name", "qwen3: LLaMA's block with QK-norm")
        report.mapped("model.flavor", flavor, "model.*", f"Qwen3 {flavor} (torchtitan's table); vocabulary {vocab}")
    elif name == "deepseek_v3" and flavor in DEEPSEEK_V3_FLAVORS:
        _deepseek_v3(flavor, seq, values, report, str(m.get("hf_assets_path", "")))
    elif name in MOE_FAMILIES:
        unlike = MOE_FAMILIES[name]
        if name == "llama4" and flavor.endswith("_irope"):  # every_n_layers_nope=4 in these flavors only
            unlike += ", and every 4th layer without positions beside chunked attention in the others (iRoPE)"
        why = (
            f"a mixture-of-experts model unlike jaxpar's MoE families ({unlike}; jaxpar's are mixtral "
            "and qwen3_moe: softmax-routed SwiGLU experts in every layer, and deepseek_v3); no jaxpar model computes "
            "it, jaxpar's default model would be trained"
        )
        report.model_change("model.name", name, why, target="model.*")
        report.unsupported("model.flavor", flavor, f"a {name} flavor: see model.name")
    else:
        known = name in ("llama3", "llama2", "llama", "qwen3")
        table = "the 2024 table (a99d2e5)" if old else "the current table (238fa99)"
        if known:
            why = f"{name} flavor '{flavor}' is not in torchtitan's {name} flavors jaxpar knows ({table})"
        else:
            why = f"model family '{name}' is not one jaxpar ports (llama3, llama2 and qwen3)"
        report.model_change(
            "model.flavor" if known else "model.name",
            flavor if known else name,
            why + ": no known shape, jaxpar's default model would be trained",
            f"use one of the flavors {_flavors(name, old)}" if known else "",
            target="model.*",
        )
        report.unsupported("model.name" if known else "model.flavor", name if known else flavor, "see the model change")
    converters = list(m.get("converters", []))
    for key, value in m.items():
        if key == "converters":
            report.add(
                f"model.{key}",
                value,
                "unsupported" if converters else "mapped",
                "",
                "no float8/MX training in jaxpar" if converters else "none",
            )
        elif key == "norm_type" and str(value) in ("rmsnorm", "compiled_rmsnorm", "fused_rmsnorm", "layernorm"):
            norm = "layernorm" if value == "layernorm" else "rmsnorm"
            values["model.norm"] = norm
            report.mapped(f"model.{key}", value, "model.norm", "2024 schema: the norm (compiled/fused: kernels)")
        elif key == "norm_type":
            report.model_change(
                f"model.{key}", value, f"norm '{value}' (2024 schema); jaxpar's norms are RMSNorm and LayerNorm"
            )
        elif key not in ("name", "flavor"):
            status = "approximated" if key in KNOWN["model"] else "unknown"
            if status == "unknown":
                report.unknown(f"model.{key}", value, [f"model.{k}" for k in KNOWN["model"]], "torchtitan")
            else:
                note = NOOP + "asset/tokenizer location"
                if key == "hf_assets_path" and values.get("model.attention_mask") == "block_causal":
                    note += " (its tokenizer's EOS id: see (document separator))"
                report.approximated(f"model.{key}", value, "", note)
