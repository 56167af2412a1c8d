"""The planner alone, across scales: the best layout of LLaMA-2 7B / 13B / 70B and GPT-3 175B on
8 to 1024 A100 / H100 devices, its memory per device and the share of its step spent communicating.

For each (model, cluster, device count) :func:`jaxpar.analysis.plan.search_layouts` ranks every
layout that fits (90% of device memory) by estimated step time; the winner's peak memory per device,
communication share ((exposed TP + PP p2p + exposed data-axis time) / step time), bubble and MFU
are recorded. The global batch and sequence are the config's (1024 x 4096 for LLaMA-2, 1536 x 2048
for GPT-3), so the problem stays fixed while the devices grow (strong scaling). Nothing is
compiled: estimates only, in seconds.

    python experiments/plan_sweep.py -o experiments/results/<date>-plan-sweep
    python experiments/plan_sweep.py --quick        # 3 device counts, 2 models (a test's size)
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODELS = ("llama2_7b", "llama2_13b", "llama2_70b", "gpt3_175b")
CLUSTERS = ("a100-80g", "h100-80g")
DEVICES = (8, 16, 32, 64, 128, 256, 512, 1024)


def best_layouts(models=MODELS, clusters=CLUSTERS, devices=DEVICES) -> list[dict]:
    """One row per (model, cluster, devices): the planner's best layout, or why nothing fits."""
    sys.path.insert(0, str(ROOT))
    from jaxpar.analysis.clusters import GB, get_cluster
    from jaxpar.analysis.plan import PlanOptions, describe, search_layouts
    from jaxpar.config import ConfigError, load_config

    rows = []
    for name in models:
        cfg = load_config(str(ROOT / "configs" / f"{name}.py"))
        for cluster_name in clusters:
            cluster = get_cluster(cluster_name)
            for n in devices:
                row = {
                    "model": name,
                    "cluster": cluster_name,
                    "devices": n,
                    "global_batch": cfg.train.global_batch,
                    "seq_len": cfg.train.seq_len,
                }
                start = time.perf_counter()
                try:
                    est = search_layouts(
                        cfg.model, cluster, n, cfg.train.global_batch, cfg.train.seq_len, PlanOptions()
                    )[0]
                except ConfigError as e:
                    rows.append(row | {"fits": False, "why": str(e), "search_s": time.perf_counter() - start})
                    continue
                t = est.time
                comm = t.tensor_s + t.pipeline_s + t.data_exposed_s
                rows.append(
                    row
                    | {
                        "fits": True,
                        "layout": describe(est.layout),
                        **{
                            k: getattr(est.layout, k)
                            for k in (
                                "data",
                                "tensor",
                                "pipeline",
                                "context",
                                "virtual_stages",
                                "zero_stage",
                                "microbatches",
                                "recompute",
                                "sequence_parallel",
                            )
                        },
                        "memory_gb": est.memory.total_bytes / GB,
                        "step_s": est.step_time_s,
                        "comm_share": comm / t.step_s,
                        "tensor_share": t.tensor_s / t.step_s,
                        "pipeline_share": t.pipeline_s / t.step_s,
                        "data_exposed_share": t.data_exposed_s / t.step_s,
                        "bubble": t.bubble_fraction,
                        "mfu": est.mfu,
                        "search_s": time.perf_counter() - start,
                    }
                )
    return rows


def plot(rows: list[dict]):
    """Two panels over the device count (log 2): the best layout's memory per device, and its
    communication share; one line per model, solid A100, dashed H100."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 5.5), layout="constrained")
    axes = [fig.add_subplot(1, 2, k + 1) for k in range(2)]
    colors = dict(zip(MODELS, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    styles = dict(zip(CLUSTERS, ("-", "--")))
    for model in dict.fromkeys(r["model"] for r in rows):
        for cluster in dict.fromkeys(r["cluster"] for r in rows):
            sel = [r for r in rows if r["model"] == model and r["cluster"] == cluster and r["fits"]]
            if not sel:
                continue
            x = [r["devices"] for r in sel]
            kw = {
                "color": colors.get(model),
                "linestyle": styles.get(cluster, ":"),
                "marker": "o",
                "markersize": 3,
                "label": f"{model} {cluster}",
            }
            axes[0].plot(x, [r["memory_gb"] for r in sel], **kw)
            axes[1].plot(x, [100 * r["comm_share"] for r in sel], **kw)
    for ax, label, title in (
        (axes[0], "peak memory per device (GB), best layout", "memory per device"),
        (axes[1], "communication share of the step (%), best layout", "communication share"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices")
        ax.set_ylabel(label)
        ax.set_title(f"{title} vs devices (planner estimates)")
        ax.grid(alpha=0.3)
    axes[0].axhline(72, color="gray", lw=0.8, linestyle=":")  # the 90% budget of an 80 GB device
    axes[1].legend(fontsize=7, ncol=2)
    return fig


def write(rows: list[dict], out: str) -> dict[str, str]:
    os.makedirs(out, exist_ok=True)
    paths = {
        "csv": os.path.join(out, "plan_sweep.csv"),
        "json": os.path.join(out, "plan_sweep.json"),
        "png": os.path.join(out, "plan_sweep.png"),
    }
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    with open(paths["json"], "w") as f:
        json.dump(rows, f, indent=1)
    plot(rows).savefig(paths["png"], dpi=130)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default="runs/plan_sweep", help="output directory")
    parser.add_argument("--quick", action="store_true", help="2 models x 3 device counts")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = best_layouts(MODELS[:2], CLUSTERS, (8, 64, 512)) if args.quick else best_layouts()
    paths = write(rows, args.output)
    for r in rows:
        what = (
            f"{r['layout']}: {r['memory_gb']:.1f} GB, comm {r['comm_share']:.1%}, MFU {r['mfu']:.1%}"
            if r["fits"]
            else f"no fit ({r['why'][:90]})"
        )
        print(f"{r['model']:<11} {r['cluster']:<9} {r['devices']:>5}  {what}")
    print(f"{len(rows)} plans in {time.perf_counter() - start:.1f} s; {paths['png']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
