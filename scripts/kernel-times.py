#!/usr/bin/env python3
"""Per-kernel durations of one megamoe-bench iteration, tree beside tree.

Reads the CSVs that scripts/device-profile writes with KERNEL_TIMES=1 (Nsight
Compute, metric gpu__time_duration.sum, every launch of `--iters 1 --warmup 1`)
and prints the second half of each (the timed iteration), launch by launch,
with each later tree's ratio to the first.
--by-name: one row per kernel name (its launches summed, in order of first
appearance), for runs whose launch sequences differ (say fp8 against fp8_bwd,
whose forwards launch different kernels).
usage: kernel-times.py [--by-name] OLD.csv [OTHER.csv ...] NEW.csv  (any may be missing)
"""
import csv
import sys


MODES = {"0": "kGateUp", "1": "kDown", "2": "kDownGrad", "3": "kGateUpGrad", "4": "kWeightGrad"}


def launches(path):
    try:
        with open(path, newline="") as f:
            rows = [r for r in csv.DictReader(l for l in f if l.startswith('"'))]
    except OSError:
        return []
    out = []
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}[r["Metric Unit"]]
        us = float(r["Metric Value"].replace(",", "")) * scale
        full = r["Kernel Name"].split("(")[0] if not r["Kernel Name"].startswith("void (") else r["Kernel Name"]
        name = full.replace("void ", "").split("::")[-1]
        if name.startswith("grouped_gemm_kernel<"):  # <mode, pair[, hold]>
            args = name[len("grouped_gemm_kernel<"):].rstrip(">").split(",")
            name = "gemm " + MODES.get(args[0].strip(), args[0]) + (" pair" if args[1].strip() in ("1", "true") else "")
        out.append((name[:32], us))
    return out[len(out) // 2:]  # the timed half (the first is the warm-up)


by_name = "--by-name" in sys.argv[1:]
paths = [a for a in sys.argv[1:] if a != "--by-name"]
if len(paths) < 2:
    sys.exit(__doc__)
sides = [launches(p) for p in paths]
if by_name:  # same names in every side, in order of first appearance; launches summed
    order = list(dict.fromkeys(name for side in sides for name, _ in side))
    sides = [[(name, sum(t for k, t in side if k == name) if any(k == name for k, _ in side) else float("nan"))
              for name in order] for side in sides]
heads = [p.rsplit("/", 1)[-1].split("-")[1] if "-" in p.rsplit("/", 1)[-1] else f"tree{j}" for j, p in enumerate(paths)]
n = max(len(s) for s in sides)
print(f"{'#':>3} {'kernel':<32}" + "".join(f" {h + ' us':>9}" for h in heads) +
      "".join(f" {h + '/' + heads[0]:>9}" for h in heads[1:]))
nan = float("nan")
for i in range(n):
    row = [s[i] if i < len(s) else ("-", nan) for s in sides]
    name = next((r[0] for r in reversed(row) if r[0] != "-"), "-")
    base = row[0][1]
    print(f"{i:>3} {name:<32}" + "".join(f" {r[1]:>9.1f}" for r in row) +
          "".join(f" {r[1] / base if base else nan:>9.3f}" for r in row[1:]))
sums = [sum(t for _, t in s) for s in sides]
print(f"{'':>3} {'sum':<32}" + "".join(f" {t:>9.1f}" for t in sums) +
      "".join(f" {t / sums[0] if sums[0] else nan:>9.3f}" for t in sums[1:]))
