"""fp16 loss scaling: the scale sequences of DeepSpeed's and Megatron's rules on a scripted overflow
pattern (expected numbers worked by hand from DeepSpeed's DynamicLossScaler.update_scale and
Megatron-LM's DynamicGradScaler.update), a forced overflow skipping exactly its step, a tiny fp16
run training, and the scale surviving a checkpoint."""

import json

import jax
import numpy as np
import pytest

from jaxpar.config import ConfigError, default_config, validate
from jaxpar.train import loss_scale
from jaxpar.train.loop import Trainer
from tests.helpers import make_setup, tiny_config

PATTERN = "GGGOOGGOGGGOGO"  # G: a good step, O: an overflow


def _rule(rule: str, power: int = 4, window: int = 2, hysteresis: int = 2, min_scale: float = 1.0, **kw):
    return loss_scale.LossScale(0.0, 2.0**power, window, hysteresis, min_scale, kw.get("consecutive", False), rule)


def _scales(ls, pattern: str) -> tuple[list[float], float, list[bool]]:
    """The scale each step used, the scale after the last and each step's stop flag."""
    state, used, stops = loss_scale.init_state(ls), [], []
    for c in pattern:
        used.append(float(state["scale"]))
        state, stop = loss_scale.update(ls, state, np.bool_(c == "O"))
        stops.append(bool(stop))
    return used, float(state["scale"]), stops


def test_deepspeed_rule_sequence():
    # init 16, window 2, hysteresis 2. DeepSpeed grows at a good step when (iter - last_overflow - 1) is a
    # positive multiple of the window: iter 2 (-> 32); iter 3 spends the hysteresis, iter 4 halves (-> 16)
    # and leaves it spent, so iter 7 halves again (-> 8); iter 10 is 2 good steps after iter 7 (-> 16,
    # hysteresis refilled); iter 11 spends it, iter 13 halves (-> 8).
    used, after, stops = _scales(_rule("deepspeed"), PATTERN)
    assert used == [16, 16, 16, 32, 32, 16, 16, 16, 8, 8, 8, 16, 16, 16]
    assert after == 8 and not any(stops)


def test_megatron_rule_sequence():
    # Megatron grows after `window` good steps in a row (iter 1, 6, 9), an overflow resets that count;
    # the scale halves once `hysteresis` overflows have been seen since the last growth (iter 4, 13).
    used, after, stops = _scales(_rule("megatron"), PATTERN)
    assert used == [16, 16, 32, 32, 32, 16, 16, 32, 32, 32, 64, 64, 64, 64]
    assert after == 32 and not any(stops)


def test_deepspeed_consecutive_hysteresis_and_the_floor():
    assert _scales(_rule("deepspeed"), "OGO")[1] == 8  # hysteresis 2 spent by iter 0: iter 2 halves
    assert _scales(_rule("deepspeed", consecutive=True), "OGO")[1] == 16  # the good step refilled it
    # hysteresis 1, from 2 with floor 1: the first overflow halves to 1, the second stops DeepSpeed
    assert _scales(_rule("deepspeed", power=1, hysteresis=1), "OO")[1:] == (1.0, [False, True])
    # Megatron keeps the floor and goes on
    assert _scales(_rule("megatron", power=1, hysteresis=1), "OOO")[1:] == (1.0, [False, False, False])


def test_fields_act_only_with_fp16():
    cfg = default_config()
    cfg.train.loss_scale.window = 5
    with pytest.raises(ConfigError, match=r"train.loss_scale.window=5 has no effect.*model.compute_dtype"):
        validate(cfg)
    cfg.model.compute_dtype = "float16"
    validate(cfg)
    cfg.train.loss_scale.static = 128.0  # a fixed scale: the dynamic fields do nothing
    with pytest.raises(ConfigError, match=r"train.loss_scale.window=5 .*train.loss_scale.static=128"):
        validate(cfg)
    cfg.train.loss_scale.window = 1000
    validate(cfg)
    cfg.train.loss_scale.min_scale = 0.0  # out of its domain, inert or not
    with pytest.raises(ConfigError, match=r"^train.loss_scale.min_scale=0.0: use a value > 0"):
        validate(cfg)


def _fp16(*overrides: str, data: int = 2):
    return tiny_config(
        f"--config.mesh.data={data}",
        "--config.mesh.tensor=1",
        "--config.model.compute_dtype=float16",
        "--config.train.loss_scale.hysteresis=1",
        *overrides,
    )


def test_forced_overflow_skips_exactly_that_step():
    setup = make_setup(_fp16("--config.train.loss_scale.window=1000"))
    params, opt = setup.init(0)
    rows = np.random.default_rng(0).integers(0, 256, size=(8, 65))
    batch = setup.feed.make_batch(rows)
    losses = []
    for step in range(6):
        if step == 3:  # force an overflow: a scale no fp16 gradient survives
            state = dict(
                opt["loss_scale"], scale=jax.device_put(np.float32(2.0**40), opt["loss_scale"]["scale"].sharding)
            )
            opt = {**opt, "loss_scale": state}
            before = jax.device_get((params, {k: v for k, v in opt.items() if k != "loss_scale"}))
        params, opt, metrics = setup.train_step(params, opt, batch)
        m = jax.device_get(metrics)
        assert (int(m["overflow"]), int(m["skipped"])) == ((1, 1) if step == 3 else (0, 0)), step
        if step == 3:
            after = jax.device_get((params, {k: v for k, v in opt.items() if k != "loss_scale"}))
            for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
                np.testing.assert_array_equal(a, b)  # nothing moved, the count included
            assert float(opt["loss_scale"]["scale"]) == 2.0**39  # hysteresis 1: halved
            opt = {**opt, "loss_scale": loss_scale.init_state(setup.loss_scale)}  # back to 2**16
        else:
            losses.append(float(m["loss"]))
    assert int(opt["count"]) == 5 and losses[-1] < losses[0] - 0.3  # 5 updates; the loss falls


def _rows(trainer):
    return [r for r in (json.loads(x) for x in open(trainer.log.path).read().splitlines()) if "loss" in r]


def test_fp16_run_follows_the_rule_and_resumes_the_scale(tmp_path):
    # power 20 and window 1: the scale doubles at each good step until gradients overflow fp16, then halves
    common = ("--config.train.loss_scale.initial_scale_power=20", "--config.train.loss_scale.window=1")
    common += (f"--config.train.workdir={tmp_path}", "--config.checkpoint.every=3", "--config.train.eval_batches=0")
    cfg = _fp16("--config.train.steps=6", *common, data=8)
    lines = []
    first = Trainer(cfg, validate(cfg), echo=lines.append, progress=False)
    first.run()
    rows = _rows(first)
    pattern = "".join("O" if r["overflow"] else "G" for r in rows)
    assert "O" in pattern and "G" in pattern, pattern
    used, after, _ = _scales(_rule("deepspeed", power=20, window=1, hysteresis=1), pattern)
    assert [r["loss_scale"] for r in rows] == used
    assert [r["skipped"] for r in rows] == [r["overflow"] for r in rows]  # overflows are the only skips
    assert rows[-1]["bad_steps_total"] == pattern.count("O")
    assert sum("gradient overflow at loss scale" in line for line in lines) == pattern.count("O")
    assert float(first.opt_state["loss_scale"]["scale"]) == after
    good = [r["loss"] for r in rows if not r["overflow"]]
    assert good[-1] < good[0]
    cfg = _fp16("--config.train.steps=9", *common, data=8)
    second = Trainer(cfg, validate(cfg), echo=lambda _: None, progress=False)
    second.run()
    assert second.step == 9 and _rows(second)[6]["step"] == 7
    assert _rows(second)[6]["loss_scale"] == after  # the scale of step 7 continues from step 6's
