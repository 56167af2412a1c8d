"""Bad input: one line naming the field and the fix, exit code 2, no traceback."""

import jax
import pytest

from jaxpar.cli import main
from jaxpar.config import ConfigError, load_config
from jaxpar.layout import ParallelLayout
from tests.helpers import TINY


def _run(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--config.mesh.data=2"], "mesh: data*tensor*pipeline*context*expert = 2*2*1*1*1 = 4 but 8 devices"),
        (["--config.mesh.tensor=8", "--config.mesh.data=1"], "model.num_heads=4 is not divisible by mesh.tensor=8"),
        (["--config.model.num_kv_heads=3"], "model.num_heads=4 is not a multiple of model.num_kv_heads=3"),
        (["--config.train.global_batch=6"], "train.global_batch=6 is not divisible by train.microbatches*mesh.data"),
        (
            ["--config.model.num_layers=1", "--config.mesh.pipeline=2", "--config.mesh.data=2"],
            "model.num_layers=1 is not divisible by mesh.pipeline",
        ),
        (["--config.mesh.datta=2"], "unknown config key 'mesh.datta'; did you mean 'mesh.data'?"),
        (["--config.train.steps=-5"], "train.steps=-5: must be >= 0"),
        (["--config.train.steps=ten"], "--config.train.steps: 'ten' is not a valid int"),
        (["--config.model.remat=some"], "model.remat='some'"),
        (
            [
                "--config.mesh.data=1",
                "--config.mesh.context=4",
                "--config.train.seq_len=60",
                "--config.model.attention=blockwise",
            ],
            "train.seq_len=60 is not divisible by 2*mesh.context=8",
        ),
        (
            ["--config.mesh.data=2", "--config.mesh.context=2", "--config.model.attention=dot_product"],
            "model.attention=dot_product with mesh.context=2",
        ),
        (
            [
                "--config.mesh.data=1",
                "--config.mesh.context=2",
                "--config.mesh.pipeline=2",
                "--config.model.attention=blockwise",
            ],
            "parallel.context_exchange=ring with mesh.pipeline=2",
        ),
        (["--config.parallel.context_exchange=ulysses"], "parallel.context_exchange='ulysses'"),
        (["--config.model.attention=flash"], "model.attention='flash'"),
    ],
)
def test_bad_config_is_one_line_exit_2(capsys, argv, needle):
    # JAX already runs the session's 8 devices (as after any earlier test in this process), so the
    # mesh check speaks, not the check of XLA_FLAGS that precedes JAX's start
    jax.devices()
    code, err = _run(capsys, "train", "--config", TINY, *argv)
    assert code == 2
    assert needle in err
    assert "\n" not in err and "Traceback" not in err


def test_missing_config_file(capsys):
    code, err = _run(capsys, "train", "--config", "configs/nope.py")
    assert code == 2 and err == "error: --config: file 'configs/nope.py' not found; pass a path such as configs/tiny.py"


def test_unknown_cli_flag(capsys):
    code, err = _run(capsys, "train", "--steps", "3")
    assert code == 2 and "unrecognized arguments: --steps 3" in err and "\n" not in err


def test_batch_arithmetic():
    cfg = load_config(TINY, ["--config.train.global_batch=32", "--config.train.microbatches=2"])
    d = ParallelLayout.from_config(cfg)
    assert (d.devices, d.microbatch_size, d.microbatch_sequences) == (8, 4, 16)
    assert d.tokens_per_step == 32 * 256
    assert d.microbatch_size * cfg.train.microbatches * cfg.mesh.data == cfg.train.global_batch == d.global_batch


def test_real_shapes_load_and_count():
    from jaxpar.models.inventory import count_params

    counts = {}
    for name in ("llama2_7b", "llama2_13b", "llama2_70b", "llama3_8b", "mixtral_8x7b", "qwen3_30b_a3b"):
        counts[name] = count_params(load_config(str(TINY).replace("tiny", name)).model)
    # Published parameter counts (Touvron et al. 2023; Meta LLaMA-3 model card; Mixtral 8x7B's 46.7B,
    # Jiang et al. 2024; Qwen3-30B-A3B's 30.5B, Qwen Team 2025: as the HF checkpoints' tensors sum).
    assert counts == {
        "llama2_7b": 6_738_415_616,
        "llama2_13b": 13_015_864_320,
        "llama2_70b": 68_976_648_192,
        "llama3_8b": 8_030_261_248,
        "mixtral_8x7b": 46_702_792_704,
        "qwen3_30b_a3b": 30_532_122_624,
    }


def test_overrides_are_typed():
    cfg = load_config(TINY, ["--config.parallel.sequence_parallel=true", "--config.optim.lr=1e-3"])
    assert cfg.parallel.sequence_parallel is True and cfg.optim.lr == 1e-3
    with pytest.raises(ConfigError, match="parallel.sequence_parallel"):
        load_config(TINY, ["--config.parallel.sequence_parallel=maybe"])
