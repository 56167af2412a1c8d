"""A flag and a ``--config`` override of the same field are refused, naming both; an override of a field
the command does not read (plan's and compare's mesh, the sweep's mesh and steps) is refused; a
user's config file whose values a flag or the layout search replaces gets one ``note:`` line each."""

from __future__ import annotations

import pytest

from tests.fuzzkit import cli_refused, run_cli
from tests.helpers import ROOT

LLAMA = str(ROOT / "configs" / "llama2_7b.py")

REFUSED = [
    (
        ["plan", "--global-batch", "64", "--config.train.global_batch=32"],
        "plan: --global-batch and --config.train.global_batch=32 both set train.global_batch; give one of them",
    ),
    (["plan", "--seq", "64", "--config.train.seq_len=32"], "plan: --seq and --config.train.seq_len=32 both set"),
    (["plan", "--zero", "1", "--config.parallel.zero_stage=2"], "plan: --zero and --config.parallel.zero_stage=2"),
    (
        ["plan", "--recompute", "full", "--config.parallel.recompute=none"],
        "plan: --recompute and --config.parallel.recompute=none",
    ),
    (
        ["plan", "--no-sequence-parallel", "--config.parallel.sequence_parallel=true"],
        "plan: --sequence-parallel and --config.parallel.sequence_parallel=true both set",
    ),
    (
        ["plan", "--grad-reduce-dtype", "bfloat16", "--config.parallel.grad_reduce_dtype=float32"],
        "plan: --grad-reduce-dtype and --config.parallel.grad_reduce_dtype=float32 both set",
    ),
    (
        ["plan", "--config.mesh.tensor=2"],
        "plan: --config.mesh.tensor=2: plan does not read mesh.tensor; plan searches the mesh; pin sizes with "
        "--layout, e.g. --layout data=2,tensor=4",
    ),
    (
        ["plan", "--config.parallel.zero_stage=3"],
        "plan: --config.parallel.zero_stage=3: plan does not read parallel.zero_stage; plan searches the ZeRO stage",
    ),
    (
        ["plan", "--config.parallel.microbatches=4"],
        "plan: --config.parallel.microbatches=4: plan does not read parallel.microbatches;",
    ),
    (
        ["plan", "--config.parallel.pipeline_schedule=gpipe"],
        "plan: --config.parallel.pipeline_schedule=gpipe: plan does not read parallel.pipeline_schedule;",
    ),
    (
        ["compare", "--layout", "data=8", "--global-batch", "64", "--config.train.global_batch=32"],
        "compare: --global-batch and --config.train.global_batch=32 both set train.global_batch",
    ),
    (
        ["compare", "--layout", "data=8", "--config.mesh.data=8"],
        "compare: --config.mesh.data=8: compare does not read mesh.data; each --layout gives the mesh sizes",
    ),
    (
        ["sweep", "--list", "--config.mesh.data=2"],
        "sweep: --config.mesh.data=2: sweep does not read mesh.data; the sweep lays out --devices devices",
    ),
    (
        ["sweep", "--list", "--config.train.steps=5"],
        "sweep: --config.train.steps=5: sweep does not read train.steps; give --steps",
    ),
]


@pytest.mark.parametrize("argv, words", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_a_flag_and_an_override_of_one_field_or_an_unread_override_are_refused(argv, words):
    line = cli_refused("hostile: flags and overrides", argv)
    assert line.startswith(f"error: {words}"), line


def test_a_config_file_value_a_flag_replaces_is_noted():
    code, out, err = run_cli(
        ["plan", "--config", LLAMA, "--global-batch", "64", "--seq", "4096", "--top", "1", "--json"]
    )
    assert code == 0 and out.lstrip().startswith("{")
    assert err.splitlines() == [
        "plan: note: not used from the config (plan chooses the layout; flags pin parts of it, see --help): "
        "mesh.data=8, parallel.microbatches=16, parallel.recompute=full, parallel.zero_stage=3",
        "plan: note: --global-batch 64 replaces the config's train.global_batch=1024",
    ]  # --seq 4096 is the config's own value: nothing replaced


def test_the_built_in_config_gets_no_note():
    code, _out, err = run_cli(["plan", "--global-batch", "64", "--top", "1", "--json"])
    assert code == 0 and err == ""


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--config", LLAMA, "--global-batch", "64", "--devices", "7"],
        ["compare", "--config", LLAMA, "--seq", "64", "--layout", "data=3"],
    ],
)
def test_a_refusal_after_the_notes_stays_one_line(argv):
    """The notes wait until the command got past its checks: a refusal is still the only line."""
    line = cli_refused("hostile: flags and overrides", argv)
    assert "note:" not in line
