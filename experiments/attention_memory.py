"""Compiled temporaries of attention's forward + backward as the sequence grows: reference vs blockwise.

For s = 1024 .. 16384 it AOT-compiles ``value_and_grad`` of ``sum(attention(q, k, v) * w)`` for one
layer (b=1, fp32 by default, causal, on the default backend) and prints
``memory_analysis().temp_size_in_bytes`` of :func:`jaxpar.ops.attention.dot_product_attention`
(the (s, s) score matrix: x4 per doubling) and of
:func:`jaxpar.ops.attention.blockwise_attention` (O(s * d) residuals plus O(block**2) scores),
with each one's growth over the previous s. Nothing runs: compile only.

    python experiments/attention_memory.py            # seconds on 2 CPU cores
    python experiments/attention_memory.py --block 256 --heads 8 --kv-heads 2 --head-dim 64
"""

from __future__ import annotations

import argparse
import functools
import sys


def temp_bytes(fn, s: int, heads: int, kv_heads: int, head_dim: int, dtype) -> int:
    """Compiled temporaries of forward + backward of ``fn`` at sequence length ``s`` (b=1)."""
    import jax
    import jax.numpy as jnp

    q = jax.ShapeDtypeStruct((1, s, heads, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((1, s, kv_heads, head_dim), dtype)
    step = jax.jit(jax.value_and_grad(lambda q, k, v, w: jnp.sum(fn(q, k, v) * w), (0, 1, 2)))
    return step.lower(q, kv, kv, q).compile().memory_analysis().temp_size_in_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", type=int, default=512, help="block_q = block_kv of the blockwise path")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--max-seq", type=int, default=16384)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from jaxpar.ops.attention import blockwise_attention, dot_product_attention

    impls = {
        "dot_product": dot_product_attention,
        "blockwise": functools.partial(blockwise_attention, block_q=args.block, block_kv=args.block),
    }
    print(
        f"backend {jax.default_backend()}, b=1, n={args.heads}, kv={args.kv_heads}, d={args.head_dim}, "
        f"{args.dtype}, block {args.block}, causal, forward+backward temporaries (MiB)"
    )
    print(f"{'s':>6} " + " ".join(f"{name:>12} {'growth':>6}" for name in impls))
    prev: dict[str, float] = {}
    s = 1024
    while s <= args.max_seq:
        row = f"{s:>6} "
        for name, fn in impls.items():
            t = temp_bytes(fn, s, args.heads, args.kv_heads, args.head_dim, jnp.dtype(args.dtype)) / 2**20
            growth = f"x{t / prev[name]:.2f}" if name in prev else ""
            row += f"{t:>12.2f} {growth:>6} "
            prev[name] = t
        print(row.rstrip(), flush=True)
        s *= 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
