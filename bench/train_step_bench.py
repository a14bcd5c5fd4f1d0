#!/usr/bin/env python3
"""End-to-end training-step benchmark: a Qwen3-MoE causal LM at a preset's layer
shapes (default Qwen3-30B-A3B, fewer layers), the same data and initial weights
for every MoE dispatch type, each (layers, checkpointing, dispatch) in its own
process (this script with --child), built and stepped by megamoe.train
(build_model, batches, train_step: the trainer's own step, not a copy).

  mega_moe            megamoe's experts (use_megamoe_experts)
  mega_moe_fp8        the same with precision "fp8" (opt-in; CUDA runs the FP8 layer)
  mega_moe_fp8_bwd    the same with precision "fp8_bwd" (opt-in)
  mega_moe_compile    megamoe's experts, every decoder layer under torch.compile
                      (trainer.compile; megamoe's ops opaque inside the graph)
  mega_moe_fp8_compile  the same with precision "fp8" (its FP8 weights cached once per
                      optimizer step, looked up inside megamoe's ops)
  grouped_mm          transformers' grouped_mm experts implementation, eager
  grouped_mm_compile  the same, every decoder layer under torch.compile (the trainer's
                      trainer.compile: one compiled graph reused by all layers)
  eager               transformers' per-expert loop (slow; opt-in)

Per row: median step ms, tokens/s, torch.cuda.max_memory_allocated, device
memory in use per the driver (torch.cuda.mem_get_info total - free, minus the
bare CUDA context) sampled after every step and right after every backward
(an optimizer step pre-hook, no sync), megamoe.memory_stats() for mega_moe.
Then the growth per added layer (memory at the most layers minus at the fewest,
divided by the layer difference) and mega_moe over the grouped_mm rows. Exit
status 1 when a row fails, is skipped, or its first loss differs from
grouped_mm's by more than the flag.

    python3 bench/train_step_bench.py                                   # layers 8,16 x ckpt on,off x 3 dispatch
    python3 bench/train_step_bench.py --layers 8 --checkpointing on --dispatch mega_moe,grouped_mm
    python3 bench/train_step_bench.py --device cpu --preset tiny --layers 1,2 --seq 64 --batch 2   # plumbing
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from megamoe import train  # noqa: E402
from child_runs import ChildRuns, finish_child  # noqa: E402  (bench/ is on sys.path when this script runs)

DISPATCHES = ("mega_moe", "grouped_mm", "grouped_mm_compile", "eager", "mega_moe_fp8", "mega_moe_fp8_bwd",
              "mega_moe_compile", "mega_moe_fp8_compile")
# megamoe dispatch rows in FP8
PRECISION_OF = {"mega_moe_fp8": "fp8", "mega_moe_fp8_bwd": "fp8_bwd", "mega_moe_fp8_compile": "fp8"}
# The trainer's dispatch of each row (the rest are their own); rows ending in _compile compile every decoder layer.
TRAINER_DISPATCH = {"grouped_mm_compile": "grouped_mm", "mega_moe_fp8": "mega_moe", "mega_moe_fp8_bwd": "mega_moe",
                    "mega_moe_compile": "mega_moe", "mega_moe_fp8_compile": "mega_moe"}
DEFAULT_DISPATCHES = ("mega_moe", "grouped_mm", "grouped_mm_compile")
LOSS_FLAG = 2e-2  # relative difference of the first step's loss vs grouped_mm that fails the run
GIB = float(1 << 30)


def log(msg: str):
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ child


def run_child(args) -> dict:
    dispatch, layers, ckpt = args.dispatch[0], args.layers[0], args.checkpointing == "on"
    res: dict[str, Any] = {"dispatch": dispatch, "layers": layers, "checkpointing": ckpt, "status": "error",
                           "error": None, "torch": torch.__version__}
    phase = "setup"
    try:
        cuda = args.device == "cuda"
        device = torch.device(args.device)
        if cuda:
            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA device (use --device cpu for a plumbing test)")
            device = torch.device("cuda", torch.cuda.current_device())
            torch.zeros(1, device=device)  # the CUDA context
            res["device_name"] = torch.cuda.get_device_name(device)

        def used() -> int:
            free, total = torch.cuda.mem_get_info(device)
            return total - free

        context = used() if cuda else 0
        import transformers

        res["transformers"] = transformers.__version__
        cfg = train.TrainConfig(preset=args.preset, num_layers=layers, steps=args.warmup + args.steps,
                                batch_size=args.batch, seq_len=args.seq, lr=args.lr, device=args.device,
                                dtype="bfloat16" if cuda else "float32", activation_checkpointing=ckpt,
                                compile=dispatch.endswith("_compile"),
                                seed=args.seed, precision=PRECISION_OF.get(dispatch, "bf16"),
                                dispatch=TRAINER_DISPATCH.get(dispatch, dispatch))
        train.validate(cfg)
        phase = "build"
        model = train.build_model(cfg, device)
        data = train.load_data(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        it = train.batches(data, cfg, device)
        res["params"] = sum(p.numel() for p in model.parameters())
        if cuda:
            torch.cuda.synchronize()
            res["after_build"] = {"alloc_bytes": torch.cuda.memory_allocated(device), "driver_bytes": used() - context}

        after_bwd: list[dict] = []

        def post_backward(_opt, _args, _kwargs):
            # Called by opt.step() inside train_step, right after loss.backward(). The
            # numbers are host-side (allocator bookkeeping, the driver's count), so no sync.
            if cuda:
                after_bwd.append({"alloc_bytes": torch.cuda.memory_allocated(device), "driver_bytes": used() - context})

        opt.register_step_pre_hook(post_backward)
        phase = "steps"
        warmup = args.eager_warmup if dispatch == "eager" else args.warmup
        steps = args.eager_steps if dispatch == "eager" else args.steps
        times, losses, after_step = [], [], []
        for _ in range(warmup + steps):
            inputs, labels = next(it)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = train.train_step(model, opt, inputs, labels)
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
            losses.append(loss.item())
            if cuda:
                after_step.append({"alloc_bytes": torch.cuda.memory_allocated(device),
                                   "driver_bytes": used() - context})
        timed = times[warmup:]
        ms = statistics.median(timed)
        res.update(step_ms=ms, step_ms_all=times, warmup=warmup, steps=steps, first_step_s=times[0] / 1e3,
                   tokens_per_s=cfg.batch_size * cfg.seq_len / (ms / 1e3), losses=losses,
                   after_step=after_step, after_backward=after_bwd)
        if cuda:
            samples = [s["driver_bytes"] for s in after_step + after_bwd]
            res["memory"] = {
                "max_memory_allocated_bytes": torch.cuda.max_memory_allocated(device),
                "max_memory_reserved_bytes": torch.cuda.max_memory_reserved(device),
                "driver_peak_bytes": max(samples),
                "driver_after_backward_bytes": max(s["driver_bytes"] for s in after_bwd) if after_bwd else None,
                "context_bytes": context,
            }
        if dispatch.startswith("mega_moe"):
            import megamoe

            stats = getattr(megamoe, "memory_stats", None)
            if stats is not None:
                res["megamoe_memory_stats"] = stats()
        if not all(math.isfinite(v) for v in losses):
            raise RuntimeError(f"non-finite loss: {losses}")
        res["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - the row says what failed
        res["error"] = f"{phase}: {type(exc).__name__}: {exc}".splitlines()[0][:400]
        res["traceback"] = traceback.format_exc()[-4000:]
        log(res["traceback"])
    return res


# ------------------------------------------------------------------ parent


def child_argv(args, layers: int, ckpt: str, dispatch: str, out_json: str) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--child", "--dispatch", dispatch, "--layers", str(layers),
            "--checkpointing", ckpt, "--json", out_json]
    for k in ("preset", "seq", "batch", "steps", "warmup", "eager_steps", "eager_warmup", "lr", "seed", "device"):
        argv += ["--" + k.replace("_", "-"), str(getattr(args, k))]
    return argv


def run_children(args, on_result) -> None:
    order = [(L, c, d) for L in args.layers for c in args.ckpt for d in args.dispatch]
    with ChildRuns("train_step_bench.", args.child_timeout, args.deadline, args.log) as runs:
        for layers, ckpt, dispatch in order:
            base = {"dispatch": dispatch, "layers": layers, "checkpointing": ckpt == "on", "status": "error"}
            on_result(runs.run(f"layers {layers}, ckpt {ckpt}, {dispatch}", base,
                               lambda out_json: child_argv(args, layers, ckpt, dispatch, out_json)))


def gib(v) -> str:
    return "-" if v is None else f"{v / GIB:.2f}"


def mem(r: dict, key: str):
    return (r.get("memory") or {}).get(key)


def row_line(r: dict) -> str:
    lead = f"{r['layers']:>6} {'on' if r['checkpointing'] else 'off':>4} {r['dispatch']:<19}"
    if r["status"] != "ok":
        return f"{lead} {r['status'].upper()}: {r['error']}"
    scratch = (r.get("megamoe_memory_stats") or {}).get("scratch_bytes")
    fp8 = (r.get("megamoe_memory_stats") or {}).get("fp8_weight_bytes")
    return (f"{lead} {r['step_ms']:9.1f} {r['tokens_per_s']:10.0f} {gib(mem(r, 'max_memory_allocated_bytes')):>9} "
            f"{gib(mem(r, 'driver_peak_bytes')):>9} {gib(mem(r, 'driver_after_backward_bytes')):>9} "
            f"{'-' if scratch is None else f'{scratch / 2**20:.0f}':>8} "
            f"{'-' if not fp8 else f'{fp8 / 2**20:.0f}':>8} {r['first_step_s']:7.1f}  "
            + " ".join(f"{v:.4f}" for v in r["losses"][:3]))


def ratios(r: dict, base: dict) -> list[str]:
    """Row r over row base: step time, then each memory figure both have."""
    parts = [f"step {r['step_ms'] / base['step_ms']:.3f}"]
    for key, name in (("max_memory_allocated_bytes", "alloc"), ("driver_peak_bytes", "drv")):
        if mem(r, key) and mem(base, key):
            parts.append(f"{name} {mem(r, key) / mem(base, key):.3f}")
    return parts


def report(args, results: list[dict]) -> list[str]:
    fails = []
    dev = next((r.get("device_name") for r in results if r.get("device_name")), args.device)
    tv = next((r.get("torch") for r in results if r.get("torch")), torch.__version__)
    tf = next((r.get("transformers") for r in results if r.get("transformers")), "?")
    print(f"\ntorch {tv}, transformers {tf}, {dev}; {args.preset}, batch {args.batch} x seq {args.seq}; "
          f"median of {args.steps} steps after {args.warmup} (eager {args.eager_steps} after {args.eager_warmup}); "
          "one process per row")
    print("alloc = torch.cuda.max_memory_allocated; drv = device memory in use per the driver minus the CUDA "
          "context, max over samples after every step and after every backward; drv bwd = max of the after-backward "
          "samples; scr = megamoe.memory_stats() scratch_bytes, fp8 = its fp8_weight_bytes (all layers' FP8 weights, "
          "inside drv). GiB unless MiB.\n")
    head = (f"{'layers':>6} {'ckpt':>4} {'dispatch':<19} {'step ms':>9} {'tok/s':>10} {'alloc':>9} {'drv':>9} "
            f"{'drv bwd':>9} {'scr MiB':>8} {'fp8 MiB':>8} {'first s':>7}  first losses")
    print(head)
    print("-" * len(head))
    for r in results:
        print(row_line(r))
        if r["status"] != "ok":
            fails.append(f"layers {r['layers']} ckpt {r['checkpointing']} {r['dispatch']}: {r['status']}: {r['error']}")
    ok = {(r["layers"], r["checkpointing"], r["dispatch"]): r for r in results if r["status"] == "ok"}

    # Growth per added layer, per (dispatch, ckpt).
    if len(args.layers) > 1:
        lo, hi = min(args.layers), max(args.layers)
        print(f"\nper added layer (layers {hi} minus {lo}, divided by {hi - lo}), GiB:")
        for c in args.ckpt:
            for d in args.dispatch:
                a, b = ok.get((lo, c == "on", d)), ok.get((hi, c == "on", d))
                if not (a and b):
                    continue
                parts = []
                for key, name in (("max_memory_allocated_bytes", "alloc"), ("driver_peak_bytes", "drv")):
                    if mem(a, key) is not None and mem(b, key) is not None:
                        parts.append(f"{name} {(mem(b, key) - mem(a, key)) / (hi - lo) / GIB:.3f}")
                parts.append(f"step {(b['step_ms'] - a['step_ms']) / (hi - lo):.1f} ms")
                print(f"  ckpt {c:<3} {d:<19} " + "  ".join(parts))

    # mega_moe (eager and compiled decoder layers) over each grouped_mm row, and the loss check.
    print("\nmega_moe / baseline (step time, alloc, drv; < 1 = mega_moe smaller):")
    for L in args.layers:
        for c in args.ckpt:
            ref = ok.get((L, c == "on", "grouped_mm"))
            for md in ("mega_moe", "mega_moe_compile"):
                m = ok.get((L, c == "on", md))
                for d in ("grouped_mm", "grouped_mm_compile"):
                    g = ok.get((L, c == "on", d))
                    if m and g:
                        print(f"  layers {L:<3} ckpt {c:<3} {md:<16} vs {d:<19} " + "  ".join(ratios(m, g)))
            if ref:
                for d in args.dispatch:
                    r = ok.get((L, c == "on", d))
                    if r and d != "grouped_mm":
                        diff = abs(r["losses"][0] - ref["losses"][0]) / abs(ref["losses"][0])
                        r["first_loss_rel_diff_vs_grouped_mm"] = diff
                        if diff > LOSS_FLAG:
                            fails.append(f"layers {L} ckpt {c} {d}: first loss {r['losses'][0]:.5f} vs grouped_mm "
                                         f"{ref['losses'][0]:.5f} (rel. diff {diff:.2e} > {LOSS_FLAG:g})")
    # The FP8 rows over megamoe's bf16 row (compiled over compiled).
    for L in args.layers:
        for c in args.ckpt:
            for d in PRECISION_OF:
                b16 = ok.get((L, c == "on", "mega_moe_compile" if d.endswith("_compile") else "mega_moe"))
                f8 = ok.get((L, c == "on", d))
                if b16 and f8:
                    parts = ratios(f8, b16)
                    parts[0] += f" (speed-up {b16['step_ms'] / f8['step_ms']:.2f}x)"
                    print(f"  layers {L:<3} ckpt {c:<3} {d} vs its bf16 row: " + "  ".join(parts))
    diffs = [r["first_loss_rel_diff_vs_grouped_mm"] for r in ok.values() if "first_loss_rel_diff_vs_grouped_mm" in r]
    if diffs:
        print(f"\nlargest relative difference of the first step's loss vs grouped_mm: {max(diffs):.2e} "
              f"(flag > {LOSS_FLAG:g}; same weights and data)")
    return fails


def csv_ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def csv_names(text: str) -> list[str]:
    out = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in out if t not in DISPATCHES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {','.join(DISPATCHES)}")
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(train.PRESETS))
    ap.add_argument("--layers", type=csv_ints, default=[8, 16], help="comma list (default 8,16)")
    ap.add_argument("--checkpointing", choices=["on", "off", "both"], default="both")
    ap.add_argument("--dispatch", type=csv_names, default=list(DEFAULT_DISPATCHES),
                    help=f"comma list of {','.join(DISPATCHES)} (default {','.join(DEFAULT_DISPATCHES)})")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (compile, allocation)")
    ap.add_argument("--eager-steps", type=int, default=2)
    ap.add_argument("--eager-warmup", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--child-timeout", type=float, default=300.0, help="seconds per child process")
    ap.add_argument("--deadline", type=float, default=0.0,
                    help="seconds for the whole run: later rows are skipped (reported, exit 1), not started")
    ap.add_argument("--log", metavar="PATH", help="append every child's output here")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        if args.checkpointing == "both" or len(args.layers) != 1 or len(args.dispatch) != 1 or not args.json:
            ap.error("--child needs one --layers, one --dispatch, --checkpointing on|off and --json")
    args.ckpt = ["on", "off"] if args.checkpointing == "both" else [args.checkpointing]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return finish_child(run_child(args), args.json)
    # The parent never touches the GPU: its CUDA context would count in every child's driver numbers.
    t0 = time.monotonic()
    results: list[dict] = []

    def on_result(r):
        results.append(r)
        print(row_line(r), file=sys.stderr, flush=True)

    run_children(args, on_result)
    fails = report(args, results)
    print(f"\n{len(results)} rows in {time.monotonic() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": results, "failures": fails}, indent=1))
    if fails:
        print("\nFAILED:\n  " + "\n  ".join(fails))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
