#!/usr/bin/env python3
"""Per-kernel durations of one megamoe-bench iteration, old tree beside new.

Reads the CSVs that scripts/device-profile writes with KERNEL_TIMES=1 (Nsight
Compute, metric gpu__time_duration.sum, every launch of `--iters 1 --warmup 1`)
and prints the second half of each (the timed iteration), launch by launch.
usage: kernel-times.py OLD.csv NEW.csv  (either may be missing)
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


old, new = (launches(p) for p in sys.argv[1:3])
n = max(len(old), len(new))
print(f"{'#':>3} {'kernel':<32} {'old us':>9} {'new us':>9} {'new/old':>8}")
for i in range(n):
    o = old[i] if i < len(old) else ("-", float("nan"))
    w = new[i] if i < len(new) else ("-", float("nan"))
    name = w[0] if w[0] != "-" else o[0]
    print(f"{i:>3} {name:<32} {o[1]:>9.1f} {w[1]:>9.1f} {w[1] / o[1] if o[1] else float('nan'):>8.3f}")
so, sn = sum(t for _, t in old), sum(t for _, t in new)
print(f"{'':>3} {'sum':<32} {so:>9.1f} {sn:>9.1f} {sn / so if so else float('nan'):>8.3f}")
