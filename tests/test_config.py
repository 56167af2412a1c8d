"""Bad input: one line naming the field and the fix, exit code 2, no traceback."""

import dataclasses

import jax
import pytest

from jaxpar.cli import main
from jaxpar.config import MOVED_KEYS, ConfigDict, ConfigError, default_config, load_config, merge_into_defaults
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
        (["--config.train.global_batch=6"], "train.global_batch=6 is not divisible by parallel.microbatches*mesh.data"),
        (
            ["--config.model.num_layers=1", "--config.mesh.pipeline=2", "--config.mesh.data=2"],
            "model.num_layers=1 is not divisible by mesh.pipeline",
        ),
        (["--config.mesh.datta=2"], "unknown config key 'mesh.datta'; did you mean 'mesh.data'?"),
        (["--config.train.steps=-5"], "train.steps=-5: must be >= 0"),
        (["--config.train.steps=ten"], "--config.train.steps: 'ten' is not a valid int"),
        (["--config.parallel.recompute=some"], "parallel.recompute='some'"),
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
    cfg = load_config(TINY, ["--config.train.global_batch=32", "--config.parallel.microbatches=2"])
    d = ParallelLayout.from_config(cfg)
    assert (d.devices, d.microbatch_size, d.microbatch_sequences) == (8, 4, 16)
    assert d.tokens_per_step == 32 * 256
    assert d.microbatch_size * cfg.parallel.microbatches * cfg.mesh.data == cfg.train.global_batch == d.global_batch


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


# a value each moved key takes, by its new key
MOVED_VALUES = {
    "parallel.recompute": "full",
    "parallel.microbatches": 2,
    "parallel.pipeline_schedule": "gpipe",
    "parallel.virtual_stages": 2,
    "parallel.layers_per_stage": "1,3",
    "parallel.first_stage_layers": 1,
    "parallel.last_stage_layers": 3,
}


def test_the_moved_keys_are_the_layouts_fields():
    """Every moved key's new home is a schema field named as the layout names it (stage counts aside:
    the layout holds their resolved ``stage_layers``)."""
    schema, fields = default_config(), {f.name for f in dataclasses.fields(ParallelLayout)}
    assert set(MOVED_VALUES) == set(MOVED_KEYS.values())
    for new in MOVED_KEYS.values():
        section, field = new.split(".")
        assert section == "parallel" and field in schema.parallel
        assert field in fields or field.endswith(("layers_per_stage", "stage_layers")), field
    assert "pipeline" not in schema and "remat" not in schema.model and "microbatches" not in schema.train


def test_a_layout_read_back_from_older_json_keeps_its_schedule():
    """Rows written before the field was named ``pipeline_schedule`` (memory-grid .jsonl) read as it."""
    lay = ParallelLayout(pipeline=2, microbatches=4, pipeline_schedule="gpipe")
    old = {("schedule" if k == "pipeline_schedule" else k): v for k, v in lay.to_dict().items()}
    assert ParallelLayout.from_dict(old) == lay == ParallelLayout.from_dict(lay.to_dict())


def test_an_old_key_override_is_the_documented_line(capsys):
    code, err = _run(capsys, "train", "--config", TINY, "--config.model.remat=full")  # rename_keys: keep
    assert code == 2
    want = "error: model.remat moved to parallel.recompute: use --config.parallel.recompute=full"  # rename_keys: keep
    assert err == want


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_an_old_key_override_names_the_new_key(capsys, old):
    new = MOVED_KEYS[old]
    value = MOVED_VALUES[new]
    code, err = _run(capsys, "train", "--config", TINY, f"--config.{old}={value}")
    assert code == 2 and err == f"error: {old} moved to {new}: use --config.{new}={value}"


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_an_old_key_in_a_config_file_names_the_new_key(old):
    """What a config file's ``get_config`` returns is merged by :func:`merge_into_defaults` (in the
    child that runs the file): ``c.<old> = value`` there, ``c.pipeline`` made anew where needed."""
    new, (section, field) = MOVED_KEYS[old], old.split(".")
    value = MOVED_VALUES[new]
    c = default_config()
    if section not in c:
        c[section] = ConfigDict()
    c[section][field] = value
    with pytest.raises(ConfigError) as e:
        merge_into_defaults(c, source="my_config.py")
    assert str(e.value) == f"my_config.py: {old} moved to {new}: set c.{new} = {value!r} (or --config.{new}={value})"


def test_an_old_key_in_a_config_file_is_one_line_exit_2(capsys, tmp_path):
    path = tmp_path / "old.py"
    path.write_text(
        "from jaxpar.config import default_config\n\n\ndef get_config():\n"
        "    c = default_config()\n    c.model.remat = 'selective'\n    return c\n"  # rename_keys: keep
    )
    code, err = _run(capsys, "train", "--config", str(path))
    assert code == 2
    assert (
        err
        == (
            f"error: {path}: model.remat moved to parallel.recompute: set c.parallel.recompute = 'selective' "  # rename_keys: keep
            "(or --config.parallel.recompute=selective)"
        )
    )


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_an_old_key_given_to_port_names_the_new_key(capsys, old):
    new = MOVED_KEYS[old]
    value = MOVED_VALUES[new]
    recipe = "tests/fixtures/recipes/deepspeed/smoke_bf16_zero0.json"
    code, err = _run(capsys, "port", "deepspeed", recipe, "--world-size", "8", "--set", f"{old}={value}")
    assert code == 2 and err == f"error: port: --set {old}: {old} moved to {new}: use --set {new}={value}"
    code, err = _run(capsys, "port", "deepspeed", recipe, "--world-size", "8", f"--config.{old}={value}")
    assert code == 2 and err.endswith(f"port does not take --config overrides; use --set {new}=VALUE")


def test_the_pipeline_section_is_gone():
    c = default_config()
    c.pipeline = ConfigDict()  # an empty section flattens to no key: refused all the same
    with pytest.raises(ConfigError, match=r"^cfg.py: the pipeline section is gone \(its fields moved to parallel\)"):
        merge_into_defaults(c, source="cfg.py")
    with pytest.raises(
        ConfigError, match=r"^--config.pipeline.stages: the pipeline section is gone .*parallel.virtual_stages"
    ):
        load_config(TINY, ["--config.pipeline.stages=2"])


def test_overrides_are_typed():
    cfg = load_config(TINY, ["--config.parallel.sequence_parallel=true", "--config.optim.lr=1e-3"])
    assert cfg.parallel.sequence_parallel is True and cfg.optim.lr == 1e-3
    with pytest.raises(ConfigError, match="parallel.sequence_parallel"):
        load_config(TINY, ["--config.parallel.sequence_parallel=maybe"])
