"""Per-device sizes of one microbatch through one layer, the unit every activation count of
:mod:`jaxpar.analysis.activations` and :mod:`jaxpar.analysis.attention_blocks` is written in."""

from __future__ import annotations

import dataclasses

from jaxpar.config import ConfigDict
from jaxpar.models.inventory import DTYPE_BYTES, ParallelLayout

F32 = 4  # bytes of what the step computes in fp32 whatever the compute dtype: scores, softmax, logits


@dataclasses.dataclass(frozen=True)
class Dims:
    """Per-device sizes of one microbatch through one layer."""

    e: int  # compute-dtype bytes
    b: int  # sequences per microbatch
    s: int  # tokens per sequence on this context rank
    so: float  # rows outside the tensor-parallel region: s / t with sequence parallelism, else s
    h: int
    q: float  # heads * head_dim / t
    k: float  # kv_heads * head_dim / t
    n: float  # heads / t
    f: float  # mlp_dim / t
    v: float  # vocab / t

    @classmethod
    def of(cls, model: ConfigDict, layout: ParallelLayout, b: int | None = None) -> Dims:
        t = layout.tensor
        s = layout.seq_len // layout.context
        return cls(
            DTYPE_BYTES[model.compute_dtype],
            layout.microbatch_size if b is None else b,
            s,
            s / t if layout.sequence_parallel else s,
            model.embed_dim,
            model.num_heads * model.head_dim / t,
            model.num_kv_heads * model.head_dim / t,
            model.num_heads / t,
            model.mlp_dim / t,
            model.vocab_size / t,
        )
