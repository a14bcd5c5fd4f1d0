#!/usr/bin/env python3
"""Where one megamoe forward + backward spends its wall time, kernel by kernel.

Runs megamoe.moe forward + backward on one GPU under torch.profiler (CUPTI),
after warm-ups, and prints each kernel of the last iteration with its start,
duration and the idle gap before it, then the totals: span (first kernel's
start to last kernel's end), sum of kernel times, sum of gaps. The span minus
the kernel sum is what launch gaps and serialisation cost; it is the part that
programmatic dependent launch or fewer launches can win back.

  python3 bench/kernel_timeline.py --preset qwen3-30b-a3b --tokens 16384 [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
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
    p.add_argument("--iters", type=int, default=3, help="profiled iterations (the last one is printed)")
    p.add_argument("--json", help="write the last iteration's kernels here")
    args = p.parse_args()

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
        megamoe.moe(x, idx, w, w13, w2, precision="bf16").backward(dy)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    # The same step timed three ways, to split host cost from GPU cost:
    # back to back (the host runs ahead, as in training), each after a sync (the
    # GPU starts idle: host launch latency counts), and the host's own time to
    # queue one step (perf_counter around step() without a sync).
    import statistics
    import time

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
    marks = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.iters):
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[-1].record()
            step()
        torch.cuda.synchronize()
    megamoe.check()

    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time > 0),
                     key=lambda e: e.time_range.start)
    # The last iteration: kernels after the last iteration's start, found as the
    # largest gap before it is not reliable; split the list into args.iters equal parts.
    per = len(kernels) // args.iters
    last = kernels[-per:]
    t0 = last[0].time_range.start
    rows, prev_end, busy = [], None, 0.0
    print(f"{args.preset} T={T}: {per} kernels per forward + backward (last of {args.iters} profiled)")
    print(f"{'#':>3} {'start us':>9} {'gap us':>7} {'dur us':>8}  kernel")
    for i, e in enumerate(last):
        start, end = e.time_range.start, e.time_range.end
        gap = 0.0 if prev_end is None else max(0.0, start - prev_end)
        busy += end - start
        rows.append({"name": e.name, "start_us": start - t0, "dur_us": end - start, "gap_us": gap})
        print(f"{i:3d} {start - t0:9.1f} {gap:7.1f} {end - start:8.1f}  {e.name[:90]}")
        prev_end = end if prev_end is None else max(prev_end, end)
    span = prev_end - t0
    gaps = sum(r["gap_us"] for r in rows)
    print(f"span {span:.1f} us   kernel sum {busy:.1f} us   gaps {gaps:.1f} us ({100 * gaps / span:.1f}% of span)")
    if args.json:
        Path(args.json).write_text(json.dumps({"preset": args.preset, "tokens": T, "span_us": span,
                                               "back_to_back_ms": b2b, "synced_ms": synced, "host_ms": host,
                                               "kernel_sum_us": busy, "gaps_us": gaps, "kernels": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
