"""Draw scripts/bench.py's JSON: tokens/s and peak memory per layout (the scaling scenario, and ours against the
references of the data-parallel scenario), the bytes each layout sends per step, and on a GPU tokens/s and MFU.

    python scripts/plot_bench.py bench.json [--out bench.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", type=Path)
    p.add_argument("--out", type=Path, default=None, help="PNG path (default: next to the JSON)")
    args = p.parse_args(argv)
    data = json.loads(args.json.read_text())
    raw = data.get("raw", {})
    panels = []
    if "scaling" in raw:
        runs = raw["scaling"]
        labels = [r["form"] if r["form"] == "one process" else f"{r['form']}={r['procs']}"
                  + ("*" if r["oversubscribed"] else "") for r in runs]
        panels.append(("tokens/s by layout (scaling)", list(zip(labels, [r["tokens_per_s"] for r in runs])),
                       "tokens/s"))
        if all("peak_bytes" in r for r in runs):
            panels.append(("peak memory per rank by layout (scaling: the highest rank's peak resident set)",
                           list(zip(labels, [r["peak_bytes"] / 2**20 for r in runs])), "MiB"))
    if "dp" in raw:
        scen = raw["dp"]["scenarios"]
        tokens = raw["dp"]["tokens_per_step"]
        panels.append(("data parallel: ours and the references",
                       [(k, tokens / (s["step_ms_median"] / 1e3)) for k, s in scen.items() if s.get("step_ms_median")],
                       "tokens/s"))
        panels.append(("data parallel: peak memory of the highest rank above its start",
                       [(k, max(s["peak_bytes_per_rank"]) / 2**20) for k, s in scen.items()
                        if s.get("peak_bytes_per_rank")], "MiB"))
        panels.append(("bytes sent per step, rank 0",
                       [(k, sum(s["comm_bytes"].values()) / 2**20 if isinstance(s["comm_bytes"], dict)
                         else s["comm_bytes"] / 2**20) for k, s in scen.items() if s.get("comm_bytes")], "MiB"))
    for name, res in raw.get("gpu", {}).items():
        for model, r in res["results"].items():
            panels.append((f"{model} on {res['device']} ({res['dtype']}): tokens/s",
                           [(k, v["tokens_per_s"]) for k, v in r["models"].items()], "tokens/s"))
            panels.append((f"{model}: MFU against the measured {res['peak_flops'] / 1e12:.0f} TFLOP/s",
                           [(k, 100 * v["mfu"]) for k, v in r["models"].items() if v.get("mfu")], "%"))
    if not panels:
        p.error(f"{args.json}: no scaling or dp results to draw")
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.2 * len(panels)), squeeze=False)
    for ax, (title, bars, unit) in zip(axes[:, 0], panels):
        names, values = zip(*bars)
        ax.bar(range(len(values)), values, color="#4c72b0")
        ax.set_xticks(range(len(values)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(unit)
    fig.suptitle(f"dist_llm, torch {data.get('torch')}, {data.get('device')} ({data.get('cores')} cores), "
                 f"{data.get('date')}  (* oversubscribed)", fontsize=9)
    fig.tight_layout()
    out = args.out or args.json.with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
