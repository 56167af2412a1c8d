"""``jaxpar export``: a training checkpoint as an HF LLaMA checkpoint (safetensors + config.json).

Reads the parameters (not the optimizer state) of the newest checkpoint, or ``--step N``, under
the config's ``train.workdir``. Checkpoints hold the model form (layers in model order, separate
embedding and output layer) whatever layout trained them, so any run exports the same way; the
tensors keep their dtype (``model.param_dtype``), so HF -> jaxpar -> HF is bitwise exact. The
parameters are restored onto one device: the host needs their size in memory.

    jaxpar export --config configs/tiny.py -o hf_tiny
    jaxpar export --config configs/llama_1b.py --step 2000 -o hf_1b --overwrite

This module imports JAX lazily (the CLI builds its parser before JAX starts); the flags are in
:mod:`jaxpar.cli.export`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from jaxpar.config import ConfigDict, ConfigError


@dataclasses.dataclass(frozen=True)
class Exported:
    """What :func:`export_checkpoint` wrote: the output directory, the step and the checkpoint folder read."""

    output: str
    step: int
    checkpoints: str


def export_checkpoint(
    cfg: ConfigDict, output: str, step: int | None = None, overwrite: bool = False, echo: Callable[[str], None] = print
) -> Exported:
    """Write the parameters of checkpoint ``step`` (default: the newest that restores) under
    ``cfg.train.workdir`` to ``output`` as HF safetensors + config.json; :class:`ConfigError` for a model
    HF's LLaMA cannot hold, a missing checkpoint, a damaged ``step`` or another model's checkpoint
    (nothing is written then). Damaged newer checkpoints skipped without ``step`` are reported to ``echo``."""
    from jaxpar.checkpoint import Checkpointer
    from jaxpar.port import weights
    from jaxpar.train.state import one_device_checkpoint_state

    weights.hf_config_from_model(cfg.model)  # a model HF's LLaMA cannot hold fails here, before any read
    directory = os.path.join(cfg.train.workdir, "checkpoints")
    missing = ConfigError(
        f"train.workdir='{cfg.train.workdir}': no checkpoint in {os.path.abspath(directory)}; "
        "train first or point --config.train.workdir at a run"
    )
    if not os.path.isdir(directory):
        raise missing
    params, _ = one_device_checkpoint_state(cfg)
    checkpoints = Checkpointer(cfg.train.workdir, 0, 1 << 20, echo=echo, model=cfg.model)
    try:
        restored = checkpoints.restore_params(params, step)
    finally:
        checkpoints.close()
    if restored is None:
        raise missing
    step, params = restored
    out = weights.save_hf(params, cfg.model, output, overwrite=overwrite)
    return Exported(str(out), step, str(checkpoints.directory))
