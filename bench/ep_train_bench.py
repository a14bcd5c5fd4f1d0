#!/usr/bin/env python3
"""Training step with expert parallelism over every GPU of one machine (issue 11
point 6; issue 13 at P = 8): megamoe's EP (megamoe.train's own model and step with
ep = P) against the TorchTitan-style EP baseline (bench/ep_baseline.py: NCCL
all-to-all around the compiled grouped_mm experts), the same model, data, seed
and global batch. Each backend runs in its own set of processes, one per GPU,
one backend after the other; non-expert parameters are data-parallel (DDP) in
both, the experts sharded E / P per rank.

Per backend: median step ms after the warm-up steps (host clock, synced around
each step, as the trainer logs it), tokens/s per GPU, the first and last loss
(the global batch's mean), torch.cuda.max_memory_allocated and the device memory
in use per the driver (mem_get_info, minus the bare CUDA context), the maximum
over ranks.

    python3 bench/ep_train_bench.py --config configs/qwen3-30b-a3b-ep2.toml --steps 12 --json ep-train.json
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

BACKENDS = ("mega_moe", "a2a_grouped_mm")
GIB = float(1 << 30)


def _rank_main(rank, world, args, backend, init_file, out_file):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from megamoe import train

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world, device_id=device)
    try:
        free, total = torch.cuda.mem_get_info(device)
        context = total - free  # the CUDA context and NCCL's buffers before any model
        cfg = train.load_config(args.config)
        cfg.steps = args.steps
        group = dist.group.WORLD
        if backend == "mega_moe":
            cfg.dispatch, cfg.ep = "mega_moe", world
            train.validate(cfg)
            model = train.build_model(cfg, device, group)
            experts = [p for _, p in train._expert_parameters(model)]
        else:
            from ep_baseline import use_a2a_experts
            base = copy.copy(cfg)
            base.dispatch, base.ep, base.precision = "grouped_mm", 1, "bf16"  # built whole, then sharded here
            train.validate(base)
            model = train.build_model(base, device)
            experts = use_a2a_experts(model, group)
        expert_ids = {id(p) for p in experts}
        DDP._set_params_and_buffers_to_ignore_for_model(
            model, [n for n, p in model.named_parameters() if id(p) in expert_ids])
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        model = DDP(model, device_ids=[rank])
        it = train.batches(train.load_data(cfg), cfg, device, rank, world)
        steps, losses, driver_peak = [], [], 0
        for step in range(cfg.steps):
            inputs, labels = next(it)
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            loss = train.train_step(model, opt, inputs, labels, experts, world)
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
            losses.append(loss.item())
            steps.append((time.perf_counter() - t0) * 1e3)
            free, total = torch.cuda.mem_get_info(device)
            driver_peak = max(driver_peak, total - free - context)
        ms = statistics.median(steps[args.warmup:])
        mem = torch.tensor([torch.cuda.max_memory_allocated(device), driver_peak], dtype=torch.float64, device=device)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        t = torch.tensor([ms], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's median
        if rank == 0:
            tokens = cfg.batch_size * cfg.seq_len // world
            Path(out_file).write_text(json.dumps({
                "backend": backend, "world": world, "preset": cfg.preset, "layers": cfg.num_layers,
                "tokens_per_gpu": tokens, "checkpointing": cfg.activation_checkpointing, "step_ms": t.item(),
                "tokens_per_s_per_gpu": tokens / (t.item() / 1e3), "first_loss": losses[0], "last_loss": losses[-1],
                "peak_alloc_bytes": mem[0].item(), "driver_peak_bytes": mem[1].item(), "step_ms_all": steps}))
    finally:
        dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs/qwen3-30b-a3b-ep2.toml"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4, help="steps left out of the median (compiles, allocator)")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    world = torch.cuda.device_count()
    if world < 2:
        print(f"ep_train_bench: needs 2 or more GPUs, {world} visible", file=sys.stderr)
        return 2
    if args.steps <= args.warmup:
        print("ep_train_bench: --steps must exceed --warmup", file=sys.stderr)
        return 2
    import torch.multiprocessing as mp
    rows = []
    for backend in args.backends.split(","):
        if backend not in BACKENDS:
            print(f"ep_train_bench: unknown backend {backend!r} ({', '.join(BACKENDS)})", file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "result.json")
            mp.spawn(_rank_main, args=(world, args, backend, os.path.join(d, "init"), out), nprocs=world, join=True)
            rows.append(json.loads(Path(out).read_text()))
    r0 = rows[0]
    print(f"ep_train_bench: {r0['preset']} x {r0['layers']} layers, {world} GPUs, {r0['tokens_per_gpu']} tokens per GPU, "
          f"checkpointing {r0['checkpointing']} (median of {args.steps - args.warmup} steps after {args.warmup})")
    print(f"  {'backend':<16} {'step ms':>9} {'tok/s/GPU':>10} {'first loss':>10} {'last loss':>10} "
          f"{'alloc GiB':>9} {'driver GiB':>10}")
    for r in rows:
        print(f"  {r['backend']:<16} {r['step_ms']:9.1f} {r['tokens_per_s_per_gpu']:10.0f} {r['first_loss']:10.4f} "
              f"{r['last_loss']:10.4f} {r['peak_alloc_bytes'] / GIB:9.2f} {r['driver_peak_bytes'] / GIB:10.2f}")
    if len(rows) == 2:
        a, b = rows
        print(f"  {a['backend']} takes {a['step_ms'] / b['step_ms']:.3f}x the step time of {b['backend']}, "
              f"{a['driver_peak_bytes'] / b['driver_peak_bytes']:.3f}x its device memory")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    # The same weights and data: the first losses must agree (bf16 tolerance).
    ok = all(abs(r["first_loss"] - r0["first_loss"]) <= 2e-2 * abs(r0["first_loss"]) for r in rows)
    if not ok:
        print("ep_train_bench: the backends' first losses disagree beyond 2%", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
