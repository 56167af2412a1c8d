"""Optimizers from the registry (jaxpar.optim): every layout computes the one-device step, the state is
laid out and priced as the formula says, a skipped step leaves it bitwise and costs at most one
parameter-sized temporary, checkpoints move it between pipeline forms; jaxpar's AdamW equals optax's."""

import dataclasses
import importlib
import os
import pathlib
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar.analysis.expected import estimated_memory
from jaxpar.checkpoint import Checkpointer
from jaxpar.config import ConfigError, load_config
from jaxpar.layout import ParallelLayout
from jaxpar.optim import registry
from jaxpar.optim.fields import optimizer_fields
from jaxpar.optim.optimizers import muon
from tests.helpers import ROOT, make_setup, max_rel_error, tiny_config

SLOW = os.environ.get("JAXPAR_SLOW") == "1"
STEPS = 3
SMALL = ["--config.model.num_layers=2"]  # fast compiles; adafactor still factors (dims 128, 256, 384)
OPTIMIZERS = [n for n in ("lion", "sgd", "adafactor", "muon") if n in registry.optimizers()]
LAYOUTS = {
    "zero1_d8": ["--config.mesh.data=8", "--config.parallel.zero_stage=1"],
    "zero2_d8": ["--config.mesh.data=8", "--config.parallel.zero_stage=2"],
    "zero3_d8": ["--config.mesh.data=8", "--config.parallel.zero_stage=3"],
    "zero3_d4_t2": ["--config.mesh.data=4", "--config.mesh.tensor=2", "--config.parallel.zero_stage=3"],
    "d2_t2_p2": [
        "--config.mesh.data=2",
        "--config.mesh.tensor=2",
        "--config.mesh.pipeline=2",
        "--config.parallel.zero_stage=1",
        "--config.parallel.microbatches=2",
    ],
}
# The fast grid: the factored optimizer on a layout that splits its non-elementwise statistics; the full
# optimizer x layout grid under JAXPAR_SLOW=1.
# (adafactor on d2_t2_p2 is in the slow grid: the pipeline form's adafactor state is checked bitwise by
# the checkpoint round trip below.)
# (lion and sgd, elementwise and on adafactor's optax path, are in the slow grid, sgd since session 29: ~15-20 s
# each of the default suite; ZeRO-2 over data=8 trains by default with AdamW in tests/test_equivalence.py)
FAST = [("adafactor", "zero3_d4_t2")]
GRID = [(o, lay) for o in OPTIMIZERS for lay in LAYOUTS] if SLOW else [c for c in FAST if c[0] in OPTIMIZERS]


def _cfg(name, *overrides):
    mesh = [] if any("mesh.data" in o for o in overrides) else ["--config.mesh.data=1"]
    return tiny_config("--config.mesh.tensor=1", *mesh, *SMALL, f"--config.optim.name={name}", *overrides)


def _run(cfg, steps=STEPS, seed=0):
    """``steps`` steps on fixed random batches; returns (losses, model-form params and state on host, setup)."""
    setup = make_setup(cfg)
    params, opt = setup.init(seed)
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        rows = rng.integers(0, cfg.model.vocab_size, size=(cfg.train.global_batch, cfg.train.seq_len + 1))
        params, opt, metrics = setup.train_step(params, opt, setup.feed.make_batch(rows))
        losses.append(float(metrics["loss"]))
    model_params, model_opt = setup.to_model_order(params, opt)
    return losses, jax.device_get(model_params), jax.device_get(model_opt), setup


_REFERENCES: dict = {}


def _reference(name):
    if name not in _REFERENCES:
        _REFERENCES[name] = _run(_cfg(name))
    return _REFERENCES[name]


@pytest.mark.parametrize("name, layout", GRID, ids=[f"{o}-{lay}" for o, lay in GRID])
def test_layout_matches_single_device(name, layout):
    ref_losses, ref_params, ref_opt, _ = _reference(name)
    losses, params, opt, setup = _run(_cfg(name, *LAYOUTS[layout]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    if name == "lion":  # sign(update): a coordinate within roundoff of 0 may flip (a 2*lr step apart)
        lr = setup.cfg.optim.lr
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
            off = np.abs(a - b) > 1e-5 * np.max(np.abs(b))
            assert off.mean() < 1e-4 and np.max(np.abs(a - b)) <= 2 * lr * STEPS
    else:
        assert max_rel_error(params, ref_params) < 1e-5
    # the state, in the model form (pipeline: converted from the stage form), matches too
    assert jax.tree.structure(opt) == jax.tree.structure(ref_opt)
    # (lion: the flipped coordinates above change the next gradients a little)
    tol = 1e-2 if name == "lion" else 1e-5
    assert max_rel_error(jax.tree.map(np.float64, opt), jax.tree.map(np.float64, ref_opt)) < tol
    assert setup.train_step._cache_size() == 1


def test_adafactor_state_is_factored_and_sharded():
    cfg = _cfg("adafactor", *LAYOUTS["zero3_d4_t2"])
    setup = make_setup(cfg)
    up = setup.train_form.opt_specs["tx"]["blocks"]["mlp"]["w_up"][
        0
    ]  # [L, embed, mlp]: embed over data, mlp over tensor
    shapes = jax.eval_shape(setup.init_opt_state, setup.train_form.abstract)["tx"]["blocks"]["mlp"]["w_up"][0]
    assert shapes.v_row.shape == (2, 128) and shapes.v_col.shape == (2, 384)  # per layer: mlp, embed averaged away
    assert (tuple(up.v_row), tuple(up.v_col), tuple(up.count)) == ((None, "data"), (None, "tensor"), (None,))


# the skip's cost per optimizer: jaxpar's AdamW (in the shard_map) by default; every optimizer under
# JAXPAR_SLOW=1 (the factored optax one since session 29, 15-24 s of the default suite: adafactor's state
# layout is checked by test_adafactor_state_is_factored_and_sharded, its sharded training and checkpoint
# round trip by the tests below)
SKIP_CHECKED = ["adamw", *OPTIMIZERS] if SLOW else ["adamw"]


@pytest.mark.parametrize("name", SKIP_CHECKED)
def test_state_memory_and_skipped_step(name):
    """Compiled argument bytes per device = the registry's state formula (within 1%); a skipped step
    leaves parameters and state bitwise; the skip adds at most one parameter-sized temporary (this
    device's parameter bytes) to the compiled step."""
    cfg = _cfg(name, "--config.mesh.data=4", "--config.mesh.tensor=2", "--config.parallel.zero_stage=1")
    setup = make_setup(cfg)
    compiled = setup.lower_train_step().compile()
    expected = estimated_memory(cfg, setup.layout, setup.train_form.placements)
    got = compiled.memory_analysis().argument_size_in_bytes
    assert got == pytest.approx(expected["argument_bytes"], rel=0.01), (got, expected)

    no_skip = setup._make_train_step(dataclasses.replace(setup.builder, skip_bad_steps=False))
    guard = jax.ShapeDtypeStruct((2,), np.float32, sharding=jax.sharding.NamedSharding(setup.mesh, P()))
    base = no_skip.lower(*setup.abstract_state(), guard).compile().memory_analysis().temp_size_in_bytes
    extra = compiled.memory_analysis().temp_size_in_bytes - base
    print(f"{name}: the skip costs {extra} temporary bytes; parameter bytes per device {expected['param_bytes']}")
    assert extra <= expected["param_bytes"]

    params, opt = setup.init(0)
    batch = setup.feed.make_batch(np.random.default_rng(0).integers(0, 256, size=(8, 65)))

    def step(params, opt, max_loss=np.inf, offset=0.0):
        values = np.array([max_loss, offset], np.float32)
        return compiled(params, opt, batch, jax.device_put(values, guard.sharding))

    for _ in range(2):  # non-zero state first (step 0's learning rate is 0 in warmup)
        params, opt, _ = step(params, opt)
    before = jax.device_get((params, opt))
    for kwargs in ({"max_loss": 0.0}, {"offset": np.nan}):
        params, opt, metrics = step(params, opt, **kwargs)
        assert int(metrics["skipped"]) == 1
        for a, b in zip(jax.tree.leaves(jax.device_get((params, opt))), jax.tree.leaves(before), strict=True):
            np.testing.assert_array_equal(a, b)
    assert int(opt["count"]) == 2


def test_checkpoint_round_trip_pipeline_adafactor(tmp_path):
    """Adafactor's state (factored moments of the stage form's ``ends`` included) saved in the model
    form from a pipeline layout restores bitwise onto it (the pipeline form's adafactor state against the
    one-device state: the JAXPAR_SLOW=1 grid's adafactor-d2_t2_p2)."""
    cfg = _cfg("adafactor", *LAYOUTS["d2_t2_p2"])
    setup = make_setup(cfg)
    params, opt = setup.init(0)
    rows = np.random.default_rng(1).integers(0, 256, size=(8, 65))
    for _ in range(2):
        params, opt, _ = setup.train_step(params, opt, setup.feed.make_batch(rows))
    before = jax.device_get((params, opt))
    ckpt = Checkpointer(str(tmp_path), 1, 2)
    ckpt.save(2, *setup.to_model_order(params, opt), {"step": 2}, cfg)
    ckpt.wait()
    p, o, _ = setup.abstract_state(model_form=True)
    _, state, _ = ckpt.restore({"params": p, "opt_state": o})
    back = setup.from_model_order(state["params"], state["opt_state"])
    for a, b in zip(jax.tree.leaves(jax.device_get(back)), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)


def test_jaxpar_adamw_equals_optax_adamw(tmp_path):
    """The default adamw (jaxpar's, in the shard_map) and optax.adamw through a config factory."""
    factory = pathlib.Path(tmp_path) / "factory.py"
    factory.write_text(
        "import optax\n"
        "def get_optimizer(o, learning_rate, weight_decay_mask):\n"
        "    return optax.adamw(learning_rate, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,\n"
        "                       mask=weight_decay_mask)\n"
    )
    _, ref_params, _, _ = _run(_cfg("adamw"))
    _, params, _, _ = _run(_cfg(f"{factory}:get_optimizer"))
    assert max_rel_error(params, ref_params) < 1e-6


def test_fields_act_or_are_refused():
    with pytest.raises(ConfigError, match="optim.name='rmsprop': use one of adafactor, adamw, lion, muon, sgd or"):
        _cfg("rmsprop")
    with pytest.raises(ConfigError, match="optim.b2=0.9 has no effect with optim.name='sgd'"):
        _cfg("sgd", "--config.optim.b2=0.9")
    with pytest.raises(ConfigError, match="optim.nesterov=True has no effect with optim.name='adamw'"):
        _cfg("adamw", "--config.optim.nesterov=true")
    with pytest.raises(ConfigError, match="defines no function"):
        _cfg(f"{__file__}:nothing_here")
    _cfg("sgd", "--config.optim.momentum=0.5", "--config.optim.nesterov=true")  # read by sgd


def test_the_registry_and_the_field_list_name_the_same_optimizers():
    """One module per optimizer: the field check and the registry find the same ones (muon only where
    optax has it)."""
    built_in = {"adamw", "lion", "sgd", "adafactor", "muon"}
    assert set(optimizer_fields()) == built_in
    assert set(registry.optimizers()) == built_in - ({"muon"} if not muon.available() else set())
    assert registry.optimizers()["adamw"].in_shard_map and not registry.optimizers()["sgd"].in_shard_map
    assert {f.name for f in dataclasses.fields(registry.Optimizer)} == {"name", "build", "state", "in_shard_map"}


# Heavy-ball SGD as the one file a new optimizer is: the built-in sgd's transformations at its defaults.
ONE_FILE = '''"""Heavy-ball SGD: momentum 0.9, decoupled weight decay."""
import optax

from jaxpar.optim.state import same_shape
from jaxpar.optim.transforms import decay_mask

FIELDS = {"weight_decay"}


def build(o, schedule, placements):
    decay = optax.add_decayed_weights(o.weight_decay, decay_mask(placements))
    return optax.chain(optax.trace(decay=0.9), decay, optax.scale_by_learning_rate(schedule))


def state(o, shape, logical):
    return [same_shape(shape)]
'''


@pytest.fixture
def one_file(tmp_path, monkeypatch):
    """``heavyball``, an optimizer added as one file: a folder holding it on the optimizers package's
    ``__path__`` (the hook jaxpar.optim.optimizers documents)."""
    package = importlib.import_module("jaxpar.optim.optimizers")
    (tmp_path / "heavyball.py").write_text(ONE_FILE)
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(tmp_path)])
    yield "heavyball"
    sys.modules.pop("jaxpar.optim.optimizers.heavyball", None)


def test_an_optimizer_is_one_file(one_file, tmp_path, monkeypatch):
    """The file alone makes ``optim.name=heavyball``: the config takes the field it reads and refuses
    one it does not, the registry builds it, and the planner prices its state (one moment, as lion)."""
    assert optimizer_fields()[one_file] == {"weight_decay"}
    assert registry.get(one_file).state is sys.modules["jaxpar.optim.optimizers.heavyball"].state
    assert _cfg(one_file, "--config.optim.weight_decay=0.05").optim.weight_decay == 0.05
    with pytest.raises(
        ConfigError, match=r"optim.b2=0.9 has no effect with optim.name='heavyball' \(it reads weight_decay\)"
    ):
        _cfg(one_file, "--config.optim.b2=0.9")

    from jaxpar.analysis.clusters import get_cluster
    from jaxpar.analysis.plan import PlanOptions, evaluate_layout

    layout = ParallelLayout(data=8, zero_stage=1, seq_len=4096)
    states = {}
    for name in ("heavyball", "lion"):
        cfg = load_config(str(ROOT / "configs" / "llama2_7b.py"), [f"--config.optim.name={name}"])
        est = evaluate_layout(cfg.model, get_cluster("h100-80g"), layout, PlanOptions(optim=cfg.optim))
        states[name] = est.memory.optimizer_bytes
    assert states["heavyball"] == states["lion"] > 0

    bad = tmp_path / "bad"  # FIELDS not a literal: refused, naming the file
    bad.mkdir()
    (bad / "badfields.py").write_text("FIELDS = sorted({'b1'})\n")
    package = sys.modules["jaxpar.optim.optimizers"]
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(bad)])
    with pytest.raises(TypeError, match="badfields.py: declare FIELDS"):
        optimizer_fields()


@pytest.mark.skipif(not SLOW, reason="JAXPAR_SLOW=1: a one-file optimizer trains (one more compile)")
def test_a_one_file_optimizer_trains_like_the_built_in(one_file):
    """heavyball on ZeRO-1 d8 takes the steps the built-in sgd takes on one device."""
    ref_losses, ref_params, ref_opt, _ = _reference("sgd")
    losses, params, opt, _ = _run(_cfg(one_file, *LAYOUTS["zero1_d8"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert max_rel_error(params, ref_params) < 1e-5
    assert max_rel_error(jax.tree.map(np.float64, opt), jax.tree.map(np.float64, ref_opt)) < 1e-5


def test_plan_and_compare_price_the_configured_optimizer():
    """plan / compare / plan --aot take the config's optimizer: its state, not Adam's, is in the estimate."""
    from jaxpar.analysis.clusters import get_cluster
    from jaxpar.analysis.plan import PlanOptions, evaluate_layout

    layout = ParallelLayout(data=8, zero_stage=1, seq_len=4096)
    states = {}
    for name in ("adamw", "lion", "sgd", "adafactor"):
        cfg = load_config(str(ROOT / "configs" / "llama2_7b.py"), [f"--config.optim.name={name}"])
        est = evaluate_layout(cfg.model, get_cluster("h100-80g"), layout, PlanOptions(optim=cfg.optim))
        states[name] = est.memory.optimizer_bytes
    assert states["adamw"] == pytest.approx(2 * states["lion"]) and states["lion"] == pytest.approx(states["sgd"])
    assert states["adafactor"] < 0.01 * states["adamw"]  # factored second moments, no momentum
    default = evaluate_layout(cfg.model, get_cluster("h100-80g"), layout, PlanOptions())
    assert default.memory.optimizer_bytes == pytest.approx(states["adamw"])  # None prices AdamW
