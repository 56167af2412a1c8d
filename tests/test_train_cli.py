"""`jaxpar train` end to end on the default config (shortened): it learns and logs every step, and builds its
ParallelLayout once."""

import json
import subprocess
import sys

from tests.helpers import ROOT, TINY, child_env


def test_default_config_learns_and_logs(tmp_path):
    workdir = tmp_path / "run"
    # a process of its own, as the README runs it, with LLVM's default optimisation (child_env)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxpar",
            "train",
            "--config",
            TINY,
            "--no-progress",
            "--config.train.steps=30",
            f"--config.train.workdir={workdir}",
        ],
        env=child_env(fast_code=True, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run.stdout
    assert run.returncode == 0, out + run.stderr[-2000:]
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "val_bits" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    for key in ("loss", "tokens_per_s", "mfu", "step_time_s", "tflops_per_device", "grad_norm", "lr"):
        assert all(key in r for r in steps), key
    start, end = evals[0]["val_bits"], evals[-1]["val_bits"]
    print(f"validation bits/byte: start {start:.3f} end {end:.3f} ({1 - end / start:.1%} lower)")
    assert 7.5 < start < 8.5  # a random byte model: ~log2(256) = 8 bits
    assert end <= 0.6 * start  # the README's claim: at least 40% lower
    assert "validation at step 30" in out and "MFU" in out


def test_train_builds_the_layout_once(tmp_path, monkeypatch, capsys):
    """`jaxpar train` builds one ParallelLayout per run: config.validate (through
    load_config_and_layout) makes it from the config, and the simulated-device count, the trainer,
    the mesh, Setup, the rules, the batch feed and the step builder are all handed that one. Every
    construction is counted (``__init__``: direct calls, ``from_config`` and ``dataclasses.replace``
    alike), in process, over 2 short steps."""
    from jaxpar.cli import main
    from jaxpar.layout import ParallelLayout

    built: list[str] = []
    init, from_config = ParallelLayout.__init__, ParallelLayout.from_config.__func__

    def counted_init(self, *args, **kwargs):
        built.append("__init__")
        init(self, *args, **kwargs)

    def counted_from_config(cls, cfg):
        built.append("from_config")
        return from_config(cls, cfg)

    monkeypatch.setattr(ParallelLayout, "__init__", counted_init)
    monkeypatch.setattr(ParallelLayout, "from_config", classmethod(counted_from_config))
    code = main(
        [
            "train",
            "--config",
            TINY,
            "--no-progress",
            "--config.train.steps=2",
            "--config.train.seq_len=64",
            "--config.data.source=synthetic",
            f"--config.train.workdir={tmp_path / 'run'}",
        ]
    )
    assert code == 0, capsys.readouterr().err
    assert built == ["from_config", "__init__"]  # one layout: from_config's one construction
