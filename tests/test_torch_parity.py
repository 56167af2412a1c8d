"""A tiny HF ``LlamaForCausalLM`` imported into jaxpar computes the same logits, loss, gradients and
10 AdamW training steps (fp32), and jaxpar -> HF -> jaxpar is bitwise exact.

Needs torch and transformers (``pip install -e '.[torch]'``); skipped without them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch not installed: pip install -e '.[torch]' for the HF parity tests")
transformers = pytest.importorskip(
    "transformers", reason="transformers not installed: pip install -e '.[torch]' for the HF parity tests"
)

from jaxpar.config import ConfigError, default_config, validate  # noqa: E402
from jaxpar.mesh import single_device_mesh  # noqa: E402
from jaxpar.models import llama  # noqa: E402
from jaxpar.port import weights  # noqa: E402
from jaxpar.train.state import Setup  # noqa: E402
from tests.helpers import llama_logits, tiny_hf_llama  # noqa: E402

BATCH, SEQ, STEPS = 4, 32, 10


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny_llama"
    tiny_hf_llama(path)
    return path


def hf_model(path):
    model = transformers.LlamaForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    return model.float().train()  # dropout is 0: train mode only matters for clarity


def jaxpar_cfg(path):
    model_cfg = weights.model_config_from_hf(path)
    model_cfg.compute_dtype = "float32"
    return model_cfg


def tokens(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(BATCH, SEQ + 1)).astype(np.int32)


def test_logits_loss_and_grads_match(hf_dir):
    model, model_cfg = hf_model(hf_dir), jaxpar_cfg(hf_dir)
    params = weights.load_hf(hf_dir, model_cfg)
    batch = tokens(0)
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(batch[:, :-1]).long()).logits.numpy()
    logits_diff = float(np.max(np.abs(llama_logits(params, model_cfg, batch[:, :-1]) - ref)))
    print(f"\nmax |logits diff| = {logits_diff:.3e} (max |logits| {np.max(np.abs(ref)):.3e})")
    assert logits_diff < 1e-4

    t = torch.from_numpy(batch).long()
    out = model(input_ids=t, labels=t)  # HF shifts the labels: mean over BATCH * SEQ next-token losses
    out.loss.backward()
    ctx = llama.shard_context_for(model_cfg)
    loss_fn = jax.jit(jax.value_and_grad(lambda p, b: llama.loss_sum(p, b, ctx) / (BATCH * SEQ)))
    loss, grads = loss_fn(params, jnp.asarray(batch))
    print(f"loss: torch {out.loss.item():.8f} jaxpar {float(loss):.8f}")
    assert abs(float(loss) - out.loss.item()) / out.loss.item() < 1e-5
    ours = weights.hf_tensors(jax.device_get(grads), model_cfg)
    theirs = {name: p.grad.numpy() for name, p in model.named_parameters()}
    assert set(ours) == set(theirs)
    errs = {n: float(np.max(np.abs(ours[n] - g)) / np.max(np.abs(g))) for n, g in theirs.items()}
    worst = max(errs, key=errs.get)
    print(f"grad rel error: max {errs[worst]:.3e} ({worst}), median {np.median(list(errs.values())):.3e}")
    assert errs[worst] < 1e-4, worst


def lr_lambda(k: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup from 0, then cosine to ``min_ratio``: jaxpar's schedule(k) / peak, written out."""
    if k < warmup:
        return k / warmup
    progress = (k - warmup) / (total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def test_training_matches_torch_adamw(hf_dir, tmp_path):
    model, model_cfg = hf_model(hf_dir), jaxpar_cfg(hf_dir)
    cfg = default_config()
    cfg.model = model_cfg
    cfg.mesh.data = cfg.mesh.tensor = cfg.mesh.pipeline = 1
    cfg.train.global_batch, cfg.train.seq_len, cfg.train.steps, cfg.parallel.microbatches = BATCH, SEQ, STEPS, 1
    o = cfg.optim
    o.lr, o.warmup_steps, o.schedule, o.min_lr_ratio, o.decay_steps, o.warmup_init_lr = 1e-2, 3, "cosine", 0.1, -1, 0.0
    o.b1, o.b2, o.eps, o.weight_decay, o.clip_norm = 0.9, 0.95, 1e-8, 0.1, 0.5
    setup = Setup(cfg, validate(cfg, 1), single_device_mesh())
    params = weights.load_hf(hf_dir, cfg.model, setup.train_form.param_shardings)
    zeros = jax.tree.map(lambda a: np.zeros(a.shape, np.float32), setup.train_form.abstract)
    opt_state = jax.device_put(
        {"count": np.zeros((), np.int32), "mu": zeros, "nu": zeros}, setup.train_form.opt_shardings
    )

    no_decay = [p for n, p in model.named_parameters() if "norm" in n]
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr,
        betas=(o.b1, o.b2),
        eps=o.eps,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: lr_lambda(k, o.warmup_steps, STEPS, o.min_lr_ratio))
    clipped = 0
    for step in range(STEPS):
        batch = tokens(100 + step % 2)  # two batches, revisited: the loss falls
        torch_lr = sched.get_last_lr()[0]
        opt.zero_grad()
        t = torch.from_numpy(batch).long()
        loss = model(input_ids=t, labels=t).loss
        loss.backward()
        torch_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_norm))
        opt.step()
        sched.step()
        params, opt_state, metrics = setup.train_step(params, opt_state, setup.feed.make_batch(batch))
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        rel = abs(m["loss"] - loss.item()) / loss.item()
        clipped += torch_norm > o.clip_norm
        print(
            f"step {step}: loss torch {loss.item():.7f} jaxpar {m['loss']:.7f} rel {rel:.2e} "
            f"lr {torch_lr:.3e}/{m['lr']:.3e} grad-norm {torch_norm:.4f}/{m['grad_norm']:.4f}"
        )
        assert rel < 1e-4, step
        assert m["lr"] == pytest.approx(torch_lr, rel=1e-6, abs=1e-12), step
        assert m["grad_norm"] == pytest.approx(torch_norm, rel=1e-4), step
    assert clipped >= 1  # clipping was exercised
    final = jax.device_get(params)
    theirs = {n: p.detach().numpy() for n, p in model.named_parameters()}
    ours = weights.hf_tensors(final, cfg.model)
    err = max(float(np.max(np.abs(ours[n] - v)) / np.max(np.abs(v))) for n, v in theirs.items())
    print(f"final params max rel error {err:.3e}")
    assert err < 1e-3

    # jaxpar -> HF -> jaxpar: transformers reads our export and writes back the same bits.
    exported = weights.save_hf(final, cfg.model, tmp_path / "export")
    reloaded = hf_model(exported)
    for name, value in reloaded.state_dict().items():
        assert np.array_equal(value.numpy(), ours[name]), name
    batch = tokens(7)
    with torch.no_grad():
        ref = reloaded(input_ids=torch.from_numpy(batch[:, :-1]).long()).logits.numpy()
    assert np.max(np.abs(llama_logits(final, cfg.model, batch[:, :-1]) - ref)) < 1e-4
    reloaded.save_pretrained(tmp_path / "resaved")
    back = weights.load_hf(tmp_path / "resaved", weights.model_config_from_hf(tmp_path / "resaved"))
    for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(back)):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def test_torch_state_dict_file(hf_dir, tmp_path):
    """``torch.load(weights_only=True)`` files, fp32 and bf16 (mmap'ed, read slice by slice)."""
    model, model_cfg = hf_model(hf_dir), jaxpar_cfg(hf_dir)
    expected = weights.load_hf(hf_dir, model_cfg)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(weights.load_hf(tmp_path, model_cfg))):
        assert np.array_equal(a, b)
    torch.save({k: v.bfloat16() for k, v in model.state_dict().items()}, tmp_path / "bf16.pt")
    loaded = weights.load_hf(tmp_path / "bf16.pt", model_cfg)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(loaded)):
        assert b.dtype == np.float32 and np.array_equal(np.asarray(a).astype(jnp.bfloat16).astype(np.float32), b)
    torch.save({**model.state_dict(), "extra": Unsafe()}, tmp_path / "unsafe.pt")
    with pytest.raises(ConfigError, match="weights_only=True"):  # refused, never unpickled
        weights.load_hf(tmp_path / "unsafe.pt", model_cfg)
    assert not Unsafe.unpickled


class Unsafe:
    """An arbitrary object: ``weights_only=True`` must refuse to rebuild it."""

    unpickled = False

    def __setstate__(self, state):
        Unsafe.unpickled = True
