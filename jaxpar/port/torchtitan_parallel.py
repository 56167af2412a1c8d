"""torchtitan's ``[parallelism]`` section -> jaxpar's mesh and ``parallel.*`` fields: the degrees, the
pipeline's schedule and stage split, context parallelism."""

from __future__ import annotations

from jaxpar.config import ConfigError
from jaxpar.port.report import Report
from jaxpar.port.torchtitan_keys import KNOWN, NOOP, count

SCHEDULES = {"1F1B": "1f1b", "GPipe": "gpipe", "Interleaved1F1B": "interleaved"}
# torchtitan's split of the layers over pipeline stages (pipeline_parallel.generate_llm_fqn_per_model_part)
STAGE_KEYS = (
    "pipeline_parallel_first_stage_less_layers",
    "pipeline_parallel_last_stage_less_layers",
    "pipeline_parallel_layers_per_stage",
)


def torchtitan_stage_layers(num_layers: int, stages: int, first_less: int = 1, last_less: int = 1) -> list[int]:
    """Layers of each pipeline stage as torchtitan cuts them: the embedding counts as ``first_less``
    layers and the output as ``last_less`` (both 1 by default), the total split as evenly as it
    goes with the extra ones on the first stages, then the embedding's and output's shares taken
    off the first and last stage."""
    per, extra = divmod(num_layers + first_less + last_less, stages)
    counts = [per + (1 if i < extra else 0) for i in range(stages)]
    counts[0] -= first_less
    counts[-1] -= last_less
    return counts


def _stage_split(p: dict, values: dict, report: Report, pp: int, schedule: str) -> None:
    """torchtitan's stage split (:func:`torchtitan_stage_layers`) onto ``parallel.layers_per_stage``."""
    first = count(p, "parallelism.pipeline_parallel_first_stage_less_layers", 1, zero=True)
    last = count(p, "parallelism.pipeline_parallel_last_stage_less_layers", 1, zero=True)
    layers, single = values.get("model.num_layers"), schedule in ("1F1B", "GPipe")
    per_stage = p.get("pipeline_parallel_layers_per_stage")
    stages = pp * (1 if single else 2)
    if per_stage is not None:
        per_stage = count(p, "parallelism.pipeline_parallel_layers_per_stage", 1)
        stages = -(-(layers + first + last) // per_stage)
        if single and stages != pp:
            raise ConfigError(
                f"torchtitan: parallelism.pipeline_parallel_layers_per_stage = {per_stage} gives {stages} stages "
                f"for {layers} layers (+{first} for the embedding, +{last} for the output), but {schedule} runs "
                f"one stage per rank of pipeline_parallel_degree {pp}; fix one of them"
            )
    given = {key: p[key] for key in STAGE_KEYS if key in p}
    if pp <= 1 or not layers:
        for key, value in given.items():
            report.approximated(f"parallelism.{key}", value, "", "no-op: pipeline_parallel_degree = 1")
        return
    counts = torchtitan_stage_layers(layers, stages, first, last)
    shown = ",".join(map(str, counts))
    if single:
        if len(set(counts)) > 1:
            values["parallel.layers_per_stage"] = shown
        target, status, note = "parallel.layers_per_stage", "mapped", f"torchtitan's split: {shown} layers per stage"
    else:
        virtual = stages // pp
        values["parallel.virtual_stages"] = virtual
        even = len(set(counts)) == 1
        target, status = "parallel.virtual_stages", "mapped" if even else "approximated"
        note = f"{virtual} virtual stages per rank" + (
            "" if even else f"; torchtitan cuts {shown}, jaxpar equal chunks of num_layers / {stages}"
        )
    if not given and len(set(counts)) > 1:  # the defaults (1 and 1) made the split uneven
        given = {f"{STAGE_KEYS[0]} (default)": first, f"{STAGE_KEYS[1]} (default)": last}
    for key, value in given.items():
        report.add(f"parallelism.{key}", value, status, target, note)


def parallel_section(p: dict, t: dict, world: int | None, allow: bool, values: dict, report: Report) -> None:
    rep, shard = (
        count(p, "parallelism.data_parallel_replicate_degree", 1),
        count(p, "parallelism.data_parallel_shard_degree", -1, auto=True),
    )
    tp, pp = count(p, "parallelism.tensor_parallel_degree", 1), count(p, "parallelism.pipeline_parallel_degree", 1)
    cp = count(p, "parallelism.context_parallel_degree", 1)
    fixed = rep * tp * pp * cp
    if shard == -1:
        if world is None and not allow:
            raise ConfigError(
                "torchtitan: parallelism.data_parallel_shard_degree = -1 takes the remaining ranks, so "
                "the world size is needed; pass --world-size N (the GPUs the preset was written for)"
            )
        world = world if world is not None else fixed
        if world % fixed:
            raise ConfigError(
                f"torchtitan: world size {world} is not divisible by replicate*tensor*pipeline*context "
                f"= {rep}*{tp}*{pp}*{cp} = {fixed}; pass a multiple of {fixed}"
            )
        shard = world // fixed
    elif world is not None and world != fixed * shard:
        raise ConfigError(
            f"torchtitan: the parallelism degrees multiply to {fixed * shard} but the world size is "
            f"{world}; make their product equal the world size (or set data_parallel_shard_degree=-1)"
        )
    dp = rep * shard
    local = count(t, "training.local_batch_size", count(t, "training.batch_size", 8))
    global_batch = count(t, "training.global_batch_size", -1, auto=True, zero=True)
    global_batch = local * dp if global_batch in (-1, 0) else global_batch
    if global_batch % (local * dp):
        raise ConfigError(
            f"torchtitan: training.global_batch_size {global_batch} is not a multiple of "
            f"local_batch_size {local} * data-parallel degree {dp}; fix one of them"
        )
    accum = global_batch // (local * dp)
    pp_micro = count(p, "parallelism.pipeline_parallel_microbatch_size", 1)
    micro = accum * (local // pp_micro if pp > 1 and local % pp_micro == 0 else 1)
    values.update(
        {
            "mesh.data": dp,
            "mesh.tensor": tp,
            "mesh.pipeline": pp,
            "mesh.context": cp,
            "train.global_batch": global_batch,
            "parallel.microbatches": micro,
            "parallel.zero_stage": 3 if shard > 1 else 0,
        }
    )
    rotate = _context(p, t, cp, values, report)
    note = {
        "data_parallel_shard_degree": f"FSDP over {shard} ranks = ZeRO-3 on mesh.data"
        if shard > 1
        else "no FSDP sharding: ZeRO-0",
        "data_parallel_replicate_degree": ""
        if rep == 1 or shard == 1
        else f"HSDP: jaxpar shards over all {dp} data ranks instead of {shard} and replicating {rep}x",
        "context_parallel_degree": ""
        if cp == 1
        else f"the sequence split over {cp} context ranks in {2 * cp} "
        "load-balanced chunks; blockwise attention; FSDP and gradients over data x context",
        "context_parallel_rotate_method": rotate,
        "pipeline_parallel_microbatch_size": f"microbatches = local/microbatch size * accumulation = {micro}",
    }
    target = {
        "data_parallel_replicate_degree": "mesh.data",
        "data_parallel_shard_degree": "mesh.data, parallel.zero_stage",
        "tensor_parallel_degree": "mesh.tensor",
        "pipeline_parallel_degree": "mesh.pipeline",
        "context_parallel_degree": "mesh.context, model.attention",
        "context_parallel_rotate_method": "parallel.context_exchange",
        "pipeline_parallel_microbatch_size": "parallel.microbatches",
    }
    schedule = str(p.get("pipeline_parallel_schedule", "1F1B"))
    if pp > 1 and schedule in SCHEDULES:
        values["parallel.pipeline_schedule"] = SCHEDULES[schedule]
        if schedule == "Interleaved1F1B":
            values["parallel.virtual_stages"] = 2
    split = pp <= 1 or schedule in SCHEDULES  # else the schedule is approximated and so is its split
    if split:
        _stage_split(p, values, report, pp, schedule)
    for key, value in p.items():
        src = f"parallelism.{key}"
        if key in STAGE_KEYS and split:
            continue
        if key in target:
            bad = (key == "context_parallel_rotate_method" and (cp == 1 or str(value) not in ROTATE_METHODS)) or (
                key == "data_parallel_replicate_degree" and note[key]
            )
            report.add(src, value, "approximated" if bad else "mapped", target[key], note.get(key, ""))
        elif key == "pipeline_parallel_schedule":
            ok = pp == 1 or schedule in ("1F1B", "GPipe")
            report.add(
                src,
                value,
                "mapped" if ok else "approximated",
                "parallel.pipeline_schedule",
                ""
                if pp > 1
                else "no-op: pipeline_parallel_degree = 1"
                if ok
                else "interleaved with 2 virtual stages per rank",
            )
        elif key == "expert_parallel_degree" and int(value) > 1 and values.get("model.name") == "deepseek_v3":
            ep = int(value)
            if dp % ep:
                raise ConfigError(
                    f"torchtitan: parallelism.expert_parallel_degree {ep} does not divide the data-parallel "
                    f"degree {dp}; jaxpar's expert axis takes its ranks from data: use a divisor of {dp}"
                )
            values.update({"mesh.data": dp // ep, "mesh.expert": ep})
            report.mapped(
                src,
                value,
                "mesh.expert, mesh.data",
                f"experts over {ep} expert ranks taken from data: data = {dp} / {ep} = {dp // ep}; attention "
                f"and dense layers still data-parallel over data x expert = {dp}",
            )
        elif key in ("expert_parallel_degree", "expert_tensor_parallel_degree") and int(value) > 1:
            report.unsupported(
                src,
                value,
                "mixture-of-experts parallelism: no torchtitan MoE family ports to jaxpar's MoE (see model.name), "
                "so mesh.expert stays 1 (torchtitan borrows its expert ranks from the other degrees: the mesh "
                "keeps its size)",
            )
        elif key == "fsdp_reshard_after_forward":
            report.approximated(
                src,
                value,
                "parallel.zero_stage",
                "jaxpar's ZeRO-3 re-gathers parameters in the backward pass (reshard after forward)",
            )
        elif key in KNOWN["parallelism"]:
            report.approximated(src, value, "", NOOP + "XLA decides this (or it is off)")
        else:
            report.unknown(src, value, [f"parallelism.{k}" for k in KNOWN["parallelism"]], "torchtitan")
    split = (
        f" = data x expert ({values['mesh.data']} x {values['mesh.expert']})"
        if values.get("mesh.expert", 1) > 1
        else ""
    )
    report.mapped("(world size)", dp * cp * tp * pp, "mesh.data", f"data = replicate*shard = {dp}{split}")
    report.mapped(
        "training.local_batch_size",
        local,
        "train.global_batch",
        f"global batch = {global_batch} ({accum} accumulation step(s))",
    )


# parallelism.context_parallel_rotate_method -> parallel.context_exchange (jaxpar.ops.context_parallel)
ROTATE_METHODS = {"allgather": "all_gather"}


def _context(p: dict, t: dict, cp: int, values: dict, report: Report) -> str:
    """Context parallelism: ``context_parallel_degree`` -> ``mesh.context`` with blockwise attention;
    the rotate method -> the exchange: ``allgather`` (torchtitan's default) the all-gather,
    ``alltoall`` (keys and values passed on by all-to-all) the ring, its nearest counterpart.
    Returns the rotate method's report note."""
    seq = count(t, "training.seq_len", 2048)
    if cp > 1 and seq % (2 * cp):
        raise ConfigError(
            f"torchtitan: training.seq_len {seq} is not divisible by 2 * "
            f"parallelism.context_parallel_degree {cp} = {2 * cp} (each context rank holds two chunks "
            f"of the sequence); use a multiple of {2 * cp}"
        )
    method = str(p.get("context_parallel_rotate_method", "allgather"))
    exchange = ROTATE_METHODS.get(method, "ring")
    if cp == 1:
        return "no effect: context_parallel_degree = 1"
    if exchange == "ring" and values.get("mesh.pipeline", 1) > 1:  # the ring runs only outside pipeline stages
        values.update({"model.attention": "blockwise", "parallel.context_exchange": "all_gather"})
        return (
            f"{method}: jaxpar runs the ring only outside pipeline stages; with pipeline parallelism keys "
            "and values are all-gathered instead (the same attention, different messages)"
        )
    values.update({"model.attention": "blockwise", "parallel.context_exchange": exchange})
    if "context_parallel_rotate_method" not in p:
        report.mapped(
            "parallelism.context_parallel_rotate_method (default)",
            method,
            "parallel.context_exchange",
            "torchtitan's default: keys and values all-gathered",
        )
    if method in ROTATE_METHODS:
        return "keys and values all-gathered over the context ranks"
    return (
        f"{method}: no all-to-all rotation in jaxpar; the ring (keys and values passed rank to rank by "
        "collective-permute) runs instead: the same attention, different messages"
    )
