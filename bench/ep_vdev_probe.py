"""The route rows' exchanges of expert parallelism through torch.ops.symm_mem.all_to_all_vdev
(PyTorch's device-split all-to-all on symmetric memory), beside NCCL's all_to_all_single on
the same rows (issue 11 point 6: "also against all_to_all_vdev if it runs there").

    python3 bench/ep_vdev_probe.py --preset qwen3-30b-a3b --tokens 16384 --json vdev.json

One process per GPU. Each rank routes --tokens tokens over E experts (k each, as
bench/ep_compare.py), sorts its routes by destination rank (one row per route, as the
TorchTitan-style pipeline of bench/ep_baseline.py sends them) and times, CUDA-event medians
after warm-up, the slowest rank:
  dispatch  the route rows to their owners;
  return    the same number of rows back (the owners' outputs, here the received rows).
NCCL takes host split sizes (read once, outside the timing); all_to_all_vdev takes them on the
device. The vdev output is checked bitwise against NCCL's. When all_to_all_vdev cannot run here
(no NVSHMEM, no such op, an allocation refused) the JSON and the table say why; that is a
result, not a failure. megamoe's own exchanges: megamoe-ep-bench ("dispatch push alone",
"combine return alone").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from ep_compare import _join, _median_ms, _routing, _spawn  # noqa: E402  (as ep_compare does them)


def _route_rows(x, idx, L, world):
    """Route rows sorted by destination rank and the per-destination row counts."""
    k = idx.shape[1]
    flat = idx.reshape(-1).long()
    dest = torch.where(flat >= 0, flat // L, world)
    order = torch.argsort(dest, stable=True)
    counts = torch.bincount(dest, minlength=world + 1)[:world]
    n = int(counts.sum())
    return x[order[:n] // k].contiguous(), counts


def _vdev(send, counts, recv_want, out_counts, args, result):
    """all_to_all_vdev of `send` (rows by destination, counts [world] on the device) and back."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    if not hasattr(torch.ops.symm_mem, "all_to_all_vdev"):
        result["vdev_status"] = "unavailable: this PyTorch has no torch.ops.symm_mem.all_to_all_vdev"
        return
    is_nvshmem = getattr(symm_mem, "is_nvshmem_available", lambda: False)()
    if is_nvshmem and hasattr(symm_mem, "set_backend"):
        symm_mem.set_backend("NVSHMEM")
    result["vdev_backend"] = "NVSHMEM" if is_nvshmem else "default"
    world, H = dist.get_world_size(), send.shape[1]
    group_name = dist.group.WORLD.group_name
    rows_in = send.shape[0]
    rows_out = int(out_counts.sum())
    cap = max(rows_in, rows_out, 1)
    dev = send.device
    # Worst case sizes, as the op's own tests allocate them: a rank may receive from every peer.
    inp = symm_mem.empty(cap, H, dtype=send.dtype, device=dev)
    out = symm_mem.empty(world * cap, H, dtype=send.dtype, device=dev)
    back = symm_mem.empty(world * cap, H, dtype=send.dtype, device=dev)
    splits = symm_mem.empty(world, dtype=torch.int64, device=dev)
    back_splits = symm_mem.empty(world, dtype=torch.int64, device=dev)
    out_so = symm_mem.empty((2, world), dtype=torch.int64, device=dev)
    back_so = symm_mem.empty((2, world), dtype=torch.int64, device=dev)
    for t in (inp, out, back, splits, back_splits, out_so, back_so):
        symm_mem.rendezvous(t, group_name)
    inp[:rows_in].copy_(send)
    splits.copy_(counts)
    back_splits.copy_(out_counts)

    def dispatch():
        torch.ops.symm_mem.all_to_all_vdev(inp, out, splits, out_so, group_name)

    def ret():  # the received rows go back where they came from
        torch.ops.symm_mem.all_to_all_vdev(out, back, back_splits, back_so, group_name)

    dispatch()
    torch.cuda.synchronize()
    got = out[:rows_out]
    result["vdev_out_splits_match"] = bool(torch.equal(out_so[0].cpu(), out_counts.cpu()))
    result["vdev_rows_match_nccl"] = bool(torch.equal(got, recv_want))
    result["vdev_dispatch_ms"] = _median_ms(dispatch, args.warmup, args.iters)
    result["vdev_return_ms"] = _median_ms(ret, args.warmup, args.iters)
    result["vdev_status"] = "ran"


def _rank_main(rank, world, args, init_file, out_file):
    import torch.distributed as dist

    from megamoe.train import PRESETS

    _join(rank, world, init_file)
    try:
        p = PRESETS[args.preset]
        H, E, k = p["hidden_size"], p["num_experts"], p["num_experts_per_tok"]
        T, L, dev = args.tokens, E // world, torch.device("cuda", rank)
        gen = torch.Generator(device=dev).manual_seed(2000 + rank)
        x = (torch.rand(T, H, generator=gen, device=dev) * 2 - 1).to(torch.bfloat16)
        idx, _ = _routing(T, E, k, args.routing == "skewed", gen, dev)
        send, counts = _route_rows(x, idx, L, world)
        out_counts = torch.empty_like(counts)
        dist.all_to_all_single(out_counts, counts)
        in_splits, out_splits = counts.tolist(), out_counts.tolist()
        recv = send.new_empty(sum(out_splits), H)
        back = send.new_empty(send.shape[0], H)
        remote_rows = sum(c for d, c in enumerate(in_splits) if d != rank)
        result = {"preset": args.preset, "world": world, "tokens_per_rank": T, "routing": args.routing,
                  "rank0_remote_gb": remote_rows * H * 2 / 1e9}
        result["nccl_dispatch_ms"] = _median_ms(
            lambda: dist.all_to_all_single(recv, send, out_splits, in_splits), args.warmup, args.iters)
        result["nccl_return_ms"] = _median_ms(
            lambda: dist.all_to_all_single(back, recv, in_splits, out_splits), args.warmup, args.iters)
        try:
            _vdev(send, counts, recv, out_counts, args, result)
        except Exception as exc:  # noqa: BLE001 - why it cannot run here is the result
            result["vdev_status"] = f"failed: {type(exc).__name__}: {exc}".splitlines()[0][:400]
        if rank == 0:
            Path(out_file).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=16384, help="per rank")
    ap.add_argument("--routing", choices=("uniform", "skewed"), default="uniform")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    world = torch.cuda.device_count()
    if world < 2:
        print(f"ep_vdev_probe: needs 2 or more GPUs, {world} visible", file=sys.stderr)
        return 2
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", "8G")  # the worst-case buffers above, if NVSHMEM serves them
    r = _spawn(_rank_main, args, world)
    gb = r["rank0_remote_gb"]
    print(f"ep_vdev_probe: {r['preset']}, {r['world']} GPUs, {r['tokens_per_rank']} tokens per GPU, {r['routing']} "
          f"routing; one row per route; rank 0 sends {gb:.3f} GB to other ranks (slowest rank, medians of {args.iters})")
    rows = [("NCCL all_to_all_single", r["nccl_dispatch_ms"], r["nccl_return_ms"])]
    if r.get("vdev_status") == "ran":
        rows.append((f"all_to_all_vdev ({r['vdev_backend']})", r["vdev_dispatch_ms"], r["vdev_return_ms"]))
    for name, d_ms, r_ms in rows:
        print(f"  {name:<32} dispatch {d_ms:8.3f} ms ({gb / (d_ms / 1e3):6.1f} GB/s)   "
              f"return {r_ms:8.3f} ms ({gb / (r_ms / 1e3):6.1f} GB/s)")
    print(f"  all_to_all_vdev: {r.get('vdev_status')}"
          + (f"; rows equal NCCL's: {r['vdev_rows_match_nccl']}, splits: {r['vdev_out_splits_match']}"
             if r.get("vdev_status") == "ran" else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    ran = r.get("vdev_status") == "ran"
    return 1 if ran and not (r["vdev_rows_match_nccl"] and r["vdev_out_splits_match"]) else 0


if __name__ == "__main__":
    sys.exit(main())
