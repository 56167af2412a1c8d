"""Megatron-core's and Megatron-DeepSpeed's mixture-of-experts flags -> jaxpar's MoE fields: experts,
the router and its balancing, the layer frequency, expert parallelism."""

from __future__ import annotations

import ast
from typing import Any

from jaxpar.config import ConfigError
from jaxpar.port.bash import show
from jaxpar.port.megatron_flags import LOG, NOOP_NOTE, PERF, Args
from jaxpar.port.megatron_model import ONLY_DEEPSEEK

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
    "--moe-per-layer-logging": LOG,
    "--moe-shared-expert-overlap": PERF,
    "--overlap-moe-expert-parallel-comm": "XLA schedules the expert all-gather and reduce-scatter",
    "--moe-use-grouped-tensor": PERF,
    "--moe-flex-dispatcher-backend": "the flex dispatcher's kernels (DeepEP / HybridEP): the same function, "
    "different messages; jaxpar's dispatch is its own (--moe-token-dispatcher-type)",
}
BALANCING_TYPES = ("aux_loss", "none")


def expert_count(a: Args) -> int:
    """The routed-expert count of ``--num-experts`` (0: none or unresolved)."""
    counts = [int(x) for x in str(a.get("--num-experts", str, "", soft=True) or "").split() if x.isdigit()]
    return max(counts, default=0) if len(set(counts)) == 1 and counts[0] > 1 else 0


def map_moe(a: Args, values: dict[str, Any], s: dict[str, Any], approximate: bool = False) -> int:
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
            a.note(name, "approximated", "", NOOP_NOTE + "no mixture of experts without --num-experts > 1")
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
        else "qwen3_moe"  # map_model checked the router (softmax, no shared expert)
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


def _moe_core(a: Args, values: dict[str, Any], s: dict[str, Any]) -> list[str]:
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


def _layer_freq(a: Args, values: dict[str, Any], deepseek: bool) -> list[str]:
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


def _router(a: Args, values: dict[str, Any], deepseek: bool, topk: int, score: str) -> list[str]:
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
        refusals.append(f"--moe-router-enable-expert-bias: aux-loss-free balancing; {ONLY_DEEPSEEK}")
    elif bias:
        values["model.router_bias_rate"] = rate
        a.note("--moe-router-enable-expert-bias", "mapped", "model.router_bias_rate", "selection-only expert bias")
        a.note("--moe-router-bias-update-rate", "mapped", "model.router_bias_rate", "bias += rate*sign(mean-load)")
        if not a.has("--moe-router-bias-update-rate"):
            a.report.mapped("--moe-router-bias-update-rate (default)", rate, "model.router_bias_rate", "Megatron")
    if not bias:
        a.note("--moe-router-bias-update-rate", "approximated", "", NOOP_NOTE + "no expert bias")
    scale = a.get("--moe-router-topk-scaling-factor", float, None)
    if scale not in (None, 1.0) and not deepseek:
        refusals.append(f"--moe-router-topk-scaling-factor {scale:g}: a route scale; {ONLY_DEEPSEEK}")
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
            refusals.append(f"--moe-router-group-topk {group_topk}: group-limited routing; {ONLY_DEEPSEEK}")
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
        a.note("--moe-router-num-groups", "approximated", "", NOOP_NOTE + "without --moe-router-group-topk")
    return refusals


def _moe_deepspeed(a: Args, values: dict[str, Any], experts: int) -> list[str]:
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
        a.note(name, "approximated", "", NOOP_NOTE + "with --disable-moe-token-dropping no token is dropped")
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
    a.note("--use-tutel", "approximated", "", PERF)
    a.note("--enable-expert-tensor-parallelism", "approximated", "", "jaxpar splits experts over tensor always")
    return refusals
