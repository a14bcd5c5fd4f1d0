#!/usr/bin/env python3
"""Where one megamoe forward + backward spends its wall time, kernel by kernel.

Runs megamoe.moe forward + backward on one GPU under torch.profiler (CUPTI),
after warm-ups, --iters steps back to back, and prints each kernel's median
duration and median idle gap before it (with the last step's start times),
then the totals: span (kernels plus gaps), sum of kernel times, sum of gaps.
The gaps are what launch gaps and serialisation cost; they are the part
that programmatic dependent launch or fewer launches can win back. Two
libraries built with different options (MEGAMOE_LIBRARY) compare kernel by
kernel in the sequence a training step runs (scripts/device-timeline).

  python3 bench/kernel_timeline.py --preset qwen3-30b-a3b --tokens 16384 [--precision fp8] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO / "python"))  # after PYTHONPATH: a tree under test can bring its own
import megamoe  # noqa: E402
from megamoe.train import PRESETS  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp8", "fp8_bwd"),
                   help="the layer's recipe (FP8: the weights quantised once, then the layer's cache)")
    p.add_argument("--iters", type=int, default=10, help="profiled iterations (medians over them are printed)")
    p.add_argument("--json", help="write the kernels' medians here")
    p.add_argument("--sustained", type=int, default=150, metavar="STEPS",
                   help="also STEPS steps back to back with NVML's energy and SM clock (bench/gpu_power.py; 0: skip)")
    args = p.parse_args()
    if args.iters < 2:
        p.error("--iters: at least 2 (the first kernel's gap is measured after an earlier step)")

    cfg = PRESETS[args.preset]
    T, H, I, E, k = (args.tokens, cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"],
                     cfg["num_experts_per_tok"])
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    dy = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g)
    w13 = (torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16, generator=g) * H**-0.5).requires_grad_()
    w2 = (torch.randn(E, H, I, device=dev, dtype=torch.bfloat16, generator=g) * I**-0.5).requires_grad_()
    idx = torch.rand(T, E, device=dev, generator=g).topk(k, dim=1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(T, k, device=dev, generator=g), dim=1).requires_grad_()

    def step():
        for t in (x, w, w13, w2):
            t.grad = None
        megamoe.moe(x, idx, w, w13, w2, precision=args.precision).backward(dy)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    # The same step timed three ways, to split host cost from GPU cost:
    # back to back (the host runs ahead, as in training), each after a sync (the
    # GPU starts idle: host launch latency counts), and the host's own time to
    # queue one step (perf_counter around step() without a sync).

    def event_ms(sync_each: bool, n: int = 20) -> float:
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        times, host = [], []
        for i in range(n):
            if sync_each:
                torch.cuda.synchronize()
                a = torch.cuda.Event(enable_timing=True)
                a.record()
                h0 = time.perf_counter()
                step()
                host.append((time.perf_counter() - h0) * 1e3)
                ev[i + 1].record()
                ev[i + 1].synchronize()
                times.append(a.elapsed_time(ev[i + 1]))
            else:
                ev[i].record()
                step()
        if not sync_each:
            ev[n].record()
            torch.cuda.synchronize()
            times = [ev[i].elapsed_time(ev[i + 1]) for i in range(n)]
        return statistics.median(times), (statistics.median(host) if host else float("nan"))

    b2b, _ = event_ms(False)
    synced, host = event_ms(True)
    print(f"CUDA events, median of 20: back to back {b2b:.3f} ms   synced each {synced:.3f} ms   "
          f"host time to queue one step {host:.3f} ms")
    sus = None
    if args.sustained > 0:
        from gpu_power import describe, sustained
        try:
            sus = sustained(step, args.sustained, dev)
            print(f"sustained: {describe(sus)}")
        except (OSError, RuntimeError, AttributeError) as exc:
            print(f"sustained: NVML failed: {exc}", file=sys.stderr)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.iters):
            step()
        torch.cuda.synchronize()
    megamoe.check()

    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time > 0),
                     key=lambda e: e.time_range.start)
    # Each iteration launches the same kernels: split the list into args.iters
    # equal parts and take, kernel by kernel, the median duration and the
    # median idle gap before it (the first kernel's gap: after the previous
    # iteration's last). The last iteration's start times are printed.
    per = len(kernels) // args.iters
    if per * args.iters != len(kernels) or any(
            kernels[c * per + i].name != kernels[i].name for c in range(args.iters) for i in range(per)):
        print(f"kernel_timeline: the {args.iters} iterations did not launch the same kernels "
              f"({len(kernels)} in all)", file=sys.stderr)
        return 1
    t0 = kernels[-per].time_range.start

    def gap_before(j: int) -> float:
        return 0.0 if j == 0 else max(0.0, kernels[j].time_range.start - kernels[j - 1].time_range.end)

    rows = []
    print(f"{args.preset} T={T}: {per} kernels per forward + backward (medians of {args.iters} profiled)")
    print(f"{'#':>3} {'start us':>9} {'gap us':>7} {'dur us':>8}  kernel")
    for i in range(per):
        runs = [kernels[c * per + i].time_range for c in range(args.iters)]
        dur = statistics.median(r.end - r.start for r in runs)
        gap = statistics.median(gap_before(c * per + i) for c in range(1 if i == 0 else 0, args.iters))
        start = kernels[-per + i].time_range.start - t0
        rows.append({"name": kernels[i].name, "start_us": start, "dur_us": dur, "gap_us": gap})
        print(f"{i:3d} {start:9.1f} {gap:7.1f} {dur:8.1f}  {kernels[i].name[:90]}")
    busy = sum(r["dur_us"] for r in rows)
    gaps = sum(r["gap_us"] for r in rows)
    span = busy + gaps
    print(f"span {span:.1f} us (kernel medians + gap medians)   kernel sum {busy:.1f} us   "
          f"gaps {gaps:.1f} us ({100 * gaps / span:.1f}% of span)")
    if args.json:
        Path(args.json).write_text(json.dumps({"preset": args.preset, "tokens": T, "span_us": span,
                                               "back_to_back_ms": b2b, "synced_ms": synced, "host_ms": host,
                                               "kernel_sum_us": busy, "gaps_us": gaps, "sustained": sus,
                                               "kernels": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
