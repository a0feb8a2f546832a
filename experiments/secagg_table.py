"""The SecAgg+ cost table of docs/results/secagg.md: ``fcl-emu bench secagg`` over N, K, D and dropout.

    python -m experiments.secagg_table --out runs/secagg-table            # the whole grid (about 20 min here)
    python -m experiments.secagg_table --out runs/secagg-table --quick    # D <= 1M only

Each point is one ``fcl-emu bench secagg`` run in its own process (JSON in ``--out``); the Markdown
table goes to stdout and to ``--out/table.md``. K is ``log`` (2 ceil(log2 N)) or ``n-1`` (SecAgg);
Flower's client is timed on the D = 1M points only (it is the slow part of a point). ``--page
docs/results/secagg.md`` also writes the table into its results page (``fcl_emu.page_blocks.write_table``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from experiments import add_page_options, check_page, publish

GRID = [  # (N, K, D, dropout, t); K None: logarithmic; t None: floor(K/2) + 1
    *[(10, k, d, p, None) for k in (None, 9) for d in (100_000, 1_000_000, 11_000_000) for p in (0.0, 0.3)],
    *[(100, k, d, p, None) for k in (None, 99) for d in (100_000, 1_000_000, 11_000_000) for p in (0.0, 0.3)],
    *[(300, None, d, p, None) for d in (100_000, 1_000_000, 11_000_000) for p in (0.0, 0.3)],
    (300, 299, 100_000, 0.0, None),
    # at 30 % dropout a majority threshold loses some client's secret: a lower t keeps the round
    (100, None, 1_000_000, 0.3, 5), (300, None, 1_000_000, 0.3, 6),
]


def run_point(n: int, k: int | None, d: int, p: float, t: int | None, out: Path) -> dict:
    path = out / (f"n{n}-k{k or 'log'}-d{d}-p{p}" + (f"-t{t}" if t else "") + ".json")
    if not path.exists():
        cmd = [sys.executable, "-m", "fcl_emu", "bench", "secagg", "--clients", str(n), "--dim", str(d),
               "--dropout", str(p), "--seed", "1", "--json", str(path)]
        if k is not None:
            cmd += ["--neighbors", str(k)]
        if t is not None:
            cmd += ["--threshold", str(t)]
        if d != 1_000_000:
            cmd += ["--no-flower"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(path.read_text())


def row(r: dict) -> str:
    phases = {x["phase"]: x for x in r["rows"]}
    order = ("advertise_keys", "share_keys", "masked_input", "unmasking")
    client = " / ".join(f"{phases[p]['client_median_ms']:.1f}" for p in order)
    server = " / ".join(f"{phases[p]['server_ms']:,.0f}" for p in order)
    up = sum(phases[p]["bytes_up"] for p in order) / r["clients"] / 1e6
    down = sum(phases[p]["bytes_down"] for p in order) / r["clients"] / 1e6
    flower = f"{r['speedup_vs_flower']:.1f}x" if "speedup_vs_flower" in r else "-"
    k = f"{r['neighbors']}" + (" (SecAgg)" if r["neighbors"] == r["clients"] - 1 else "")
    if r.get("threshold", r["neighbors"] // 2 + 1) != max(2, r["neighbors"] // 2 + 1):
        k += f", t = {r['threshold']}"
    status = "" if r["status"] == "ok" else " aborted"
    return (f"| {r['clients']} | {r['dim'] / 1e6:g}M | {k} | {r['dropout']:.0%} ({r['dropped']}){status} | {client} "
            f"| {server} | {up:.2f} / {down:.3f} | {r['ratio_masked_input_to_lower_bound']:.2f}x "
            f"({r['ratio_mask_to_lower_bound']:.2f}x) | {flower} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="only D <= 1M")
    add_page_options(parser)
    args = parser.parse_args()
    check_page(args, args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    lines = ["| N | D | K | dropout (dropped) | client ms, median: keys / shares / masked input / unmask "
             "| server ms: keys / shares / masked input / unmask | MB per client up / down "
             "| masked input / lower bound (masks only) | vs Flower |",
             "| ---: | ---: | --- | --- | --- | --- | --- | --- | --- |"]
    for n, k, d, p, t in GRID:
        if args.quick and d > 1_000_000:
            continue
        lines.append(row(run_point(n, k, d, p, t, args.out)))
        print(lines[-1], flush=True)
    publish(args, args.out, "\n".join(lines))


if __name__ == "__main__":
    main()
