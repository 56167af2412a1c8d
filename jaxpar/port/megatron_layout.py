"""Megatron's parallel sizes -> jaxpar's mesh and ``parallel.*`` fields: world size, tensor /
pipeline / context / data sizes, uneven pipeline stages, FSDP and context parallelism."""

from __future__ import annotations

import re
from typing import Any

from jaxpar.config import ConfigError
from jaxpar.port.bash import Shell, unresolved_names
from jaxpar.port.megatron_flags import Args

# variables the world size is read from even when no expansion names them (see read_sizes)
SIZE_VARIABLES = ("WORLD_SIZE", "NNODES", "NUM_NODES", "N_NODES", "GPUS_PER_NODE")


def read_sizes(a: Args, shell: Shell, world_size: int | None) -> dict[str, Any]:
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


def _uneven_stages(a: Args, values: dict[str, Any], pp: int, layers: int) -> None:
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


def map_layout(a: Args, values: dict[str, Any], s: dict[str, Any], layers: int) -> None:
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


def _context(a: Args, values: dict[str, Any], cp: int) -> None:
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
