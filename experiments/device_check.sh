#!/usr/bin/env bash
# The accelerator check, one short script for a lent GPU (docs/performance.md keeps its figures):
# the kernels (cuDNN attention, MoE grouped matmul) and the training benchmark on llama_1b with
# dot_product and with cudnn attention, and on a 1.6B-parameter Mixtral-shaped MoE (grouped dispatch).
# Each part has its own time limit, so one failure leaves the others' figures. Logs go to $OUT
# (or /tmp/device_check). Usage, from the repository root: bash experiments/device_check.sh
set -u
out=${OUT:-/tmp/device_check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi -L
python3 -c "import jax, flax, optax, orbax.checkpoint, ml_collections; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
part() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  echo "== $name rc=$? $((SECONDS - t0)) s"
  tail -n 1 "$out/$name.log"
}
part kernels 150 python3 experiments/gpu_kernels.py
part bench_dot 130 python3 experiments/bench_train.py --steps 30 --json
part bench_cudnn 130 python3 experiments/bench_train.py --steps 30 --json --config.model.attention=cudnn
part bench_moe 150 python3 experiments/bench_train.py --steps 30 --json --config configs/mixtral_8x7b.py \
  --config.mesh.expert=1 --config.model.num_layers=4 --config.model.embed_dim=2048 \
  --config.model.num_heads=16 --config.model.num_kv_heads=8 --config.model.head_dim=128 \
  --config.model.mlp_dim=7168 --config.parallel.recompute=selective --config.train.seq_len=2048 --config.data.path=
