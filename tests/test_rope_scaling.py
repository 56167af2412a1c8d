"""Llama 3.1's scaled RoPE (``model.rope_scaling=llama3``, :func:`jaxpar.models.llama.rope_frequencies`):
the frequencies against an independent transcription of Meta's reference, the config's checks, the
HF ``config.json`` in and out, and (with torch and transformers) a tiny ``LlamaForCausalLM`` with llama3
``rope_scaling`` whose logits jaxpar reproduces in fp32 within 1e-5, where the unscaled model does not."""

from __future__ import annotations

import math
import os

import jax
import numpy as np
import pytest

from jaxpar import acts
from jaxpar.config import ConfigError, default_config, validate
from jaxpar.models import llama
from jaxpar.port import weights
from tests.helpers import llama_logits, tiny_config, tiny_hf_llama

# a small original context so a short sequence crosses every band: head dim 16, theta 1e4 gives
# wavelengths 6.3 (< 32/4: kept), 19.9 (between 8 and 32: interpolated) and 62.8 up (> 32: divided by 8)
HEAD_DIM, THETA, ORIGINAL = 16, 10000.0, 32
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL}
SEQ = 96  # > ORIGINAL / high_freq_factor (and > ORIGINAL)


def meta_apply_scaling(freqs, factor, low, high, original):
    """Meta's Llama 3.1 ``apply_scaling`` (llama/model.py of meta-llama/llama-models), in float64."""
    low_wavelen, high_wavelen = original / low, original / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(freq)
        elif wavelen > low_wavelen:
            out.append(freq / factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


@pytest.mark.parametrize(
    "head_dim, theta, scaling",
    [
        (HEAD_DIM, THETA, llama.RopeScaling(8.0, 1.0, 4.0, ORIGINAL)),
        (128, 500000.0, llama.RopeScaling()),  # Llama 3.1 8B / 70B / 405B
        (64, 10000.0, llama.RopeScaling(32.0, 2.0, 7.0, 100)),
    ],
)
def test_frequencies_are_metas(head_dim, theta, scaling):
    base = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    want = meta_apply_scaling(
        base, scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor, scaling.original_max_seq_len
    )
    got = np.asarray(llama.rope_frequencies(head_dim, theta, scaling))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    wavelen = 2 * math.pi / base
    kept = wavelen < scaling.original_max_seq_len / scaling.high_freq_factor
    divided = wavelen > scaling.original_max_seq_len / scaling.low_freq_factor
    assert kept.any() and divided.any() and (~kept & ~divided).any()  # every band is exercised
    np.testing.assert_array_equal(got[kept], np.asarray(llama.rope_frequencies(head_dim, theta))[kept])
    middle = ~kept & ~divided
    assert np.all(got[middle] < base[middle]) and np.all(got[middle] > base[middle] / scaling.factor)


def test_no_scaling_is_plain_rope():
    cfg = tiny_config()
    assert cfg.model.rope_scaling == "none" and llama.shard_context_for(cfg.model).rope_scaling is None
    cfg = tiny_config("--config.model.rope_scaling=llama3", "--config.model.rope_scaling_factor=16")
    assert llama.shard_context_for(cfg.model).rope_scaling == llama.RopeScaling(16.0, 1.0, 4.0, 8192)


@pytest.mark.parametrize(
    "override, field",
    [
        ("--config.model.rope_scaling=yarn", "model.rope_scaling='yarn'"),
        ("--config.model.rope_scaling_factor=0.5", "model.rope_scaling_factor=0.5"),
        ("--config.model.rope_scaling_factor=inf", "model.rope_scaling_factor=inf"),
        ("--config.model.rope_low_freq_factor=0", "model.rope_low_freq_factor=0"),
        ("--config.model.rope_high_freq_factor=1", "model.rope_high_freq_factor=1.0"),
        ("--config.model.rope_original_max_seq_len=0", "model.rope_original_max_seq_len=0"),
    ],
)
def test_bad_values_are_refused_in_one_line(override, field):
    with pytest.raises(ConfigError) as info:
        validate(tiny_config("--config.model.rope_scaling=llama3", override))
    message = str(info.value)
    assert message.startswith(field) and "\n" not in message, message


def test_the_factors_act_only_with_llama3_scaling():
    with pytest.raises(ConfigError, match=r"^model.rope_scaling_factor=16.0 has no effect here: .*rope_scaling='none'"):
        validate(tiny_config("--config.model.rope_scaling_factor=16"))
    with pytest.raises(ConfigError, match=r"^model.rope_scaling='llama3' has no effect here: .*position='learned'"):
        validate(tiny_config("--config.model.position=learned", "--config.model.rope_scaling=llama3"))
    # a derived config without RoPE drops the scaling and its factors in one pass
    cfg = tiny_config("--config.model.rope_scaling=llama3", "--config.model.rope_scaling_factor=16")
    cfg.model.position = "learned"
    assert acts.reset_inert(cfg, default_config()) == ["model.rope_scaling", "model.rope_scaling_factor"]
    validate(cfg)


# --------------------------------------------------------------------------- config.json


def _hf(**extra) -> dict:
    model_cfg = tiny_config().model
    return {**weights.hf_config_from_model(model_cfg), **extra}


def test_config_json_llama3_in_and_out():
    for where in ("rope_scaling", "rope_parameters"):  # transformers 4's key and transformers 5's
        m = weights.model_config_from_hf(_hf(**{where: {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3}}))
        got = (m.rope_scaling, m.rope_scaling_factor, m.rope_low_freq_factor, m.rope_high_freq_factor)
        assert got == ("llama3", 8.0, 1.0, 4.0) and m.rope_original_max_seq_len == ORIGINAL, where
        assert m.rope_theta == 5e5
        back = weights.hf_config_from_model(m)
        assert back["rope_scaling"] == {"rope_type": "llama3", **LLAMA3}
        assert back["rope_parameters"] == {"rope_type": "llama3", **LLAMA3, "rope_theta": 5e5}
        assert weights.model_config_from_hf(back).to_dict() == m.to_dict()
    # Llama 3.1 8B's own config.json (transformers 4 style: top-level rope_theta, "rope_scaling")
    hub = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    m = weights.model_config_from_hf(_hf(rope_theta=500000.0, rope_scaling={**hub, "rope_type": "llama3"}))
    assert (m.rope_scaling, m.rope_theta, m.rope_original_max_seq_len) == ("llama3", 500000.0, 8192)
    # transformers falls back to max_position_embeddings without original_max_position_embeddings
    no_original = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    m = weights.model_config_from_hf(_hf(rope_scaling={"rope_type": "llama3", **no_original}))
    assert m.rope_original_max_seq_len == m.max_seq_len


@pytest.mark.parametrize(
    "scaling, needle",
    [
        ({"rope_type": "yarn", "factor": 4.0}, r"rope_scaling=.*yarn.* is not supported; only plain RoPE and"),
        ({"type": "linear", "factor": 2.0}, r"rope_scaling=.*linear.* is not supported"),
        ({"rope_type": "llama3", "factor": 8.0}, r"rope_scaling has rope_type llama3 but no 'low_freq_factor'"),
        ({"rope_type": "llama3", **LLAMA3, "factor": 0.5}, r"rope_scaling: model.rope_scaling_factor=0.5"),
        ({"rope_type": "llama3", **LLAMA3, "high_freq_factor": 1.0}, r"rope_scaling: model.rope_high_freq_factor"),
        ({"rope_type": "llama3", **LLAMA3, "factor": "8"}, r"rope_scaling.factor=\"8\" is not a number"),
        (
            {"rope_type": "llama3", **LLAMA3, "original_max_position_embeddings": 8192.5},
            r"original_max_position_embeddings=8192.5 is not a whole number",
        ),
    ],
)
def test_config_json_rope_refusals(scaling, needle):
    with pytest.raises(ConfigError, match=needle) as info:
        weights.model_config_from_hf(_hf(rope_scaling=scaling))
    assert "\n" not in str(info.value) and str(info.value).startswith("config.json: ")


def test_weights_beside_a_llama3_config_json_need_the_scaling(tmp_path):
    model_cfg = tiny_config("--config.model.rope_scaling=llama3").model
    params = jax.tree.map(np.asarray, llama.init_params(model_cfg, jax.random.key(0)))
    path = weights.save_hf(params, model_cfg, tmp_path / "hf")
    weights.check_hf_model(path, model_cfg)
    with pytest.raises(ConfigError, match=r"rope_scaling.rope_type giving model.rope_scaling='llama3'"):
        weights.check_hf_model(path, tiny_config().model)
    other = tiny_config("--config.model.rope_scaling=llama3", "--config.model.rope_scaling_factor=32").model
    with pytest.raises(ConfigError, match=r"set --config.model.rope_scaling_factor=8.0$"):
        weights.check_hf_model(path, other)


# --------------------------------------------------------------------------- parity with transformers


def test_logits_match_transformers_llama3(tmp_path):
    """fp32 logits of a tiny LlamaForCausalLM with llama3 rope_scaling, imported and exported: within 1e-5
    of transformers'; the same weights with plain RoPE are far off, so the test needs the scaling."""
    torch = pytest.importorskip("torch", reason="torch not installed: pip install -e '.[torch]'")
    transformers = pytest.importorskip("transformers", reason="transformers not installed: pip install -e '.[torch]'")
    rope = {"rope_type": "llama3", "rope_theta": THETA, **LLAMA3}
    model = tiny_hf_llama(tmp_path / "hf", head_dim=HEAD_DIM, max_position_embeddings=128, rope_parameters=rope).eval()
    model_cfg = weights.model_config_from_hf(tmp_path / "hf")
    assert (model_cfg.rope_scaling, model_cfg.rope_original_max_seq_len) == ("llama3", ORIGINAL)
    model_cfg.compute_dtype = "float32"
    params = weights.load_hf(tmp_path / "hf", model_cfg)
    inputs = np.random.default_rng(0).integers(0, 256, size=(2, SEQ)).astype(np.int32)
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(inputs).long()).logits.numpy()
    scaled = float(np.max(np.abs(llama_logits(params, model_cfg, inputs) - ref)))
    plain_cfg = weights.model_config_from_hf(tmp_path / "hf")
    plain_cfg.compute_dtype, plain_cfg.rope_scaling = "float32", "none"
    plain = float(np.max(np.abs(llama_logits(params, plain_cfg, inputs) - ref)))
    print(
        f"\nmax |logits diff| vs transformers: scaled {scaled:.3e}, unscaled {plain:.3e} (max |logits| "
        f"{np.max(np.abs(ref)):.3e}, seq {SEQ})"
    )
    assert scaled < 1e-5
    assert plain > 100 * 1e-5  # without the scaling the same weights compute something else

    # and out: transformers reads jaxpar's export (config.json with rope_scaling) as the same model
    out = weights.save_hf(params, model_cfg, tmp_path / "export")
    back = transformers.LlamaForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    assert back.config.rope_parameters["rope_type"] == "llama3"
    with torch.no_grad():
        again = back.float().eval()(input_ids=torch.from_numpy(inputs).long()).logits.numpy()
    assert np.max(np.abs(again - ref)) == 0.0


# --------------------------------------------------------------------------- sharded layouts

# seq 64 (tests.helpers.FP32_SMALL), head dim 32: an original context of 32 puts frequencies in all three bands
SCALED = ["--config.model.rope_scaling=llama3", "--config.model.rope_original_max_seq_len=32"]


@pytest.mark.skipif(
    os.environ.get("JAXPAR_SLOW") != "1",
    reason="JAXPAR_SLOW=1: three compiles; the scaled frequencies are checked on one device above, and context "
    "parallelism's per-rank positions by tests/test_context.py",
)
def test_a_sharded_layout_trains_the_single_device_steps():
    """Context x data x tensor with sequence parallelism and ZeRO-3 (each rank rotates its own positions)
    trains the same two steps as one device with the scaling; without it the parameters differ."""
    from tests.helpers import max_rel_error, run_steps

    one = ["--config.mesh.data=1", "--config.mesh.tensor=1"]
    ref_history, ref_params, _ = run_steps(tiny_config(*one, *SCALED), 2)
    sharded = [
        "--config.model.attention=blockwise",
        "--config.model.attention_block=16",
        "--config.mesh.context=2",
        "--config.mesh.data=2",
        "--config.mesh.tensor=2",
        "--config.parallel.zero_stage=3",
        "--config.parallel.sequence_parallel=true",
    ]
    history, params, _ = run_steps(tiny_config(*sharded, *SCALED), 2)
    for got, want in zip(history, ref_history):
        assert abs(got["loss"] - want["loss"]) / want["loss"] < 1e-5, (got, want)
    assert max_rel_error(params, ref_params) < 1e-5
    _, plain_params, _ = run_steps(tiny_config(*one), 2)
    assert max_rel_error(plain_params, ref_params) > 1e-3  # measured: 2.9e-2
