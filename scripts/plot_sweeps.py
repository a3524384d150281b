"""Latency against load for one or more aiperf sweeps, as a PNG: TTFT p99 and TPOT p99 (inter-token
latency) against concurrency, one line per endpoint, the SLOs as dashed lines. Reads aiperf's own
result files only. Runs in the load-test tool's environment (.venv-loadtest has matplotlib, which
pdstack's own environment does not need):

    .venv-loadtest/bin/python scripts/plot_sweeps.py --out sweep.png --ttft-slo 400 --tpot-slo 40 \\
        "pd=out/validation/chat-c1,out/validation/chat-c8" "colocated=out/compare/chat-c1,..."
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no screen
import matplotlib.pyplot as plt  # noqa: E402


def points(run_dirs: list[str]) -> list[tuple[int, float, float]]:
    out = []
    for run_dir in run_dirs:
        data = json.loads((Path(run_dir) / "profile_export_aiperf.json").read_text())
        concurrency = int(Path(run_dir).name.rsplit("-c", 1)[1])  # pdctl names each run <scenario>-c<concurrency>
        out.append((concurrency, data["time_to_first_token"]["p99"], data["inter_token_latency"]["p99"]))
    return sorted(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("series", nargs="+", help="LABEL=RUN_DIR,RUN_DIR,... (one aiperf run folder per concurrency)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--ttft-slo", type=float)
    parser.add_argument("--tpot-slo", type=float)
    parser.add_argument("--title", default="latency against load")
    args = parser.parse_args()
    fig, (ttft, tpot) = plt.subplots(1, 2, figsize=(10, 4), dpi=110)
    for spec in args.series:
        label, _, dirs = spec.partition("=")
        data = points(dirs.split(","))
        xs = [c for c, _, _ in data]
        ttft.plot(xs, [t for _, t, _ in data], marker="o", label=label)
        tpot.plot(xs, [i for _, _, i in data], marker="o", label=label)
    for axis, slo, name in ((ttft, args.ttft_slo, "TTFT p99 (ms)"), (tpot, args.tpot_slo, "TPOT p99 (ms)")):
        if slo:
            axis.axhline(slo, linestyle="--", color="grey", label=f"SLO {slo:g} ms")
        axis.set_xlabel("concurrency (requests in flight)")
        axis.set_ylabel(name)
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        axis.legend()
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
