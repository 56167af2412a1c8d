"""The write guard (jaxpar.write_guard, jaxpar.workdir): every ``-o`` and workdir pointed at a tree of a
user's files is refused in one line (exit 2) and every byte of the tree survives; jaxpar replaces only
what it wrote, through a temporary sibling and a rename."""

from __future__ import annotations

import errno
import json
import os
import pathlib

import pytest

from jaxpar import write_guard
from jaxpar.errors import ConfigError
from tests.fuzzkit import cli_refused, run_cli
from tests.helpers import ROOT, TINY

RECIPE = ROOT / "tests" / "fixtures" / "recipes" / "deepspeed" / "megatron_ds_bf16_zero1.json"
PORT = ["port", "deepspeed", "--world-size", "8", "--approximate"]  # a DeepSpeed JSON has no model
FAST = ["--config.train.steps=1", "--config.train.eval_batches=0", "--config.train.eval_every=0"]


def user_tree(root: pathlib.Path) -> pathlib.Path:
    """A folder of a user's files, with the names jaxpar writes among them (report.md, config.json, ...)."""
    root.mkdir(parents=True, exist_ok=True)
    files = {
        "report.md": b"# my notes\n",
        "config.json": b'{"architectures": ["LlamaForCausalLM"]}\n',
        "model.safetensors": bytes(range(256)) * 4,
        "results.json": b"[1, 2]\n",
        "notes.txt": b"keep me\n",
        "sub/data.bin": b"\x00\x01\x02",
        "ds.json": RECIPE.read_bytes(),
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def snapshot(root: pathlib.Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes): what must survive."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _exported(tmp_path: pathlib.Path) -> pathlib.Path:
    """A folder that looks like an earlier ``jaxpar export`` (its marker, an HF config.json)."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    write_guard.mark(hf, write_guard.EXPORT, ["config.json"])
    return hf


# (argv with @TREE = the user's tree, @TMP = the test's folder; words the one line must hold)
REFUSED = [
    (
        "sweep -o a user's folder",
        ["sweep", "--devices", "2", "--steps", "2", "--warmup", "0", "-o", "@TREE"],
        ["sweep -o @TREE", "holds files jaxpar did not write (cfg.py, config.json, ds.json, ...)"],
    ),
    (
        "sweep -o its own --config",
        ["sweep", "--config", "@TREE/cfg.py", "--devices", "2", "-o", "@TREE"],
        ["contains the input --config"],
    ),
    (
        "export -o a user's folder",
        ["export", "-o", "@TREE", "--overwrite", "--config.train.workdir=@TMP/none"],
        ["export -o @TREE", "holds files jaxpar did not write"],
    ),
    (
        "export -o the run's workdir",
        ["export", "-o", "@TREE", "--overwrite", "--config.train.workdir=@TREE"],
        ["is the run's workdir train.workdir='@TREE'"],
    ),
    (
        "export -o a folder holding the workdir",
        ["export", "-o", "@TMP", "--overwrite", "--config.train.workdir=@TREE"],
        ["contains the run's workdir"],
    ),
    (
        "export -o without --overwrite",
        ["export", "-o", "@TREE", "--config.train.workdir=@TMP/none"],
        ["exists; pass --overwrite"],
    ),
    (
        "port -o the input recipe",
        [*PORT, "@TREE/ds.json", "-o", "@TREE/ds.json", "--overwrite"],
        ["port -o @TREE/ds.json: is the input the recipe"],
    ),
    (
        "port -o a user's file",
        [*PORT, "@TREE/ds.json", "-o", "@TREE/notes.txt", "--overwrite"],
        ["jaxpar did not write this file"],
    ),
    ("port -o without --overwrite", [*PORT, "@TREE/ds.json", "-o", "@TREE/report.md"], ["the file exists"]),
    (
        "train in a user's folder",
        ["train", "--no-progress", "--config.train.workdir=@TREE", *FAST],
        ["train.workdir='@TREE' holds files no run wrote"],
    ),
    (
        "train in a jaxpar export it reads",
        ["train", "--no-progress", "--config.train.workdir=@TMP/hf", "--config.train.init_from=@TMP/hf", *FAST],
        ["is or contains train.init_from"],
    ),
    (
        "train in an export folder",
        ["train", "--no-progress", "--config.train.workdir=@TMP/hf", *FAST],
        ["is a jaxpar export folder"],
    ),
]
if os.environ.get("JAXPAR_SLOW") != "1":  # the default suite: one case per subcommand and kind
    REFUSED = [
        c
        for c in REFUSED
        if c[0]
        in (
            "sweep -o a user's folder",
            "export -o the run's workdir",
            "port -o the input recipe",
            "port -o a user's file",
            "train in a user's folder",
            "train in a jaxpar export it reads",
        )
    ]


@pytest.mark.parametrize("argv, words", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_outputs_pointed_at_a_users_tree_are_refused_and_every_byte_survives(tmp_path, argv, words):
    tree = user_tree(tmp_path / "tree")
    (tree / "cfg.py").write_text(pathlib.Path(TINY).read_text())
    hf = _exported(tmp_path)
    before, before_hf = snapshot(tree), snapshot(hf)

    def fill(text: str) -> str:
        return text.replace("@TREE", str(tree)).replace("@TMP", str(tmp_path))

    line = cli_refused("write guard", [fill(a) for a in argv])
    assert all(fill(w) in line for w in words), line
    assert snapshot(tree) == before and snapshot(hf) == before_hf
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "tree"]  # no temporary sibling left


def test_port_overwrite_replaces_its_own_output_only(tmp_path):
    out = tmp_path / "out.py"
    code, _, err = run_cli([*PORT, str(RECIPE), "-o", str(out)])
    assert code == 0, err
    first = out.read_bytes()
    assert first.startswith(b'"""Ported from the deepspeed recipe')
    out.write_bytes(first.replace(b"    return c\n", b"    return c  # edited\n"))
    code, _, err = run_cli([*PORT, str(RECIPE), "-o", str(out), "--overwrite"])
    assert code == 0, err
    assert out.read_bytes() == first.replace(f"-o {out}".encode(), f"-o {out} --overwrite".encode())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.py"]


def _fill(names: dict[str, bytes]):
    def fill(tmp: pathlib.Path) -> None:
        for name, data in names.items():
            (tmp / name).write_bytes(data)

    return fill


def test_replace_folder_replaces_an_earlier_output_of_its_kind(tmp_path):
    out = tmp_path / "sweep"
    write_guard.replace_folder(out, write_guard.SWEEP, _fill({"report.md": b"one"}), flag="sweep -o")
    write_guard.replace_folder(
        out, write_guard.SWEEP, _fill({"report.md": b"two", "a.png": b"p"}), flag="sweep -o", overwrite=True
    )
    assert (out / "report.md").read_bytes() == b"two"
    assert json.loads((out / write_guard.MARKER).read_text())["entries"] == ["a.png", "report.md"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]


@pytest.mark.parametrize(
    "case, prepare, words",
    [
        (
            "a user's note dropped into it",
            lambda out: (out / "mine.txt").write_bytes(b"mine"),
            "holds files jaxpar did not write there (mine.txt)",
        ),
        (
            "a folder of another kind",
            lambda out: write_guard.mark(out, write_guard.EXPORT),
            "is a jaxpar export folder, not a sweep folder",
        ),
        ("no marker", lambda out: (out / write_guard.MARKER).unlink(), "holds files jaxpar did not write"),
    ],
)
def test_replace_folder_refuses_what_jaxpar_did_not_write(tmp_path, case, prepare, words):  # noqa: ARG001
    out = tmp_path / "sweep"
    write_guard.replace_folder(out, write_guard.SWEEP, _fill({"report.md": b"one"}), flag="sweep -o")
    prepare(out)
    before = snapshot(out)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        write_guard.replace_folder(
            out, write_guard.SWEEP, _fill({"report.md": b"two"}), flag="sweep -o", overwrite=True
        )
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]


def test_a_failed_replacement_leaves_the_earlier_output(tmp_path):
    out = tmp_path / "export"
    write_guard.replace_folder(out, write_guard.EXPORT, _fill({"model.safetensors": b"old"}), flag="export -o")
    before = snapshot(out)

    def full(tmp: pathlib.Path) -> None:
        (tmp / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as raised:
        write_guard.replace_folder(out, write_guard.EXPORT, full, flag="export -o", overwrite=True)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename is not None
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_remove_owned_deletes_only_jaxpars_folders(tmp_path):
    tree = user_tree(tmp_path / "tree")
    before = snapshot(tree)
    with pytest.raises(ConfigError, match="jaxpar deletes only folders it made"):
        write_guard.remove_owned(tree, write_guard.SWEEP)
    assert snapshot(tree) == before
    mine = tmp_path / "mine"
    write_guard.replace_folder(mine, write_guard.SWEEP, _fill({"a": b"1"}), flag="sweep -o")
    write_guard.remove_owned(mine, write_guard.SWEEP)
    assert not mine.exists()


def test_save_hf_overwrite_replaces_an_export_not_a_users_folder(tmp_path):
    from jaxpar.port import weights
    from tests.test_fuzz_files import _small
    from tests.test_weights import random_params

    model = _small().model
    params = random_params(model)
    tree = user_tree(tmp_path / "tree")
    before = snapshot(tree)
    with pytest.raises(ConfigError, match="holds files jaxpar did not write"):
        weights.save_hf(params, model, tree, overwrite=True)
    assert snapshot(tree) == before
    out = weights.save_hf(params, model, tmp_path / "hf")
    first = snapshot(out)
    assert sorted(first) == [".jaxpar", "config.json", "model.safetensors"]
    weights.save_hf(params, model, out, overwrite=True)  # an earlier export: replaced, to the same bytes
    assert snapshot(out) == first
    (out / "mine.txt").write_bytes(b"mine")
    with pytest.raises(ConfigError, match=r"holds files jaxpar did not write there \(mine.txt\)"):
        weights.save_hf(params, model, out, overwrite=True)
    assert (out / "mine.txt").read_bytes() == b"mine"


@pytest.mark.parametrize(
    "files, refused",
    [
        ({"results.json": b'{"meta": {}, "layouts": []}', "report.md": b"# sweep"}, False),  # a sweep's, before markers
        ({"results.json": b"[1, 2]", "report.md": b"# mine"}, True),  # not a sweep's results
        ({"results.json": b'{"meta": {}, "layouts": []}', "notes.txt": b"mine"}, True),  # a file no sweep writes
        ({"report.md": b"# mine"}, True),
    ],
)
def test_sweep_o_recognises_a_sweep_folder_from_before_markers(tmp_path, files, refused):
    from jaxpar.cli.sweep import older_sweep

    out = tmp_path / "sweep"
    out.mkdir()
    for name, data in files.items():
        (out / name).write_bytes(data)
    before = snapshot(out)
    if refused:
        with pytest.raises(ConfigError, match="holds files jaxpar did not write"):
            write_guard.replace_folder(
                out, write_guard.SWEEP, _fill({"report.md": b"new"}), flag="sweep -o", overwrite=True, older=older_sweep
            )
        assert snapshot(out) == before
    else:
        write_guard.replace_folder(
            out, write_guard.SWEEP, _fill({"report.md": b"new"}), flag="sweep -o", overwrite=True, older=older_sweep
        )
        assert sorted(snapshot(out)) == [write_guard.MARKER, "report.md"]
