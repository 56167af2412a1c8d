"""The GPU kernels jaxpar leans on, checked and timed on one device: cuDNN attention and MoE grouped matmuls.

**Attention.** For each shape (b, s, heads, kv heads, head dim) in bf16, causal, it runs the forward
and forward + backward of :func:`jaxpar.ops.attention.cudnn_attention` (``model.attention=cudnn``),
:func:`~jaxpar.ops.attention.blockwise_attention` (512 x 512 blocks, ``blockwise``) and
:func:`~jaxpar.ops.attention.dot_product_attention` (``dot_product``) and prints each one's median
time, its TFLOP/s and its largest error against an fp32 ``dot_product`` reference (output and the
query gradient, relative to the reference's largest entry). FLOPs count the causal half of the
score and value matmuls, ``2 * 2 * b * s**2 * heads * d / 2`` forward, and 2.5x that backward
(FlashAttention-2's count, Dao 2023, section 4).

**MoE grouped matmul.** One MoE feed-forward (``expert_mlp`` of :mod:`jaxpar.models.moe`) at a
Mixtral-8x7B layer's width (h 4096, expert width 14336, 8 experts, top-2, Jiang et al. 2024) on
``tokens`` tokens with random routing, in bf16: the grouped dispatch (``jax.lax.ragged_dot`` over
the routed rows, ``model.moe_dispatch=grouped``) against the dense one-hot dispatch (every expert on
every token, ``dense``), forward and forward + backward; TFLOP/s count the routed work,
``2 * 3 * tokens * k * h * f`` forward and 2x that backward, so the dense path's figure is its
useful rate (it does E/k times that work). A plain ``dot`` with the routed work's shape (the
tokens split evenly over the experts, one batched matmul) is the bar a grouped GEMM would reach.

    python experiments/gpu_kernels.py            # one GPU, about a minute
    python experiments/gpu_kernels.py --quick    # small shapes on CPU (cuDNN skipped): a smoke run

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def timed(fn, *args, repeats: int = 10, warmup: int = 3) -> float:
    """Median seconds of ``fn(*args)`` over ``repeats`` runs after ``warmup`` (compile included there)."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def relative_error(x, ref) -> float:
    import jax.numpy as jnp

    x, ref = jnp.asarray(x, jnp.float32), jnp.asarray(ref, jnp.float32)
    return float(jnp.max(jnp.abs(x - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30))


def attention_rows(shapes, on_gpu: bool, repeats: int) -> list[dict]:
    import functools

    import jax
    import jax.numpy as jnp

    from jaxpar.ops import attention as A

    impls = {
        "dot_product": A.dot_product_attention,
        "blockwise": functools.partial(A.blockwise_attention, block_q=512, block_kv=512),
    }
    if on_gpu:
        impls["cudnn"] = A.cudnn_attention
    rows = []
    for b, s, n, kv, d in shapes:
        keys = jax.random.split(jax.random.key(0), 4)
        q = jax.random.normal(keys[0], (b, s, n, d), jnp.float32)
        k = jax.random.normal(keys[1], (b, s, kv, d), jnp.float32)
        v = jax.random.normal(keys[2], (b, s, kv, d), jnp.float32)
        w = jax.random.normal(keys[3], (b, s, n, d), jnp.float32)

        def loss(fn, q, k, v, w=w):
            return jnp.sum(fn(q, k, v).astype(jnp.float32) * w)

        ref_out = jax.jit(A.dot_product_attention)(q, k, v)
        ref_dq = jax.jit(jax.grad(functools.partial(loss, A.dot_product_attention)))(q, k, v)
        qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
        fwd_flops = 2 * 2 * b * s * s * n * d / 2
        for name, fn in impls.items():
            row = {"b": b, "s": s, "heads": n, "kv_heads": kv, "head_dim": d, "impl": name}
            try:
                fwd = jax.jit(fn)
                both = jax.jit(jax.value_and_grad(functools.partial(loss, fn), argnums=(0, 1, 2)))
                row["fwd_ms"] = 1e3 * timed(fwd, qb, kb, vb, repeats=repeats)
                row["fwd_bwd_ms"] = 1e3 * timed(both, qb, kb, vb, repeats=repeats)
                row["fwd_tflops"] = fwd_flops / row["fwd_ms"] / 1e9
                row["fwd_bwd_tflops"] = 3.5 * fwd_flops / row["fwd_bwd_ms"] / 1e9
                row["out_error"] = relative_error(fwd(qb, kb, vb), ref_out)
                row["dq_error"] = relative_error(both(qb, kb, vb)[1][0], ref_dq)
            except Exception as e:  # an implementation that fails on this shape is a result, not a crash
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def moe_rows(tokens: int, h: int, f: int, experts: int, k: int, repeats: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jaxpar.models.moe import MoeSettings, expert_mlp, route

    keys = jax.random.split(jax.random.key(1), 5)
    x = jax.random.normal(keys[0], (tokens, h), jnp.float32)
    scale = h**-0.5
    p = {
        "w_gate": (jax.random.normal(keys[1], (experts, h, f)) * scale).astype(jnp.bfloat16),
        "w_up": (jax.random.normal(keys[2], (experts, h, f)) * scale).astype(jnp.bfloat16),
        "w_down": (jax.random.normal(keys[3], (experts, f, h)) * f**-0.5).astype(jnp.bfloat16),
    }
    logits = jax.random.normal(keys[4], (tokens, experts), jnp.float32)
    base = MoeSettings(num_experts=experts, top_k=k)
    weights, choice, _ = route(logits, base)
    routed_fwd = 2 * 3 * tokens * k * h * f
    rows, outs = [], {}
    for dispatch in ("grouped", "dense"):
        s = MoeSettings(num_experts=experts, top_k=k, dispatch=dispatch)

        def layer(x, p, s=s):
            return expert_mlp(x, weights, choice, p, s, jnp.bfloat16)

        def loss(x, p, layer=layer):
            return jnp.sum(layer(x, p).astype(jnp.float32))

        fwd = jax.jit(layer)
        both = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        row = {"tokens": tokens, "h": h, "f": f, "experts": experts, "top_k": k, "dispatch": dispatch}
        try:
            row["fwd_ms"] = 1e3 * timed(fwd, x, p, repeats=repeats)
            row["fwd_bwd_ms"] = 1e3 * timed(both, x, p, repeats=repeats)
            row["fwd_routed_tflops"] = routed_fwd / row["fwd_ms"] / 1e9
            row["fwd_bwd_routed_tflops"] = 3 * routed_fwd / row["fwd_bwd_ms"] / 1e9
            outs[dispatch] = fwd(x, p)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    if len(outs) == 2:
        rows[0]["grouped_vs_dense_error"] = relative_error(outs["grouped"], outs["dense"])
    # The bar: the same routed work as one batched matmul, tokens split evenly over the experts.
    per = tokens * k // experts
    xs = jnp.zeros((experts, per, h), jnp.bfloat16)

    def even(xs, p):
        act = jax.nn.silu(jnp.einsum("eth,ehf->etf", xs, p["w_gate"])) * jnp.einsum("eth,ehf->etf", xs, p["w_up"])
        return jnp.einsum("etf,efh->eth", act, p["w_down"])

    row = {"tokens": tokens, "h": h, "f": f, "experts": experts, "top_k": k, "dispatch": "even_batched_dot"}
    row["fwd_ms"] = 1e3 * timed(jax.jit(even), xs, p, repeats=repeats)
    row["fwd_routed_tflops"] = routed_fwd / row["fwd_ms"] / 1e9
    rows.append(row)
    print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes on the default backend (CPU smoke run)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens through the MoE layer")
    args = parser.parse_args(argv)

    import jax

    dev = jax.devices()[0]
    on_gpu = dev.platform == "gpu"
    if args.quick:
        shapes = [(1, 256, 4, 2, 32)]
        moe = dict(tokens=256, h=64, f=128, experts=8, k=2)
    else:
        shapes = [(4, 2048, 32, 8, 64), (1, 8192, 32, 8, 128)]  # llama_1b's attention; a long 8B-like one
        moe = dict(tokens=args.tokens, h=4096, f=14336, experts=8, k=2)
    summary = {
        "platform": dev.platform,
        "device_kind": dev.device_kind,
        "jax": jax.__version__,
        "attention": attention_rows(shapes, on_gpu, args.repeats),
        "moe": moe_rows(repeats=args.repeats, **moe),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
