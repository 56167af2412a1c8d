"""``jaxpar export``: a training checkpoint as an HF LLaMA checkpoint (safetensors + config.json).

Reads the parameters (not the optimizer state) of the newest checkpoint, or ``--step N``, under
the config's ``train.workdir``. Checkpoints hold the model form (layers in model order, separate
embedding and output layer) whatever layout trained them, so any run exports the same way; the
tensors keep their dtype (``model.param_dtype``), so HF -> jaxpar -> HF is bitwise exact. The
parameters are restored onto one device: the host needs their size in memory.

    jaxpar export --config configs/tiny.py -o hf_tiny
    jaxpar export --config configs/llama_1b.py --step 2000 -o hf_1b --overwrite

This module imports JAX lazily (the CLI builds its parser before JAX starts).
"""

from __future__ import annotations

import argparse
import os

from jaxpar.config import ConfigError, load_config

DEFAULT_CONFIG = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "tiny.py"
)


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``jaxpar export`` (``--config.x.y=v`` overrides are split off by the CLI)."""
    parser.add_argument("--config", default=None, help="the run's config file (default: configs/tiny.py)")
    parser.add_argument("-o", "--output", required=True, help="directory to write (safetensors + config.json)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")


def run_export(args: argparse.Namespace) -> int:
    """Export the checkpoint; :class:`ConfigError` (exit 2) for a missing checkpoint or output clash."""
    cfg = load_config(args.config or DEFAULT_CONFIG, list(getattr(args, "overrides", []) or []))
    if os.path.exists(args.output) and not args.overwrite:
        raise ConfigError(f"-o {args.output}: exists; pass --overwrite to replace it or choose another directory")
    from jaxpar.checkpoint import Checkpointer
    from jaxpar.port import weights
    from jaxpar.train.state import one_device_checkpoint_state

    weights.hf_config_from_model(cfg.model)  # a model HF's LLaMA cannot hold fails here, before any read
    directory = os.path.join(cfg.train.workdir, "checkpoints")
    missing = ConfigError(f"train.workdir='{cfg.train.workdir}': no checkpoint in {os.path.abspath(directory)}; "
                          "train first or point --config.train.workdir at a run")
    if not os.path.isdir(directory):
        raise missing
    params, _ = one_device_checkpoint_state(cfg)
    checkpoints = Checkpointer(cfg.train.workdir, 0, 1 << 20, echo=lambda _: None)
    try:
        restored = checkpoints.restore_params(params, args.step)
    finally:
        checkpoints.close()
    if restored is None:
        raise missing
    step, params = restored
    out = weights.save_hf(params, cfg.model, args.output, overwrite=args.overwrite)
    print(f"wrote {out}: checkpoint step {step} of {checkpoints.directory} as an HF LLaMA checkpoint")
    return 0

