"""Device memory of a training step, each configuration in its own process.

For every (layers, activation checkpointing, dispatch) a fresh Python process
builds the Qwen3-30B-A3B-shaped model (megamoe.train's model and train_step),
runs a few steps and reports:
  driver_used_gib  total - free from torch.cuda.mem_get_info after the steps
                   (CUDA context + PyTorch's reserved pool, megamoe's scratch
                   and saved state included: they are PyTorch tensors now)
  peak_alloc_gib   torch.cuda.max_memory_allocated
  step_ms          median step time after the first step
and prints the growth per added layer between the smallest and largest layer
count, per dispatch and checkpointing setting.

    python3 bench/memory_bench.py --layers 8 16 --checkpointing both --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(args) -> dict:
    sys.path.insert(0, str(ROOT / "python"))
    import torch

    from megamoe import train

    cfg = train.TrainConfig(preset=args.preset, num_layers=args.layers[0], steps=args.steps, batch_size=args.batch,
                            seq_len=args.seq, lr=1e-4, device="cuda", dtype="bfloat16",
                            activation_checkpointing=args.ckpt == "on", seed=0, dispatch=args.dispatch[0],
                            precision="bf16")
    train.validate(cfg)
    model = train.build_model(cfg, torch.device("cuda"))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    it = train.batches(train.load_data(cfg), cfg, torch.device("cuda"))
    free, total = torch.cuda.mem_get_info()
    model_used = total - free
    times, losses, used = [], [], []
    for _ in range(cfg.steps):
        inputs, labels = next(it)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = train.train_step(model, opt, inputs, labels)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.item())
        free, total = torch.cuda.mem_get_info()
        used.append(total - free)
    out = {"dispatch": cfg.dispatch, "layers": cfg.num_layers, "checkpointing": args.ckpt,
           "step_ms": statistics.median(times[1:] if len(times) > 1 else times),
           "driver_used_gib": max(used) / 2**30, "after_model_gib": model_used / 2**30,
           "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30,
           "reserved_gib": torch.cuda.max_memory_reserved() / 2**30, "losses": losses}
    if cfg.dispatch == "mega_moe":
        import megamoe
        out["megamoe_scratch_gib"] = megamoe.memory_stats()["scratch_bytes"] / 2**30
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--checkpointing", choices=["on", "off", "both"], default="both")
    ap.add_argument("--dispatch", nargs="+", default=["mega_moe", "grouped_mm"])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json")
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)     # child mode
    args = ap.parse_args()
    if args.ckpt:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    ckpts = ["on", "off"] if args.checkpointing == "both" else [args.checkpointing]
    rows = []
    for layers in args.layers:
        for ckpt in ckpts:
            for dispatch in args.dispatch:
                cmd = [sys.executable, __file__, "--preset", args.preset, "--layers", str(layers), "--dispatch",
                       dispatch, "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
                       "--ckpt", ckpt]
                r = subprocess.run(cmd, capture_output=True, text=True)
                line = next((l for l in r.stdout.splitlines() if l.startswith("RESULT ")), None)
                row = json.loads(line[7:]) if line else {
                    "dispatch": dispatch, "layers": layers, "checkpointing": ckpt,
                    "error": (r.stderr.strip().splitlines() or ["no output"])[-1]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{args.preset}, batch {args.batch} x seq {args.seq}, each row a fresh process")
    print(f"{'layers':>6} {'ckpt':>4} {'dispatch':<11}{'driver GiB':>11}{'peak alloc':>11}{'step ms':>9}{'vs grouped_mm':>14}")
    for r in rows:
        if "error" in r:
            print(f"{r['layers']:>6} {r['checkpointing']:>4} {r['dispatch']:<11} ERROR {r['error']}")
            continue
        ref = next((q for q in rows if q["dispatch"] == "grouped_mm" and q["layers"] == r["layers"]
                    and q["checkpointing"] == r["checkpointing"] and "error" not in q), None)
        ratio = f"{r['driver_used_gib'] / ref['driver_used_gib']:.3f} mem" if ref else "-"
        print(f"{r['layers']:>6} {r['checkpointing']:>4} {r['dispatch']:<11}{r['driver_used_gib']:>11.2f}"
              f"{r['peak_alloc_gib']:>11.2f}{r['step_ms']:>9.1f}{ratio:>14}")
    lo, hi = min(args.layers), max(args.layers)
    if hi > lo:
        print(f"\ngrowth per added layer ({lo} -> {hi} layers), driver view:")
        for ckpt in ckpts:
            for dispatch in args.dispatch:
                a = next((q for q in rows if (q["dispatch"], q["layers"], q["checkpointing"]) == (dispatch, lo, ckpt)
                          and "error" not in q), None)
                b = next((q for q in rows if (q["dispatch"], q["layers"], q["checkpointing"]) == (dispatch, hi, ckpt)
                          and "error" not in q), None)
                if a and b:
                    print(f"  ckpt {ckpt:>3} {dispatch:<11} {(b['driver_used_gib'] - a['driver_used_gib']) / (hi - lo):.3f}"
                          f" GiB/layer")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
