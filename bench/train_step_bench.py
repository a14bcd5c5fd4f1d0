"""End-to-end training-step benchmark: a Qwen3-30B-A3B-shaped model (fewer
layers) with activation checkpointing, the same data and initial weights for
every MoE dispatch type (mega_moe, grouped_mm, eager) in one process; prints
step time, tokens/s/GPU, peak memory and the first losses of each.

    python3 bench/train_step_bench.py --layers 8 --seq 4096 --batch 2 --steps 6
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from megamoe import train  # noqa: E402


def run(dispatch: str, args) -> dict:
    cfg = train.TrainConfig(preset=args.preset, num_layers=args.layers, steps=args.steps, batch_size=args.batch,
                            seq_len=args.seq, lr=args.lr, device="cuda", dtype="bfloat16",
                            activation_checkpointing=True, seed=args.seed, dispatch=dispatch, precision="bf16")
    train.validate(cfg)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = train.build_model(cfg, torch.device("cuda"))
    data = train.load_data(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    it = train.batches(data, cfg, torch.device("cuda"))
    base = torch.cuda.memory_allocated()
    losses, times = [], []
    steps = args.eager_steps if dispatch == "eager" else cfg.steps
    for _ in range(steps):
        inputs, labels = next(it)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = train.train_step(model, opt, inputs, labels)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.item())
    timed = times[1:] if len(times) > 1 else times  # the first step loads kernels and allocates
    ms = statistics.median(timed)
    out = {"dispatch": dispatch, "step_ms": ms, "tokens_per_s": cfg.batch_size * cfg.seq_len / (ms / 1e3),
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "model_gib": base / 2**30, "losses": losses}
    del model, opt
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--eager-steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dispatch", nargs="+", default=["mega_moe", "grouped_mm", "eager"])
    ap.add_argument("--json")
    args = ap.parse_args()
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}; "
          f"{args.preset} x {args.layers} layers, batch {args.batch} x seq {args.seq}, activation checkpointing on")
    results = []
    for d in args.dispatch:
        try:
            results.append(run(d, args))
        except Exception as e:  # keep the other rows
            results.append({"dispatch": d, "error": f"{type(e).__name__}: {e}"})
        print(json.dumps(results[-1]), flush=True)
    ref = next((r for r in results if r["dispatch"] == "grouped_mm" and "error" not in r), None)
    print(f"\n{'dispatch':<12}{'step ms':>10}{'tok/s/GPU':>12}{'peak GiB':>10}{'vs grouped_mm':>15}  first losses")
    for r in results:
        if "error" in r:
            print(f"{r['dispatch']:<12} ERROR {r['error']}")
            continue
        speed = f"{ref['step_ms'] / r['step_ms']:.2f}x" if ref else "-"
        print(f"{r['dispatch']:<12}{r['step_ms']:>10.1f}{r['tokens_per_s']:>12.0f}{r['peak_gib']:>10.2f}{speed:>15}  "
              + " ".join(f"{l:.4f}" for l in r["losses"][:3]))
    ok = [r for r in results if "error" not in r]
    if len(ok) > 1:
        n = min(len(r["losses"]) for r in ok)
        worst = max(abs(a["losses"][i] - b["losses"][i]) / abs(b["losses"][i])
                    for a in ok for b in ok for i in range(min(n, 3)))
        print(f"largest relative loss difference over the first steps: {worst:.2e} (bf16 noise is ~1e-2)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
