"""Render outcomes.md from pass1/2/3.json (written by run_outcomes.py)."""

import collections
import json
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
P = {n: json.load(open(os.path.join(HERE, f"{n}.json"))) for n in ("pass1", "pass2", "pass3")}


def short(f):
    return f.split("tests/fixtures/recipes/corpus/")[1]


def summary(r):
    if r["rc"] == 0:
        first = (r["stdout"].splitlines() or [""])[0]
        m = re.search(r": (\d+ mapped.*)$", first)
        return ("ok, wrote -o file; " if r["wrote"] else "ok, no -o file; ") + (m.group(1) if m else first)
    line = (r["stderr"].splitlines() or ["(no stderr)"])[0]
    if len(line) > 230:
        line = line[:230] + " …"
    return line.replace("|", "\\|")


def esc(s):
    return s.replace("|", "\\|")


def counts(rows):
    c = collections.Counter("exit 0" if r["rc"] == 0 else "exit 2" if r["rc"] == 2 else "other" for r in rows)
    return ", ".join(f"{k}: {c.get(k, 0)}" for k in ("exit 0", "exit 2", "other"))


L = []
L.append("# Recipe corpus: what `jaxpar port` does with each file (2026-12-04)\n")
L.append("Command run for every file (pass 1), from `/work/wt-corpus`:\n")
L.append(
    "```\ncd /work/wt-corpus && PYTHONPATH=/work/wt-corpus timeout 60 python3 -m jaxpar port <kind> <file> -o /tmp/corpus_out/<format>__<name>.py\n```\n"
)
L.append(
    "`jaxpar port` takes the recipe kind as a required positional argument, so `<kind>` was added to the requested command: "
    "`megatron` for Megatron-LM scripts and for the Megatron-DeepSpeed / BLOOM `.sh`/`.slurm` launch scripts, "
    "`deepspeed` for every `.json`, `torchtitan` for `.toml`, `fsdp` for accelerate/trl `.yaml`.\n"
)
L.append(
    "Pass 2 reran each pass-1 failure whose error asked for an input, adding only what the message asked for: "
    "`--world-size 8` (an arbitrary 8-GPU choice, not taken from the recipe), `--var NAME=/placeholder/name` for the unresolved path variables named, "
    'and `--allow-unresolved` where the message named `"auto"` values. (The selection was by matching the message text; the three `deepspeed/autotuning_*` files also got `--world-size 8` because their message\'s usage example mentions `world_size`.) Pass 3 reran four pass-2 failures whose message asked for a different world size '
    "(128 for the two scripts with TP*PP=128; 1 where the batch sizes imply DP=1). Extra arguments per file: `extra_args_pass2.json`, `extra_args_pass3.json`; "
    "full commands, exit codes, stderr and stdout: `pass1.json`, `pass2.json`, `pass3.json`. Reproduce with `run_outcomes.py` (then `make_outcomes_md.py`).\n"
)
L.append("No judgement of correctness is made here beyond what the importer printed. No jaxpar code was changed.\n")
L.append("## Counts\n")
L.append(f"- pass 1 (plain command, {len(P['pass1'])} files): {counts(P['pass1'])}")
L.append(f"- pass 2 ({len(P['pass2'])} reruns): {counts(P['pass2'])}")
L.append(f"- pass 3 ({len(P['pass3'])} reruns): {counts(P['pass3'])}")
best = {r["file"]: r for n in ("pass1", "pass2", "pass3") for r in P[n]}
L.append(f"- last attempt per file ({len(best)} files): {counts(best.values())}\n")
L.append("## Pass 1: plain command\n")
L.append("| file | exit | outcome (exit 0: report counts from stdout; otherwise first stderr line) |\n|---|---|---|")
for r in P["pass1"]:
    L.append(f"| `{short(r['file'])}` | {r['rc']} | {summary(r)} |")
for n, title in (
    ("pass2", "Pass 2: reruns with the inputs the pass-1 error asked for"),
    ("pass3", "Pass 3: reruns of four pass-2 failures with another world size"),
):
    L.append(f"\n## {title}\n")
    L.append("| file | extra arguments | exit | outcome |\n|---|---|---|---|")
    for r in P[n]:
        cmd = r["cmd"].split()
        i = cmd.index(r["file"]) + 1
        j = cmd.index("-o")
        L.append(f"| `{short(r['file'])}` | `{esc(' '.join(cmd[i:j]))}` | {r['rc']} | {summary(r)} |")
L.append("\n## First 3 lines of stderr, non-zero exits\n")
for n in ("pass1", "pass2", "pass3"):
    for r in P[n]:
        if r["rc"] != 0:
            L.append(
                f"- {n} `{short(r['file'])}` (exit {r['rc']}):\n\n  ```\n"
                + "\n".join("  " + s for s in r["stderr3"])
                + "\n  ```"
            )
L.append("\nAll exit-0 runs printed nothing on stderr.\n")
L.append("## Facts about the files behind some errors (grep of the fixture, no judgement)\n")
L.append(
    "- `--num-layers is missing`: the flag appears literally as `--num-layers <int>` in `megatron/2024_pretrain_gpt_distributed_with_mp.sh` (line 32), "
    "`megatron/2024_pretrain_bert_distributed_with_mp.sh` (28), `megatron/2024_pretrain_t5_distributed_with_mp.sh` (27); as `--num-layers $NUM_LAYERS` / `${NUM_LAYERS}` in "
    "`megatron/llama3_8b_h100_fp8.sh`, `megatron/llama3_8b_fsdp_h100_fp8.sh`, `megatron/gptoss_train.sh`; `megatron/t5_220m.sh` has `--encoder-num-layers`/`--decoder-num-layers` instead; "
    "`megatron/mamba_train.sh` has no `num-layers` text; the Megatron-DeepSpeed `rebase_gpt_1.3B.sh`, `seq_parallel_gpt_1.3B_32k.sh`, `bert_with_pile_pretrain.sh` set a shell variable `num_layers=` and pass it via an options string."
)
L.append(
    "- `no pretrain_*.py command found`: `megatron/detoxify_finetune_gpt_1.3b.sh` runs `finetune_gpt.py` via `python -m torch.distributed.run`; `megatron/pretrain_mistral_clip.sh` runs `examples/multimodal/train.py`; "
    '`megatron/2024_pretrain_gpt3_175B.sh` and `megatron_deepspeed/moe_gpt_125M_MoE64.sh` build the command in a `run_cmd="... pretrain_gpt.py ..."` string; the BLOOM `.slurm` scripts launch `pretrain_gpt.py` inside a `CMD=` string run by `srun`.'
)
L.append("- `torchtitan/llama4_17bx16e.toml` (pass 2): the error reports `model.num_heads=4`.\n")
open(os.path.join(HERE, "outcomes.md"), "w").write("\n".join(L) + "\n")
