"""Expert parallelism over the GPUs of one machine: megamoe's EP layer against the
TorchTitan-style pipeline (issue 11 point 6), forward + backward, same run.

    python3 bench/ep_compare.py --preset qwen3-30b-a3b --tokens 16384 --routing uniform --json ep.json

One process per GPU (spawned here); each rank holds --tokens tokens and E / P experts.
Backends, each timed in turn in the same processes (CUDA-event medians after warm-up,
the slowest rank's time):
  megamoe_ep        megamoe.moe(..., group=WORLD): dispatch, experts and combine on the device
  a2a_gmm_compile   TorchTitan's expert parallelism (bench/ep_baseline.py): NCCL
                    all_to_all_single of the route rows out and back around the
                    torch.compile'd grouped_mm pipeline of bench/compare_torch.py
  no_comm           the same per-GPU expert work without communication: megamoe on one GPU,
                    --tokens tokens routed over the E / P local experts
  a2a_sonicmoe      (--with-sonicmoe) the same NCCL all_to_all_single pipeline with SonicMoE as
                    the owner's expert compute (bench/ep_baseline.py's sonicmoe_experts); its
                    first call compiles SonicMoE's kernels for minutes (carry its DSL cache)
--precision fp8 / fp8_bwd (and --fp8-scale pow2) runs megamoe_ep and no_comm in that recipe (FP8 weights
cached, as in training); the a2a pipeline stays bf16, and y's check against it then takes FP8's bound.
Before timing, megamoe_ep's y is checked against a2a_gmm_compile's: 2e-2 in bf16; fp8 1e-1 (chained e4m3
GEMMs, docs/numerics.md), fp8_bwd (a bf16 forward) 2e-2.
torch.ops.symm_mem.all_to_all_vdev: bench/ep_vdev_probe.py (the dispatch and return exchanges alone).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))


def _routing(T, E, k, skewed, gen, device):
    bias = torch.zeros(E, device=device)
    if skewed:  # a few experts take most rows (lognormal popularity, sigma 2)
        bias = torch.randn(E, generator=gen, device=device) * 2.0
    u = torch.rand(T, E, generator=gen, device=device).clamp_min(1e-20)
    idx = (bias - torch.log(-torch.log(u))).topk(k, dim=1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(T, k, generator=gen, device=device), dim=1)
    return idx.contiguous(), w.contiguous()


def _median_ms(fn, warmup, iters, setup=None):
    import torch.distributed as dist
    times = []
    for i in range(warmup + iters):
        if setup is not None:
            setup()
        dist.barrier()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(stop))
    t = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank
    return float(t.item())


def _join(rank, world, init_file):
    """This process's GPU and its place in the NCCL group (one process per GPU, a file rendezvous)."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))


def _spawn(rank_main, args, world) -> dict:
    """rank_main(rank, world, args, init_file, out_file) in one process per GPU; rank 0's JSON result."""
    import tempfile

    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        mp.spawn(rank_main, args=(world, args, os.path.join(d, "init"), out), nprocs=world, join=True)
        return json.loads(Path(out).read_text())


def _rank_main(rank, world, args, init_file, out_file):
    import torch.distributed as dist

    import megamoe
    from ep_baseline import a2a_forward, compiled_grouped_mm, sonicmoe_experts
    from megamoe.train import PRESETS

    _join(rank, world, init_file)
    try:
        p = PRESETS[args.preset]
        H, I, E, k = p["hidden_size"], p["moe_intermediate_size"], p["num_experts"], p["num_experts_per_tok"]
        T, L, dev = args.tokens, E // world, torch.device("cuda", rank)
        if L < k:
            raise SystemExit(f"ep_compare: {L} experts per GPU < top_k {k}: the no-communication baseline needs "
                             f"k distinct local experts")
        gen = torch.Generator(device=dev).manual_seed(1000 + rank)
        x = (torch.rand(T, H, generator=gen, device=dev) * 2 - 1).to(torch.bfloat16)
        idx, w = _routing(T, E, k, args.routing == "skewed", gen, dev)
        local_idx, _ = _routing(T, L, k, args.routing == "skewed", gen, dev)
        w13 = (torch.randn(L, 2 * I, H, generator=gen, device=dev) * H ** -0.5).to(torch.bfloat16)
        w2 = (torch.randn(L, H, I, generator=gen, device=dev) * I ** -0.5).to(torch.bfloat16)
        dy = torch.randn(T, H, generator=gen, device=dev).to(torch.bfloat16)
        expert_fn = compiled_grouped_mm()
        sets = {}

        def prepare(name):  # fresh leaves, outside the timed region
            sets[name] = [t.detach().clone().requires_grad_() for t in (x, w, w13, w2)]

        def run(name):
            if name not in sets:
                prepare(name)
            xa, wa, w13a, w2a = sets.pop(name)
            recipe = {"precision": args.precision, "fp8_scale": args.fp8_scale}
            if name == "megamoe_ep":
                y = megamoe.moe(xa, idx, wa, w13a, w2a, group=dist.group.WORLD, max_tokens=T, **recipe)
            elif name == "a2a_gmm_compile":
                y = a2a_forward(xa, idx, wa, w13a, w2a, dist.group.WORLD, expert_fn)
            elif name == "a2a_sonicmoe":
                y = a2a_forward(xa, idx, wa, w13a, w2a, dist.group.WORLD, sonicmoe_experts)
            else:
                y = megamoe.moe(xa, local_idx, wa, w13a, w2a, **recipe)
            y.backward(dy)
            return y

        y_ep, y_a2a = run("megamoe_ep"), run("a2a_gmm_compile")
        err = ((y_ep.float() - y_a2a.float()).norm() / y_a2a.float().norm().clamp_min(1e-30)).item()
        results = {"preset": args.preset, "tokens_per_rank": T, "world": world, "routing": args.routing,
                   "precision": args.precision, "fp8_scale": args.fp8_scale, "y_rel_err_vs_a2a": err}
        if args.with_sonicmoe:  # checked against the compiled pipeline's y too (both bf16)
            y_sonic = run("a2a_sonicmoe")
            results["a2a_sonicmoe_rel_err_vs_a2a"] = (
                (y_sonic.float() - y_a2a.float()).norm() / y_a2a.float().norm().clamp_min(1e-30)).item()
        for name in _backends(args):
            results[name + "_ms"] = _median_ms(lambda: run(name), args.warmup, args.iters, lambda: prepare(name))
        megamoe.check()
        if rank == 0:
            Path(out_file).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _backends(args) -> tuple[str, ...]:
    return ("megamoe_ep", "a2a_gmm_compile", "no_comm") + (("a2a_sonicmoe",) if args.with_sonicmoe else ())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=16384, help="per rank")
    ap.add_argument("--routing", choices=("uniform", "skewed"), default="uniform")
    ap.add_argument("--precision", choices=("bf16", "fp8", "fp8_bwd"), default="bf16",
                    help="megamoe_ep's and no_comm's (the a2a pipeline is bf16)")
    ap.add_argument("--fp8-scale", choices=("fp32", "pow2"), default="fp32")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--with-sonicmoe", action="store_true",
                    help="also time a2a_sonicmoe (SonicMoE must be importable: scripts/install-sonicmoe)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.with_sonicmoe:
        import importlib.util
        if importlib.util.find_spec("sonicmoe") is None:
            print("ep_compare: --with-sonicmoe, but sonicmoe is not importable (source scripts/install-sonicmoe)",
                  file=sys.stderr)
            return 2
    world = torch.cuda.device_count()
    if world < 2:
        print(f"ep_compare: needs 2 or more GPUs, {world} visible", file=sys.stderr)
        return 2
    r = _spawn(_rank_main, args, world)
    print(f"ep_compare: {r['preset']}, {r['world']} GPUs, {r['tokens_per_rank']} tokens per GPU, {r['routing']} routing, "
          f"megamoe {r['precision']}{' pow2' if r['fp8_scale'] == 'pow2' else ''} "
          f"(fwd+bwd, slowest rank, medians of {args.iters})")
    print(f"megamoe_ep y vs a2a_gmm_compile: relative error {r['y_rel_err_vs_a2a']:.2e}")
    if args.with_sonicmoe:
        print(f"a2a_sonicmoe y vs a2a_gmm_compile: relative error {r['a2a_sonicmoe_rel_err_vs_a2a']:.2e}")
    base = r["megamoe_ep_ms"]
    for name in _backends(args):
        ms = r[name + "_ms"]
        print(f"  {name:<18} {ms:9.3f} ms   {ms / base:6.3f}x megamoe_ep")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    bound = 1e-1 if r["precision"] == "fp8" else 2e-2
    ok = r["y_rel_err_vs_a2a"] < bound and r.get("a2a_sonicmoe_rel_err_vs_a2a", 0.0) < 2e-2
    if not ok:
        print(f"ep_compare: megamoe_ep (bound {bound}, {r['precision']}) or a2a_sonicmoe (bound 2e-2) disagrees "
              f"with the compiled a2a pipeline", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
