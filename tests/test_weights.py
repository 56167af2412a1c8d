"""HF LLaMA checkpoint import/export (jaxpar.port.weights); no torch needed."""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from jaxpar.config import ConfigError, validate
from jaxpar.models import llama
from jaxpar.port import weights
from tests.helpers import make_setup, tiny_config

Q = "model.layers.1.self_attn.q_proj.weight"


def random_params(model_cfg, seed: int = 0) -> dict:
    """Parameters with every entry random (norm scales too), so any mix-up shows."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: llama.init_params(model_cfg, jax.random.key(0)))
    return jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(a.dtype), shapes)


def assert_bitwise(a: dict, b: dict) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        x, y = np.ascontiguousarray(x), np.ascontiguousarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), jax.tree_util.keystr(path)


@pytest.fixture(scope="module")
def model_cfg():
    return tiny_config().model


@pytest.fixture(scope="module")
def saved(model_cfg, tmp_path_factory):
    params = random_params(model_cfg)
    path = weights.save_hf(params, model_cfg, tmp_path_factory.mktemp("ckpt") / "hf")
    return params, path


@pytest.mark.parametrize(
    "overrides",
    [(), ("--config.model.tie_embeddings=true",), ("--config.model.param_dtype=bfloat16",)],
    ids=["untied_fp32", "tied", "bf16"],
)
def test_round_trip_exact(tmp_path, overrides):
    model_cfg = tiny_config(*overrides).model
    params = random_params(model_cfg, seed=1)
    out = weights.save_hf(params, model_cfg, tmp_path / "hf")
    names = set(load_file(str(out / "model.safetensors")))
    assert ("lm_head.weight" in names) != model_cfg.tie_embeddings
    assert Q in names and len(names) == 2 + 9 * model_cfg.num_layers + (not model_cfg.tie_embeddings)
    back_cfg = weights.model_config_from_hf(out)
    for key in (
        "embed_dim",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "mlp_dim",
        "vocab_size",
        "tie_embeddings",
        "rope_theta",
        "norm_eps",
        "max_seq_len",
    ):
        assert back_cfg[key] == model_cfg[key], key
    assert_bitwise(params, weights.load_hf(out, model_cfg))
    with pytest.raises(FileExistsError):
        weights.save_hf(params, model_cfg, out)
    weights.save_hf(params, model_cfg, out, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temp dirs left behind


def test_sharded_files_round_trip(tmp_path, model_cfg):
    params = random_params(model_cfg, seed=2)
    out = weights.save_hf(params, model_cfg, tmp_path / "hf", max_shard_bytes=200_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2 and all((out / f).is_file() for f in files)
    assert_bitwise(params, weights.load_hf(out, model_cfg))
    assert_bitwise(params, weights.load_hf(out / "model.safetensors.index.json", model_cfg))


def test_zero3_load_reads_only_slices(saved, model_cfg):
    """data=4 x tensor=2, ZeRO-3: every device's shard comes straight from the file."""
    cfg = tiny_config("--config.parallel.zero_stage=3")
    setup = make_setup(cfg)
    params, path = saved
    reads: list[tuple[str, tuple[int, ...]]] = []
    loaded = weights.load_hf(
        path, cfg.model, setup.train_form.param_shardings, on_read=lambda n, s: reads.append((n, s))
    )
    flat_s = jax.tree.leaves(setup.train_form.param_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    for arr, host, sharding in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), flat_s):
        assert arr.sharding == sharding
        np.testing.assert_array_equal(np.asarray(arr), host)
        for shard in arr.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), host[shard.index])
    q_full = model_cfg.num_heads * model_cfg.head_dim * model_cfg.embed_dim
    q_reads = [int(np.prod(s)) for n, s in reads if n == Q]
    assert setup.train_form.param_specs["blocks"]["attn"]["wq"] == P(None, "data", "tensor", None)
    assert max(q_reads) == q_full // 8  # heads split over tensor, embed over data: 1/8 per read
    assert all(int(np.prod(s)) < 128 * 256 for n, s in reads if n == "model.embed_tokens.weight")
    # and back: sharded arrays are exported one layer's tensor at a time
    out = weights.save_hf(loaded, cfg.model, path.parent / "from_sharded")
    assert_bitwise(params, weights.load_hf(out, model_cfg))


@pytest.mark.parametrize("meta", [False, True], ids=["hf_layout", "meta_interleaved"])
@pytest.mark.parametrize("dim", [0, 1, 2, 3])
def test_any_dim_sharded(tmp_path, saved, model_cfg, dim, meta):
    """Split dim ``dim`` of every leaf 4 ways: head-dim slices and Meta's permutation included."""
    params, path = saved
    if meta:
        tensors = load_file(str(path / "model.safetensors"))
        for name in list(tensors):
            if "q_proj" in name or "k_proj" in name:
                heads = model_cfg.num_heads if "q_proj" in name else model_cfg.num_kv_heads
                tensors[name] = weights.to_meta_interleaved(tensors[name], heads)
        path = tmp_path / "meta.safetensors"
        save_file(tensors, str(path))
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("r", "x"))

    def spec(a):
        if dim >= a.ndim or a.shape[dim] % 4:
            return NamedSharding(mesh, P())
        return NamedSharding(mesh, P(*([None] * dim), "x"))

    shardings = jax.tree.map(spec, params)
    loaded = weights.load_hf(path, model_cfg, shardings, meta_interleaved=meta)
    for arr, host in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(arr), host)


def test_meta_permutation():
    rng = np.random.default_rng(0)
    heads, d, h = 3, 8, 5
    w_meta = rng.standard_normal((heads * d, h)).astype(np.float32)
    w_hf = weights.from_meta_interleaved(w_meta, heads)
    np.testing.assert_array_equal(weights.to_meta_interleaved(w_hf, heads), w_meta)
    # HF's conversion script: w.view(n, d/2, 2, h).transpose(1, 2).reshape(n*d, h)
    hf_script = w_meta.reshape(heads, d // 2, 2, h).transpose(0, 2, 1, 3).reshape(heads * d, h)
    np.testing.assert_array_equal(w_hf, hf_script)
    # Meta's interleaved RoPE on Meta's rows == jaxpar's rotate-half RoPE on the permuted rows.
    x = rng.standard_normal((1, 6, h)).astype(np.float32)
    pos = np.arange(6)
    q_meta = (x @ w_meta.T).reshape(1, 6, heads, d)
    angle = pos[:, None] * 10000.0 ** (-np.arange(0, d, 2) / d)
    rot = (q_meta[..., 0::2] + 1j * q_meta[..., 1::2]) * np.exp(1j * angle)[None, :, None, :]
    meta_rotated = np.stack([rot.real, rot.imag], axis=-1).reshape(1, 6, heads, d)
    q_hf = jnp.asarray((x @ w_hf.T).reshape(1, 6, heads, d))
    ours = np.asarray(llama.rope(q_hf, jnp.asarray(pos), 10000.0))
    np.testing.assert_allclose(ours, meta_rotated[..., np.arange(d).reshape(d // 2, 2).T.reshape(-1)], atol=1e-5)


def test_meta_names_are_renamed(tmp_path, saved, model_cfg):
    params, path = saved
    tensors = load_file(str(path / "model.safetensors"))
    renames = {
        "model.embed_tokens.": "tok_embeddings.",
        "model.norm.": "norm.",
        "lm_head.": "output.",
        "self_attn.q_proj": "attention.wq",
        "self_attn.k_proj": "attention.wk",
        "self_attn.v_proj": "attention.wv",
        "self_attn.o_proj": "attention.wo",
        "mlp.gate_proj": "feed_forward.w1",
        "mlp.down_proj": "feed_forward.w2",
        "mlp.up_proj": "feed_forward.w3",
        "input_layernorm": "attention_norm",
        "post_attention_layernorm": "ffn_norm",
        "model.layers.": "layers.",
    }
    meta = {}
    for name, value in tensors.items():
        heads = {"q_proj": model_cfg.num_heads, "k_proj": model_cfg.num_kv_heads}
        for key, n in heads.items():
            if key in name:
                value = weights.to_meta_interleaved(value, n)
        for old, new in renames.items():
            name = name.replace(old, new)
        meta[name] = value
    meta["rope.freqs"] = np.zeros(16, np.float32)  # Meta's derived buffer: ignored
    save_file(meta, str(tmp_path / "consolidated.safetensors"))
    assert_bitwise(params, weights.load_hf(tmp_path / "consolidated.safetensors", model_cfg))


def _edit(path, tmp_path, edit) -> str:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(tmp_path / "edited.safetensors"))
    return str(tmp_path / "edited.safetensors")


def test_mismatch_messages_name_the_tensor(tmp_path, saved, model_cfg):
    _, path = saved
    missing = _edit(path, tmp_path, lambda t: t.pop(Q))
    with pytest.raises(ConfigError, match=rf"lacks tensor '{Q}' \(expected \(num_heads\*head_dim, embed_dim\)"):
        weights.load_hf(missing, model_cfg)
    extra = _edit(path, tmp_path, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(128)}))
    with pytest.raises(ConfigError, match=r"unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"):
        weights.load_hf(extra, model_cfg)
    name = "model.layers.2.self_attn.k_proj.weight"
    wrong = _edit(path, tmp_path, lambda t: t.update({name: np.zeros((32, 128), np.float32)}))
    with pytest.raises(ConfigError, match=rf"'{name}' has shape \(32, 128\) but model_cfg expects .* \(64, 128\)"):
        weights.load_hf(wrong, model_cfg)
    fewer = tiny_config("--config.model.num_layers=2").model
    with pytest.raises(ConfigError, match=r"unexpected tensor 'model.layers.2.*num_layers=2"):
        weights.load_hf(path, fewer)
    with pytest.raises(ConfigError, match="no such checkpoint"):
        weights.load_hf(tmp_path / "nope", model_cfg)


def test_config_from_hf_and_rejections(model_cfg):
    hf = weights.hf_config_from_model(model_cfg)
    assert weights.model_config_from_hf(hf).to_dict() == {**model_cfg.to_dict(), "compute_dtype": "bfloat16"}
    older = {k: v for k, v in hf.items() if k not in ("head_dim", "rope_parameters")}  # transformers 4.x style
    assert weights.model_config_from_hf(older).head_dim == model_cfg.embed_dim // model_cfg.num_heads
    bad = [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "rope_scaling"),  # llama3: test_rope_scaling.py
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_parameters"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"model_type": "gpt2"}, "model_type='gpt2'"),
    ]
    for change, needle in bad:
        with pytest.raises(ConfigError, match=needle) as info:
            weights.model_config_from_hf({**hf, **change})
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="hidden_size"):
        weights.model_config_from_hf({k: v for k, v in hf.items() if k != "hidden_size"})
    assert weights.model_config_from_hf({**hf, "model_type": "mistral", "sliding_window": 64}).max_seq_len == 64
    with pytest.raises(ConfigError, match="model.norm='layernorm'"):
        weights.hf_config_from_model(tiny_config("--config.model.norm=layernorm").model)


def test_torch_file_without_torch(tmp_path, model_cfg, monkeypatch):
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    with pytest.raises(ConfigError, match=r"needs PyTorch \(pip install torch\)"):
        weights.load_hf(tmp_path, model_cfg)


def test_bad_torch_file_is_a_config_error(tmp_path, model_cfg):
    pytest.importorskip("torch", reason="torch not installed: the torch-file reader is not reachable")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a torch file")
    with pytest.raises(ConfigError, match=r"torch.load\(weights_only=True\) cannot read it") as info:
        weights.load_hf(tmp_path, model_cfg)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- train.init_from


@pytest.mark.parametrize(
    "layout",
    [
        ("--config.mesh.data=4", "--config.mesh.tensor=2", "--config.parallel.zero_stage=3"),
        (
            "--config.mesh.data=2",
            "--config.mesh.tensor=2",
            "--config.mesh.pipeline=2",
            "--config.parallel.microbatches=2",
            "--config.parallel.zero_stage=1",
        ),
    ],
    ids=["zero3_tp2", "pipeline2"],
)
def test_init_from_hf_lands_in_the_layout(saved, layout):
    """train.init_from: the HF weights arrive in the layout's form (ZeRO-3 shards; the pipeline's
    stage form with embedding and head in `ends`), bitwise, with a zero optimizer state."""
    params, path = saved
    cfg = tiny_config(*layout, f"--config.train.init_from={path}")
    setup = make_setup(cfg)
    got, opt = setup.init_from_hf(
        weights.load_checked(cfg.train.init_from, cfg.model, setup.model_form.param_shardings)
    )
    assert jax.tree.structure(got) == jax.tree.structure(setup.train_form.abstract)
    for arr, sharding in zip(jax.tree.leaves(got), jax.tree.leaves(setup.train_form.param_shardings)):
        assert arr.sharding.is_equivalent_to(sharding, arr.ndim)
    model_form, _ = setup.to_model_order(got, opt)
    assert_bitwise(params, jax.device_get(model_form))
    assert int(opt["count"]) == 0 and all(not np.any(np.asarray(m)) for m in jax.tree.leaves(opt["mu"]))


def test_init_from_hf_rejects_another_model(saved):
    _, path = saved
    cfg = tiny_config("--config.model.num_layers=2", f"--config.train.init_from={path}")
    setup = make_setup(cfg)
    with pytest.raises(ConfigError, match=r"num_hidden_layers.*set --config.model.num_layers=4$") as e:
        setup.init_from_hf(weights.load_checked(cfg.train.init_from, cfg.model, setup.model_form.param_shardings))
    assert "\n" not in str(e.value)


def test_init_from_missing_path_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="train.init_from=.*no such file or directory"):
        tiny_config(f"--config.train.init_from={tmp_path / 'nope'}")


def test_trainer_starts_from_hf_then_resumes_its_own_checkpoint(saved, tmp_path):
    """With nothing to resume the trainer starts from the HF weights; once it has a checkpoint, a
    restart resumes that (init_from is for the first start only)."""
    from jaxpar.train.loop import Trainer

    params, path = saved
    overrides = [
        f"--config.train.init_from={path}",
        f"--config.train.workdir={tmp_path}",
        "--config.data.source=synthetic",
        "--config.checkpoint.every=1",
        "--config.train.steps=1",
    ]
    messages: list[str] = []
    cfg = tiny_config(*overrides)
    trainer = Trainer(cfg, validate(cfg), echo=messages.append, progress=False, weights_loader=weights.load_checked)
    trainer.initialize()
    assert any(m == f"initialised from HF weights in {path}" for m in messages)
    assert_bitwise(params, jax.device_get(trainer.params))
    trainer.train_step()
    trainer.save()
    trainer.checkpoints.wait()
    again = Trainer(cfg, validate(cfg), echo=messages.append, progress=False, weights_loader=weights.load_checked)
    again.initialize()
    assert again.step == 1 and messages[-1].startswith("resumed from checkpoint at step 1")
    again.close()
    trainer.close()


# --------------------------------------------------------------------------- jaxpar export


def test_export_writes_the_checkpoint_as_hf(tmp_path, capsys):
    """A pipeline run (stage form: ends, interleaved layer order) checkpoints the model form; export
    writes it as HF safetensors that load back bitwise equal to the checkpointed parameters."""
    from jaxpar.cli import main
    from jaxpar.train.loop import Trainer

    overrides = [
        f"--config.train.workdir={tmp_path / 'run'}",
        "--config.data.source=synthetic",
        "--config.checkpoint.every=1",
        "--config.train.steps=1",
        "--config.mesh.data=2",
        "--config.mesh.tensor=2",
        "--config.mesh.pipeline=2",
        "--config.parallel.microbatches=2",
        "--config.parallel.pipeline_schedule=interleaved",
        "--config.parallel.virtual_stages=2",
    ]
    cfg = tiny_config(*overrides)
    trainer = Trainer(cfg, validate(cfg), echo=lambda _: None, progress=False)
    trainer.initialize()
    trainer.train_step()
    trainer.save()
    trainer.close()
    want, _ = trainer.setup.to_model_order(trainer.params, trainer.opt_state)
    out = tmp_path / "hf"
    from tests.helpers import FP32_SMALL, TINY

    assert main(["export", "--config", TINY, "-o", str(out), *FP32_SMALL, *overrides]) == 0
    assert f"wrote {out}: checkpoint step 1" in capsys.readouterr().out
    assert_bitwise(jax.device_get(want), weights.load_hf(out, cfg.model))
    # the output exists now: a second export needs --overwrite; a run without checkpoints says so
    assert main(["export", "--config", TINY, "-o", str(out), *FP32_SMALL, *overrides]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--overwrite" in err
    empty = [f"--config.train.workdir={tmp_path / 'none'}"]
    assert main(["export", "--config", TINY, "-o", str(tmp_path / "x"), *FP32_SMALL, *empty]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no checkpoint" in err and not (tmp_path / "x").exists()
    assert not (tmp_path / "none").exists()  # a failed export creates nothing
