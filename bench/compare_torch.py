#!/usr/bin/env python3
"""megamoe against the strongest MoE baselines: one Qwen3-MoE layer, one GPU.

Times forward, backward and forward+backward (bf16) for these backends:
  megamoe             megamoe.moe (the package's custom op with autograd)
  grouped_mm          the TorchTitan pipeline: sort by expert, torch._grouped_mm, autograd (eager)
  grouped_mm_compile  the same pipeline under torch.compile (its backward compiled by AOTAutograd)
  sonicmoe            SonicMoE's moe_general_routing_inputs, when importable
  hf_eager            the Hugging Face per-expert loop (opt-in: --backends ...,hf_eager)
FP8 rows (opt-in; issue 12), compared among themselves ("vs best" = the
fastest FP8 baseline) and checked against fp64 with the FP8 flag:
  megamoe_fp8         megamoe.moe(precision="fp8")   (weights cached between calls)
  megamoe_fp8_bwd     megamoe.moe(precision="fp8_bwd")
  scaled_grouped_mm   the grouped_mm pipeline with every GEMM in e4m3 through
                      torch._scaled_grouped_mm, forward and backward (bench/fp8_grouped_mm.py)
  scaled_grouped_mm_compile  the same under torch.compile

Each (backend, shape) runs in its own process (this script with --backend), so
memory is measured alone: torch.cuda.max_memory_allocated and device memory
in use as the driver reports it (torch.cuda.mem_get_info: total - free). The
parent collects the children's JSON and prints one table: median ms per phase,
TFLOPS, % of peak, "vs best" (the fastest of grouped_mm, grouped_mm_compile and
sonicmoe, divided by this row's time; > 1 = faster than every baseline) and
memory. Every row's outputs (y, dx, d_topk_w, dw13, dw2) are checked against
an fp64 reference of the same inputs; an error above the flag, a failed
backend or a skipped row makes the exit status 1.

Math, per route (t, j) with e = topk_idx[t, j] (-1 = no route, dropped):
  z = w13[e] @ x[t];  a = silu(z[:I]) * z[I:];  y[t] += topk_w[t, j] * (w2[e] @ a)

  python3 bench/compare_torch.py                       # --all: 30B and 235B at 16384 tokens, every backend
  python3 bench/compare_torch.py --quick               # 30B only; megamoe and grouped_mm
  python3 bench/compare_torch.py --preset qwen3-30b-a3b --backends megamoe,sonicmoe --json out.json
  python3 bench/compare_torch.py --preset qwen3-30b-a3b --backends megamoe,sonicmoe --kernels  # + kernel by kernel
  python3 bench/compare_torch.py --device cpu --preset tiny --tokens 64 --backends grouped_mm,megamoe
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))
from megamoe.train import PRESETS as MODEL_PRESETS  # noqa: E402  (one definition of the shapes)
from child_runs import ChildRuns, finish_child  # noqa: E402  (bench/ is on sys.path when this script runs)

BACKENDS = ("megamoe", "grouped_mm", "grouped_mm_compile", "sonicmoe", "hf_eager", "megamoe_fp8", "megamoe_fp8_bwd",
            "scaled_grouped_mm", "scaled_grouped_mm_compile")
DEFAULT_BACKENDS = ("megamoe", "grouped_mm", "grouped_mm_compile", "sonicmoe")
QUICK_BACKENDS = ("megamoe", "grouped_mm")
BASELINES = ("grouped_mm", "grouped_mm_compile", "sonicmoe")  # "vs best" = the fastest of these
FP8_BASELINES = ("scaled_grouped_mm", "scaled_grouped_mm_compile")  # ... for the FP8 rows
FP8_ROWS = ("megamoe_fp8", "megamoe_fp8_bwd") + FP8_BASELINES
MEGAMOE_PRECISION = {"megamoe": "bf16", "megamoe_fp8": "fp8", "megamoe_fp8_bwd": "fp8_bwd"}
SLOW_FIRST_CALL = ("sonicmoe",)  # compiles 2-4 min per shape: run after the others, so a deadline hits it last
ALL_PRESETS = ("qwen3-30b-a3b", "qwen3-235b-a22b")
ERR_FLAG = 2e-2  # relative error vs the fp64 reference above which a row is flagged (exit status 1)
ERR_FLAG_FP8 = 1e-1  # the same for the FP8 rows (e4m3 operands: docs/numerics.md)
FLUSH_BYTES = 256 << 20  # written before every timed region: > 4x the H200's L2
GIB = float(1 << 30)
PHASES = ("fwd", "bwd", "fwd+bwd")


@dataclass
class Shape:
    preset: str
    tokens: int
    hidden: int
    inter: int
    experts: int
    top_k: int

    @classmethod
    def of(cls, preset: str, tokens: int) -> Shape:
        p = MODEL_PRESETS[preset]
        return cls(preset, tokens, p["hidden_size"], p["moe_intermediate_size"], p["num_experts"],
                   p["num_experts_per_tok"])

    def label(self) -> str:
        return f"{self.preset} T={self.tokens}"


def log(msg: str):
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------- inputs


@dataclass
class RouteSet:
    """One rotation slot: the per-iteration tensors (x, dy and the routing)."""

    x: torch.Tensor  # [T, H] bf16, leaf with grad
    dy: torch.Tensor  # [T, H] bf16
    idx: torch.Tensor  # [T, k] int32, -1 = no route
    w: torch.Tensor  # [T, k] fp32, leaf with grad
    routes: int  # valid routes (host int, counted once here, outside timing)
    load_max_over_mean: float


@dataclass
class Inputs:
    w13: torch.Tensor  # [E, 2I, H] bf16, leaf with grad
    w2: torch.Tensor  # [E, H, I] bf16, leaf with grad
    sets: list[RouteSet]

    def routes(self) -> float:
        return statistics.mean(s.routes for s in self.sets)

    def nbytes(self) -> int:
        ts = [self.w13, self.w2] + [t for s in self.sets for t in (s.x, s.dy, s.idx, s.w)]
        return sum(t.numel() * t.element_size() for t in ts)


def make_routing(shape: Shape, bias: torch.Tensor, drop_frac: float, gen: torch.Generator):
    """k distinct experts per token, P(e) ~ exp(bias[e]) without replacement
    (Gumbel top-k; bias = 0 is uniform), weights = softmax of random logits."""
    T, E, k, dev = shape.tokens, shape.experts, shape.top_k, bias.device
    u = torch.rand(T, E, generator=gen, device=dev).clamp_min(1e-20)
    idx = (bias - torch.log(-torch.log(u))).topk(k, dim=1).indices
    w = torch.softmax(torch.randn(T, k, generator=gen, device=dev), dim=1)
    if drop_frac > 0:  # exercise the -1 (no route) path
        idx[torch.rand(T, k, generator=gen, device=dev) < drop_frac] = -1
    return idx.to(torch.int32).contiguous(), w.contiguous()


def load_stats(idx: torch.Tensor, experts: int) -> tuple[int, float]:
    valid = idx[idx >= 0].long()
    counts = torch.bincount(valid, minlength=experts).float()
    return int(valid.numel()), float(counts.max() / counts.mean().clamp_min(1e-9))


def make_inputs(shape: Shape, args, device: torch.device) -> Inputs:
    """Seeded on the device: every child process gets the same tensors."""
    T, H, I, E = shape.tokens, shape.hidden, shape.inter, shape.experts
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)

    def randn(*size, scale=1.0):
        t = torch.randn(*size, generator=gen, device=device, dtype=torch.bfloat16)
        return t.mul_(scale)

    w13 = randn(E, 2 * I, H, scale=H**-0.5).requires_grad_()
    w2 = randn(E, H, I, scale=I**-0.5).requires_grad_()
    bias = torch.zeros(E, device=device)
    if args.routing == "skewed":
        bias = torch.randn(E, generator=gen, device=device) * args.skew_sigma
    sets = []
    # Several copies of the per-iteration tensors, used in turn, so one
    # iteration does not find the previous one's x/dy/routing in L2.
    for _ in range(args.rotate):
        x = randn(T, H).requires_grad_()
        dy = randn(T, H)
        idx, w = make_routing(shape, bias, args.drop_frac, gen)
        routes, skew = load_stats(idx, E)
        sets.append(RouteSet(x, dy, idx, w.requires_grad_(), routes, skew))
    return Inputs(w13, w2, sets)


# --------------------------------------------------------- grouped_mm path


def grouped_mm_loop(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """CPU-only stand-in for torch._grouped_mm (2D x 3D): the same math as a
    per-group matmul loop. Rows past offs[-1] come back as zeros."""
    out, start = [], 0
    for g, end in enumerate(offs.tolist()):
        out.append(a[start:end] @ b[g])
        start = end
    out.append(a.new_zeros(a.shape[0] - start, b.shape[-1]))
    return torch.cat(out)


def pick_grouped_mm(device: torch.device) -> tuple[Callable, str]:
    """torch._grouped_mm on CUDA; on the CPU only if it runs there (2.9+ has a
    CPU kernel), else the labelled loop fallback."""
    if device.type == "cuda":
        return torch._grouped_mm, "torch._grouped_mm"
    try:
        a = torch.randn(16, 16, dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(2, 16, 16, dtype=torch.bfloat16, requires_grad=True)
        offs = torch.tensor([8, 16], dtype=torch.int32)
        torch._grouped_mm(a, b, offs=offs).float().sum().backward()
        return torch._grouped_mm, "torch._grouped_mm"
    except (AttributeError, RuntimeError, NotImplementedError):
        return grouped_mm_loop, "cpu loop (no torch._grouped_mm CPU kernel)"


def route_plan(idx: torch.Tensor, experts: int, align: int):
    """Expert-sorted, per-expert padded row layout, on the device (no host sync).

    Like TorchTitan's indices_padding_wrapper / generate_permute_indices: each
    expert's group is padded to a multiple of `align` rows (and to at least
    `align`), the buffer has a static upper bound of rows, and padding rows
    read a zero row. Returns, per buffer row, its token (T = the zero/dump
    row), its flat route (T*k = a zero weight) and the int32 group ends.

    Padding is not required by torch._grouped_mm for bf16 here: a group
    starts at a row of a row-major [rows, H] or [rows, 2I] operand, which is
    16-byte aligned whatever the group sizes (TMA needs only that, plus
    strides that are multiples of 16 bytes, which it checks). TorchTitan
    still pads to 8 for bf16 (TOKEN_GROUP_ALIGN_SIZE_M), so --gmm-align
    defaults to 8; --gmm-align 1 runs unpadded (same speed on the H200)."""
    T, k = idx.shape
    n, dev = T * k, idx.device
    expert = idx.reshape(-1).long()
    expert = torch.where(expert < 0, experts, expert)  # dropped routes sort last
    order = torch.argsort(expert, stable=True)
    sorted_e = expert[order]
    starts = torch.searchsorted(sorted_e, torch.arange(experts + 1, device=dev))
    counts = starts[1:] - starts[:-1]
    if align > 1:
        padded = (counts.clamp_min(align) + align - 1) // align * align
        rows = n + experts * align  # >= sum(padded) whatever the routing
    else:
        padded, rows = counts, n
    ends = padded.cumsum(0)
    e = sorted_e.clamp_max(experts - 1)
    dest = (ends - padded)[e] + torch.arange(n, device=dev) - starts[e]
    dest = torch.where(sorted_e < experts, dest, rows)  # dropped: a slot cut off below
    token_of = torch.full((rows + 1,), T, device=dev).scatter_(0, dest, order // k)
    route_of = torch.full((rows + 1,), n, device=dev).scatter_(0, dest, order)
    return token_of[:rows], route_of[:rows], ends.to(torch.int32)


def grouped_mm_forward(x, idx, w, w13, w2, *, gmm: Callable, align: int):
    """TorchTitan's MoE.forward + _run_experts_grouped_mm (score after experts).

    Rows past offs[-1] of a grouped_mm output are never written (garbage); they
    belong to the dump token T / dump route T*k, so their values and grads only
    ever land in the extra row of x_ext / y_ext / w_ext, which is sliced away.
    Differences from TorchTitan, all in its favour: one gather straight into
    the padded layout (TorchTitan gathers, then permutes again), and it by
    advanced indexing, whose backward (a sorted index_put) beat both
    gather's and index_select's atomic backward on the H200; one fused
    gate/up grouped_mm. The combine is TorchTitan's bf16 scatter_add."""
    T, H = x.shape
    I = w2.shape[-1]
    token_of, route_of, offs = route_plan(idx, w13.shape[0], align)
    x_ext = torch.cat([x, x.new_zeros(1, H)])
    xs = x_ext[token_of]
    z = gmm(xs, w13.transpose(-2, -1), offs=offs)
    h = F.silu(z[:, :I]) * z[:, I:]
    o = gmm(h, w2.transpose(-2, -1), offs=offs)
    w_ext = torch.cat([w.reshape(-1), w.new_zeros(1)])
    # As TorchTitan: scale in fp32 with the fp32 router weights, cast to bf16,
    # then the combine accumulates in bf16 (its scatter_add on a bf16 tensor).
    o = (o.float() * w_ext[route_of, None]).to(x.dtype)
    y_ext = x.new_zeros(T + 1, H).scatter_add(0, token_of[:, None].expand(-1, H), o)
    return y_ext[:T]


# --------------------------------------------------------------- HF eager


def hf_eager_forward(x, idx, w, w13, w2):
    """Hugging Face Qwen3-MoE expert loop (transformers' fused gate_up_proj
    layout): torch.where per hit expert, F.linear, routing weights in x's
    dtype, index_add_. Host syncs by nature. In fp64 it is the reference."""
    E = w13.shape[0]
    e_of = torch.where(idx < 0, E, idx.long())  # -1 -> class E, never visited
    mask = F.one_hot(e_of, E + 1).permute(2, 1, 0)  # [E+1, k, T]
    hit = (mask[:E].sum(dim=(1, 2)) > 0).nonzero().flatten().tolist()
    w_x = w.to(x.dtype)
    y = torch.zeros_like(x)
    for e in hit:
        pos, tok = torch.where(mask[e])
        gate, up = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
        o = F.linear(F.silu(gate) * up, w2[e]) * w_x[tok, pos, None]
        y.index_add_(0, tok, o)
    return y


# ------------------------------------------------------------ implementations


class TorchImpl:
    """A forward function of (x, idx, w, w13, w2), differentiated with autograd."""

    bwd_flops_per_route = 12

    def __init__(self, forward: Callable, inputs: Inputs, scale: float = 1.0):
        self.forward, self.inp, self.scale = forward, inputs, scale

    def fwd(self, s: int):
        r = self.inp.sets[s]
        y = self.forward(r.x, r.idx, r.w, self.inp.w13, self.inp.w2)
        return y * self.scale if self.scale != 1.0 else y  # --perturb: a backend that lies

    def bwd(self, y, s: int):
        r = self.inp.sets[s]
        wrt = [r.x, r.w, self.inp.w13, self.inp.w2]
        return torch.autograd.grad(y, wrt, r.dy, allow_unused=True, materialize_grads=True)

    def outputs(self, s: int) -> dict[str, torch.Tensor]:
        y = self.fwd(s)
        dx, dw, dw13, dw2 = self.bwd(y, s)
        return {"y": y.detach(), "dx": dx, "d_topk_w": dw, "dw13": dw13, "dw2": dw2}

    def info(self) -> dict:
        return {}


class MegaMoeImpl(TorchImpl):
    def __init__(self, inputs: Inputs, args, scale: float, precision: str = "bf16"):
        import megamoe

        self.megamoe, self.save = megamoe, args.save
        self.bwd_flops_per_route = 16 if args.save == "recompute" else 12

        def forward(x, idx, w, w13, w2):
            return megamoe.moe(x, idx, w, w13, w2, precision=precision, save=self.save)

        super().__init__(forward, inputs, scale)

    def sync_check(self):
        self.megamoe.check()  # raises device-found errors (bad ids, timed-out waits)

    def info(self) -> dict:
        import megamoe._abi as lib

        out = {"library": getattr(lib.lib(), "_name", None)}
        stats = getattr(self.megamoe, "memory_stats", None)
        if stats is not None:
            out["memory_stats"] = stats()
        return out


class SonicMoeImpl(TorchImpl):
    """SonicMoE's entry point for given routing (the call of ../shared/tools/README.md).
    token / expert ids per rotation slot are built once, outside the timed regions;
    dropped routes (-1) are filtered out there too (its routing is general)."""

    def __init__(self, inputs: Inputs, scale: float):
        from sonicmoe.enums import ActivationType
        from sonicmoe.functional import moe_general_routing_inputs

        self.routes = []
        for r in inputs.sets:
            T, k = r.idx.shape
            flat = r.idx.reshape(-1)
            token = torch.arange(T, device=flat.device, dtype=torch.int32).repeat_interleave(k)
            keep = None
            if bool((flat < 0).any()):
                keep = (flat >= 0).nonzero().flatten()
                token, flat = token[keep], flat[keep]
            self.routes.append((token.contiguous(), flat.int().contiguous(), keep))
        self.current = 0
        E = inputs.w13.shape[0]

        def forward(x, idx, w, w13, w2):
            token, expert, keep = self.routes[self.current]
            scores = w.reshape(-1) if keep is None else w.reshape(-1)[keep]
            y, _ = moe_general_routing_inputs(
                x, scores, token, expert, w13.permute(1, 2, 0), None, w2.permute(1, 2, 0), None, E,
                torch.cuda.current_stream().cuda_stream, ActivationType.SWIGLU, False, True)
            return y

        super().__init__(forward, inputs, scale)

    def fwd(self, s: int):
        self.current = s
        return super().fwd(s)


def sonicmoe_missing() -> str | None:
    if importlib.util.find_spec("sonicmoe") is None:
        return "not installed (source scripts/install-sonicmoe)"
    return None


class Unavailable(Exception):
    """The backend cannot run here (not installed, needs CUDA): not a failure
    unless it was asked for by name."""


def preflight(name: str, device: torch.device) -> None:
    """Raises Unavailable before any input is made, for a backend that cannot run here."""
    if name != "sonicmoe":
        return
    missing = sonicmoe_missing()
    if missing:
        raise Unavailable(missing)
    try:
        import sonicmoe.functional  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a broken install is reported in its row
        raise Unavailable(f"import failed: {type(exc).__name__}: {exc}".splitlines()[0][:300]) from exc
    if device.type != "cuda":
        raise Unavailable("needs CUDA")


def make_impl(name: str, inputs: Inputs, args, device: torch.device) -> TorchImpl:
    scale = args.perturb_scale if args.perturb == name else 1.0
    if name in MEGAMOE_PRECISION:
        return MegaMoeImpl(inputs, args, scale, MEGAMOE_PRECISION[name])
    if name in FP8_BASELINES:
        from fp8_grouped_mm import fp8_gmm

        def fwd_fp8(x, idx, w, w13, w2):  # K groups of the weight gradient on 16-row boundaries
            return grouped_mm_forward(x, idx, w, w13, w2, gmm=fp8_gmm, align=max(16, args.gmm_align))

        if name == "scaled_grouped_mm":
            return TorchImpl(fwd_fp8, inputs, scale)
        return TorchImpl(torch.compile(fwd_fp8, mode=args.compile_mode, dynamic=False), inputs, scale)
    if name in ("grouped_mm", "grouped_mm_compile"):
        gmm, _ = pick_grouped_mm(device)
        align = args.gmm_align

        def fwd_gmm(x, idx, w, w13, w2):
            return grouped_mm_forward(x, idx, w, w13, w2, gmm=gmm, align=align)

        if name == "grouped_mm":
            return TorchImpl(fwd_gmm, inputs, scale)
        # The forward compiled; AOTAutograd traces the joint graph and compiles the
        # backward too, so forward and backward stay separately timeable. (A compiled
        # function that called torch.autograd.grad itself would graph-break there and
        # end up the same two graphs.) Compile time is spent in the warm-up.
        return TorchImpl(torch.compile(fwd_gmm, mode=args.compile_mode, dynamic=False), inputs, scale)
    if name == "sonicmoe":
        preflight(name, device)
        return SonicMoeImpl(inputs, scale)
    if name == "hf_eager":
        return TorchImpl(hf_eager_forward, inputs, scale)
    raise ValueError(name)


# ------------------------------------------------------------------ timing


class Clock:
    """CUDA events on the GPU (read after one sync at the end), wall clock on
    the CPU (where every op is synchronous). Writes a large buffer before
    each timed region so that L2 holds nothing from the previous iteration."""

    def __init__(self, device: torch.device, flush: bool):
        self.cuda = device.type == "cuda"
        self.flush_buf = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device) if self.cuda and flush else None

    def time(self, setup: Callable[[int], Any], region: Callable[[Any, int], Any],
             iters: int, warmup: int, rotate: int) -> list[float]:
        marks = []
        for it in range(warmup + iters):
            s = it % rotate
            state = setup(s)
            if self.flush_buf is not None:
                self.flush_buf.zero_()
            t0 = self._mark()
            out = region(state, s)
            t1 = self._mark()
            del out, state
            if it >= warmup:
                marks.append((t0, t1))
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in marks]
        return [(b - a) * 1e3 for a, b in marks]

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev


# ------------------------------------------------------------------ memory


class Memory:
    """Device memory in use as the driver reports it (cudaMemGetInfo: total -
    free, the whole device), sampled at chosen points and, around one
    forward+backward, by a background thread every ~0.5 ms. Each backend runs
    in its own process, so nothing but this process (and its CUDA context)
    is in that number beside other users of the GPU, if any."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.points: dict[str, int] = {}
        self.peak = 0

    def used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def point(self, name: str, sync: bool = True) -> int | None:
        if not self.cuda:
            return None
        if sync:
            torch.cuda.synchronize(self.device)
        v = self.points[name] = self.used()
        self.peak = max(self.peak, v)
        return v

    def sampled(self, fn: Callable[[], Any]) -> tuple[Any, int | None]:
        """Runs fn (which must synchronise before returning) while a thread samples."""
        if not self.cuda:
            return fn(), None
        peak, stop = [0], threading.Event()

        def loop():
            torch.cuda.set_device(self.device)
            while not stop.is_set():
                peak[0] = max(peak[0], self.used())
                time.sleep(0.0005)

        th = threading.Thread(target=loop, daemon=True)
        th.start()
        try:
            out = fn()
        finally:
            stop.set()
            th.join()
        peak[0] = max(peak[0], self.used())
        self.peak = max(self.peak, peak[0])
        return out, peak[0]


# ------------------------------------------------------------- correctness


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b||_F / ||b||_F in fp64, chunked over dim 0."""
    num = den = 0.0
    step = max(1, a.shape[0] // 16)
    for ca, cb in zip(a.detach().split(step), b.detach().split(step)):
        cb = cb.double()
        num += (ca.double() - cb).square().sum().item()
        den += cb.square().sum().item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return math.sqrt(num / den)


def check_outputs(impl: TorchImpl, inputs: Inputs) -> dict[str, float]:
    """Every output of `impl` against the layer in fp64 on fp64 copies of the same bf16
    inputs (the HF expert loop's math), computed expert by expert with local autograd,
    so that no fp64 copy of the whole weights or their gradients is ever held (at
    deepseek-v3's shape those alone would be 180 GB): y, dx and d topk_w accumulate in
    fp64 [T, H] / [T, k]; each expert's dW13 and dW2 are compared as they come."""
    outs = {n: t.detach() for n, t in impl.outputs(0).items()}
    sync_check(impl)
    r = inputs.sets[0]
    x64, dy64, w64 = r.x.detach().double(), r.dy.detach().double(), r.w.detach().double()
    T, k = r.idx.shape
    E = inputs.w13.shape[0]
    y, dx = torch.zeros_like(x64), torch.zeros_like(x64)
    d_topk_w = torch.zeros(T, k, dtype=torch.float64, device=x64.device)
    e_of = torch.where(r.idx < 0, E, r.idx.long())
    sq = {"dw13": [0.0, 0.0], "dw2": [0.0, 0.0]}  # ||ours - ref||^2, ||ref||^2 summed over experts
    for e in range(E):
        tok, pos = torch.where(e_of == e)
        w13e = inputs.w13[e].detach().double().requires_grad_()
        w2e = inputs.w2[e].detach().double().requires_grad_()
        xr = x64[tok].requires_grad_()
        gate, up = F.linear(xr, w13e).chunk(2, dim=-1)
        o = F.linear(F.silu(gate) * up, w2e)
        we = w64[tok, pos][:, None]
        y.index_add_(0, tok, o.detach() * we)
        d_topk_w[tok, pos] = (dy64[tok] * o.detach()).sum(-1)
        gx, g13, g2 = torch.autograd.grad(o, [xr, w13e, w2e], dy64[tok] * we, materialize_grads=True)
        dx.index_add_(0, tok, gx)
        for name, ref in (("dw13", g13), ("dw2", g2)):
            sq[name][0] += (outs[name][e].double() - ref).square().sum().item()
            sq[name][1] += ref.square().sum().item()
    errs = {"y": rel_err(outs["y"], y), "dx": rel_err(outs["dx"], dx), "d_topk_w": rel_err(outs["d_topk_w"], d_topk_w)}
    for name, (num, den) in sq.items():
        errs[name] = (0.0 if num == 0.0 else math.inf) if den == 0.0 else math.sqrt(num / den)
    del outs
    return errs


def err_flag(backend: str) -> float:
    return ERR_FLAG_FP8 if backend in FP8_ROWS else ERR_FLAG


def flagged(errs: dict[str, float] | None, backend: str) -> bool:
    return bool(errs) and not all(v <= err_flag(backend) for v in errs.values())  # NaN flags too


def sync_check(impl: TorchImpl):
    if hasattr(impl, "sync_check"):
        impl.sync_check()


# ------------------------------------------------------------------ child


def flops(shape: Shape, routes: float, bwd_per_route: int) -> dict[str, float]:
    unit = routes * shape.hidden * shape.inter
    return {"fwd": 6 * unit, "bwd": bwd_per_route * unit, "fwd+bwd": (6 + bwd_per_route) * unit}


def profile_kernels(impl: TorchImpl, calls: int = 5) -> dict[str, Any]:
    """--kernels: the GPU kernels of a forward and of a backward (rotation slot
    0, after the timing: warm), in launch order, each with its duration on the
    GPU's clock (torch.profiler / CUPTI): the median, kernel by kernel, of
    `calls` forward + backward pairs run back to back (the host ahead of the
    GPU, as in training; one call each, as before session 38, read megamoe's
    kGateUp at 1413 us in one session and 1521 in the next). Where a backend's
    time goes, beside the others' in the same run. When the pairs do not
    launch the same kernels each time, one synced call each is listed
    ("sustained": false)."""
    from torch.profiler import ProfilerActivity, profile

    def gpu_events(prof) -> list:
        return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                       and e.device_time_total > 0), key=lambda e: e.time_range.start)

    def kernels(call: Callable[[], Any]) -> tuple[Any, list[dict[str, Any]]]:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = call()
            torch.cuda.synchronize()
        return out, [{"name": e.name, "us": e.device_time_total} for e in gpu_events(prof)]

    state, fwd = kernels(lambda: impl.fwd(0))
    grads, bwd = kernels(lambda: impl.bwd(state, 0))
    del state, grads
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            state = impl.fwd(0)
            grads = impl.bwd(state, 0)
            del state, grads
        torch.cuda.synchronize()
    evs, per = gpu_events(prof), len(fwd) + len(bwd)
    same = len(evs) == calls * per and all(
        evs[c * per + i].name == k["name"] for c in range(calls) for i, k in enumerate(fwd + bwd))
    if not same:
        return {"fwd": fwd, "bwd": bwd, "sustained": False}
    med = [statistics.median(evs[c * per + i].device_time_total for c in range(calls)) for i in range(per)]
    return {"fwd": [dict(k, us=med[i]) for i, k in enumerate(fwd)],
            "bwd": [dict(k, us=med[len(fwd) + i]) for i, k in enumerate(bwd)],
            "sustained": True, "calls": calls}


def short_kernel_name(name: str, width: int = 90) -> str:
    """A demangled kernel name without `void `, namespaces and enum casts
    (megamoe's GEMMs differ only in their template arguments), cut to width."""
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"\(anonymous namespace\)::|\b[A-Za-z_]\w*::", "", name)
    name = re.sub(r"\((?:GemmMode|bool|int)\)", "", name)
    return name if len(name) <= width else name[:width - 3] + "..."


def print_kernels(records: list[dict]):
    """The --kernels tables: per shape and backend, each phase's kernels
    (memcpy / memset records too; names shortened: short_kernel_name) and
    their sum."""
    for rec in records:
        sh = rec["shape"]
        for b, r in rec["backends"].items():
            ks = r.get("kernels")
            if r.get("kernels_error"):
                print(f"\nkernels: {sh['preset']} T={sh['tokens']} {b}: profiler failed: {r['kernels_error']}")
            if not ks:
                continue
            how = (f"medians of {ks['calls']} forward + backward pairs back to back" if ks.get("sustained")
                   else "one call each after a sync")
            print(f"\nkernels: {sh['preset']} T={sh['tokens']} {b} ({how}, warm, us on the GPU's clock)")
            for phase in ("fwd", "bwd"):
                rows = ks.get(phase) or []
                for i, k in enumerate(rows):
                    print(f"  {phase} {i:>2} {short_kernel_name(k['name']):<90} {k['us']:>9.1f}")
                print(f"  {phase} sum {'':<90} {sum(k['us'] for k in rows):>9.1f}")


def run_child(args) -> dict:
    """One backend, one shape, this process: warm-up (compiles), memory of one
    fwd+bwd, timing, then the check against fp64. Never raises."""
    shape = Shape.of(args.preset[0], args.tokens[0])
    name = args.backend
    res: dict[str, Any] = {"backend": name, "shape": vars(shape), "status": "error", "error": None,
                           "torch": torch.__version__, "pid": os.getpid()}
    phase = "setup"
    try:
        device = torch.device(args.device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA device (use --device cpu for a smoke test)")
            device = torch.device("cuda", torch.cuda.current_device())
            torch.zeros(1, device=device)  # the CUDA context
            res["device_name"] = torch.cuda.get_device_name(device)
        else:
            res["device_name"] = "cpu"
        preflight(name, device)
        mem = Memory(device)
        mem.point("context")
        inputs = make_inputs(shape, args, device)
        clock = Clock(device, args.flush_l2)
        mem.point("inputs")
        alloc_inputs = torch.cuda.memory_allocated(device) if mem.cuda else None
        res.update(routes=inputs.routes(), load_max_over_mean=max(s.load_max_over_mean for s in inputs.sets),
                   inputs_bytes=inputs.nbytes(), routing=args.routing)
        if name == "grouped_mm" or name == "grouped_mm_compile":
            res["grouped_mm_kernel"] = pick_grouped_mm(device)[1]

        phase = "build"
        impl = make_impl(name, inputs, args, device)

        # First calls: compilation (torch.compile, SonicMoE's CuTe DSL) and lazy
        # kernel loading, once per rotation slot; reported, never timed below.
        phase = "first calls"
        t0 = time.perf_counter()
        # One line per call (to the child's log): where a slow first call spends its time,
        # e.g. whether a compile happens once per shape or again for every routing.
        def first(what: str, s: int, call: Callable[..., Any], *call_args) -> Any:
            t1 = time.perf_counter()
            result = call(*call_args)
            if mem.cuda:
                torch.cuda.synchronize()
            log(f"  {name}: first {what} of rotation slot {s}: {time.perf_counter() - t1:.1f} s")
            return result

        for s in range(len(inputs.sets)):
            state = first("forward", s, impl.fwd, s)
            first("backward", s, impl.bwd, state, s)  # the gradients are dropped at once
            del state
        sync_check(impl)
        res["first_calls_s"] = time.perf_counter() - t0
        mem.point("after_first_calls")

        phase = "memory"
        mem_res: dict[str, Any] = {}
        if mem.cuda:
            # What the warm-up left cached goes back to the driver, so the sampled
            # peak below is that of one forward+backward (plus whatever the backend
            # keeps between calls, inside or outside torch's allocator).
            torch.cuda.empty_cache()
            mem.point("idle")
            torch.cuda.reset_peak_memory_stats(device)

            def one():
                grads = impl.bwd(impl.fwd(0), 0)
                torch.cuda.synchronize()
                del grads

            _, drv_peak = mem.sampled(one)
            mem_res = {
                "alloc_peak_bytes": torch.cuda.max_memory_allocated(device) - alloc_inputs,
                "reserved_peak_bytes": torch.cuda.max_memory_reserved(device),
                "driver_peak_bytes": drv_peak - mem.points["inputs"],
                "driver_peak_used_bytes": drv_peak,
            }
        sync_check(impl)

        phase = "timing"
        fl = flops(shape, inputs.routes(), impl.bwd_flops_per_route)
        iters, warmup = (args.eager_iters, args.eager_warmup) if name == "hf_eager" else (args.iters, args.warmup)
        samples = {
            "fwd": clock.time(lambda s: None, lambda _, s: impl.fwd(s), iters, warmup, args.rotate),
        }
        mem.point("after_fwd")
        samples["bwd"] = clock.time(impl.fwd, impl.bwd, iters, warmup, args.rotate)  # forward untimed
        mem.point("after_bwd")
        samples["fwd+bwd"] = clock.time(lambda s: None, lambda _, s: impl.bwd(impl.fwd(s), s), iters, warmup,
                                        args.rotate)
        mem.point("after_fwd_bwd")
        sync_check(impl)  # one device-error check after the timed loops
        res["samples"] = samples
        res["ms"] = {p: statistics.median(v) for p, v in samples.items()}
        res["tflops"] = {p: fl[p] / (res["ms"][p] * 1e-3) / 1e12 for p in PHASES}
        res["iters"], res["warmup"] = iters, warmup
        if mem.cuda:
            mem_res["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
            mem_res["driver_process_peak_bytes"] = mem.peak - mem.points["context"]
            mem_res["driver_points_bytes"] = dict(mem.points)
        res["memory"] = mem_res or None

        if args.sustained and mem.cuda:
            from gpu_power import sustained
            turn = [0]

            def step():
                s = turn[0] % args.rotate
                turn[0] += 1
                impl.bwd(impl.fwd(s), s)

            try:  # NVML missing costs the row's energy numbers, not the row
                res["sustained"] = sustained(step, args.sustained, device)
            except (OSError, RuntimeError, AttributeError) as exc:
                res["sustained_error"] = f"{type(exc).__name__}: {exc}"[:300]

        if args.kernels and mem.cuda:
            try:  # a profiler failure costs the table, not the row timed above
                res["kernels"] = profile_kernels(impl)
            except Exception as exc:  # noqa: BLE001
                res["kernels_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]

        phase = "check"
        errs = check_outputs(impl, inputs)
        res["errors_vs_fp64"] = errs
        res["flagged"] = flagged(errs, name)
        res["info"] = impl.info()
        res["status"] = "ok"
    except Unavailable as exc:
        res["status"], res["error"] = "unavailable", str(exc)
    except Exception as exc:  # noqa: BLE001 - the row says what failed
        res["error"] = f"{phase}: {type(exc).__name__}: {exc}".splitlines()[0][:400]
        res["traceback"] = traceback.format_exc()[-4000:]
        log(res["traceback"])
    return res


# ------------------------------------------------------------------ parent


FORWARDED = ("save", "routing", "skew_sigma", "drop_frac", "iters", "warmup", "eager_iters", "eager_warmup",
             "gmm_align", "rotate", "device", "seed", "compile_mode", "perturb", "perturb_scale", "sustained")
FLAGS = ("kernels",)  # store_true options every child gets too


def child_argv(args, backend: str, shape: Shape, out_json: str) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--backend", backend, "--preset", shape.preset,
            "--tokens", str(shape.tokens), "--json", out_json]
    for k in FORWARDED:
        v = getattr(args, k)
        if v is not None:
            argv += ["--" + k.replace("_", "-"), str(v)]
    if not args.flush_l2:
        argv.append("--no-flush-l2")
    argv += ["--" + k for k in FLAGS if getattr(args, k)]
    return argv


def run_children(args, shapes: list[Shape], backends: list[str], on_result: Callable[[dict], None]) -> None:
    order = [(b, s) for s in shapes for b in backends if b not in SLOW_FIRST_CALL]
    order += [(b, s) for s in shapes for b in backends if b in SLOW_FIRST_CALL]
    with ChildRuns("compare_torch.", args.child_timeout, args.deadline, args.log) as runs:
        for backend, shape in order:
            base = {"backend": backend, "shape": vars(shape), "status": "error", "error": None}
            if backend == "sonicmoe" and sonicmoe_missing():
                on_result({**base, "status": "unavailable", "error": sonicmoe_missing()})
                continue
            on_result(runs.run(f"{shape.label()} {backend}", base,
                               lambda out_json: child_argv(args, backend, shape, out_json)))


def merge(path: str, shapes: list[Shape], results: list[dict]) -> None:
    """Adds the rows of an earlier run's --json where this run has no row that ran
    (e.g. SonicMoE measured in a call of its own, for the 10-minute limit); marked *."""
    with open(path) as f:
        earlier = json.load(f)
    for rec in earlier["shapes"]:
        sh = Shape(**rec["shape"])
        if vars(sh) not in [vars(s) for s in shapes]:
            shapes.append(sh)
        for b, r in rec["backends"].items():
            mine = [x for x in results if x["backend"] == b and x["shape"] == vars(sh)]
            if r.get("status") == "ok" and not any(x["status"] == "ok" for x in mine):
                for x in mine:
                    results.remove(x)
                results.append({**r, "merged_from": path})


def analyse(args, shapes: list[Shape], results: list[dict]) -> list[dict]:
    """Per shape: the rows, the fastest baseline per phase, every row against it."""
    records = []
    for sh in shapes:
        rows = {r["backend"]: r for r in results if r["shape"] == vars(sh)}
        rec: dict[str, Any] = {"shape": vars(sh), "backends": rows, "best_baseline": {}, "vs_best": {}}
        first_ok = next((r for r in rows.values() if r["status"] == "ok"), None)
        if first_ok:
            rec.update(routes=first_ok["routes"], load_max_over_mean=first_ok["load_max_over_mean"])
        rec["best_fp8_baseline"] = {}
        for key, names in (("best_baseline", BASELINES), ("best_fp8_baseline", FP8_BASELINES)):
            for p in PHASES:
                cands = [(rows[b]["ms"][p], b) for b in names if b in rows and rows[b]["status"] == "ok"]
                if cands:
                    ms, b = min(cands)
                    rec[key][p] = {"backend": b, "ms": ms}
        for b, r in rows.items():
            best = rec["best_fp8_baseline"] if b in FP8_ROWS else rec["best_baseline"]
            if r["status"] == "ok" and best:
                rec["vs_best"][b] = {p: best[p]["ms"] / r["ms"][p] for p in best}
        records.append(rec)
    return records


def failures(args, records: list[dict], explicit: set[str]) -> list[str]:
    out = []
    for rec in records:
        label = f"{rec['shape']['preset']} T={rec['shape']['tokens']}"
        for b, r in rec["backends"].items():
            if r["status"] == "ok" and r.get("flagged"):
                out.append(f"{label} {b}: error vs fp64 above {err_flag(b):g}")
            elif r["status"] in ("error", "skipped"):
                out.append(f"{label} {b}: {r['status']}: {r['error']}")
            elif r["status"] == "unavailable" and b in explicit:
                out.append(f"{label} {b}: asked for but unavailable: {r['error']}")
    return out


def fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def row_line(label: str, b: str, r: dict, vs: dict | None, peak: float) -> str:
    if r["status"] != "ok":
        return f"{label:<24} {b:<19} {r['status'].upper()}: {r['error']}"
    if r.get("merged_from"):
        b += "*"
    ms, tf = r["ms"], r["tflops"]["fwd+bwd"]
    m = r.get("memory") or {}
    alloc = m.get("alloc_peak_bytes")
    drv = m.get("driver_peak_bytes")
    sp = "/".join(f"{vs[p]:.2f}" for p in PHASES if p in vs) + "x" if vs else "-"
    chk = "FLAG" if r.get("flagged") else "ok"
    return (f"{label:<24} {b:<19} {ms['fwd']:8.3f} {ms['bwd']:8.3f} {ms['fwd+bwd']:8.3f} {tf:7.1f} "
            f"{100 * tf / peak:5.1f}% {sp:>17} {fmt(alloc and alloc / GIB, '7.2f'):>7} "
            f"{fmt(drv and drv / GIB, '7.2f'):>7} {r.get('first_calls_s', 0):7.1f} {chk:>5}")


def print_table(args, records: list[dict]):
    head = (f"{'shape':<24} {'backend':<19} {'fwd ms':>8} {'bwd ms':>8} {'f+b ms':>8} {'TFLOPS':>7} {'%peak':>6} "
            f"{'vs best f/b/f+b':>17} {'alloc':>7} {'drv':>7} {'first s':>7} {'check':>5}")
    print(head)
    print("-" * len(head))
    for rec in records:
        label = f"{rec['shape']['preset']} T={rec['shape']['tokens']}"
        for b in [b for b in BACKENDS if b in rec["backends"]]:
            print(row_line(label, b, rec["backends"][b], rec["vs_best"].get(b), args.peak))
            label = ""


def print_notes(records: list[dict]):
    for rec in records:
        sh = rec["shape"]
        line = f"\n{sh['preset']} T={sh['tokens']} (H {sh['hidden']}, I {sh['inter']}, E {sh['experts']}, k {sh['top_k']})"
        if "routes" in rec:
            line += f": {rec['routes']:.0f} routes, busiest expert {rec['load_max_over_mean']:.2f}x the mean load"
        print(line)
        if rec["best_baseline"]:
            print("  best baseline: " + "  ".join(f"{p} {v['backend']} {v['ms']:.3f} ms"
                                                  for p, v in rec["best_baseline"].items()))
        if rec.get("best_fp8_baseline"):
            print("  best FP8 baseline: " + "  ".join(f"{p} {v['backend']} {v['ms']:.3f} ms"
                                                      for p, v in rec["best_fp8_baseline"].items()))
        for b, r in rec["backends"].items():
            if r.get("merged_from"):
                print(f"  {b:<19} * row from {r['merged_from']} (an earlier run)")
            errs = r.get("errors_vs_fp64")
            if errs:
                txt = "  ".join(f"{n} {v:.2e}" for n, v in errs.items())
                print(f"  {b:<19} rel. error vs fp64: {txt}" + (f"   <-- FLAG > {err_flag(b):g}" if r["flagged"]
                                                                    else ""))
            if r.get("sustained"):
                from gpu_power import describe
                print(f"  {b:<19} sustained: {describe(r['sustained'])}")
            if r.get("sustained_error"):
                print(f"  {b:<19} sustained: NVML failed: {r['sustained_error']}")
            lib = (r.get("info") or {}).get("library")
            if lib:
                print(f"  {b:<19} library: {lib}")
            stats = (r.get("info") or {}).get("memory_stats")
            if stats:
                print(f"  {b:<19} memory_stats: " + ", ".join(f"{k} {v}" for k, v in stats.items()))


def print_header(args, results: list[dict]):
    dev = next((r.get("device_name") for r in results if r.get("device_name")), args.device)
    tv = next((r.get("torch") for r in results if r.get("torch")), torch.__version__)
    print(f"\ntorch {tv} on {dev}; bf16, megamoe save={args.save}; peak {args.peak:g} TFLOP/s; "
          f"one process per backend and shape")
    print(f"median of {args.iters} iters after {args.warmup} warm-up (hf_eager: {args.eager_iters} after "
          f"{args.eager_warmup}), after one untimed first call per rotation slot ('first s': compile, load); "
          f"inputs rotate over {args.rotate} copies of x/dy/routing; L2 flushed before each timed region: "
          f"{'yes' if args.flush_l2 and args.device == 'cuda' else 'no'}")
    print(f"FLOPs: fwd 6*R*H*I, bwd 12*R*H*I (megamoe --save recompute: 16), R = routes. vs best = fastest of "
          f"{', '.join(BASELINES)} / this row, per phase (> 1: faster than every baseline); FP8 rows against "
          f"the fastest of {', '.join(FP8_BASELINES)}.")
    print("alloc GiB = torch.cuda.max_memory_allocated during one fwd+bwd minus the inputs' allocation; "
          "drv GiB = peak device memory in use per the driver (mem_get_info, sampled) during it minus before it "
          "(inputs, L2-flush buffer, context excluded).\n")


# -------------------------------------------------------------------- main


def csv_list(text: str) -> list[str]:
    return [t for t in (s.strip() for s in text.split(",")) if t]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--preset", nargs="+", choices=sorted(MODEL_PRESETS), help="default: both Qwen3 presets")
    p.add_argument("--tokens", nargs="+", type=int, help="default: 16384")
    p.add_argument("--all", action="store_true", help="30B and 235B at 16384 tokens, every backend (the default)")
    p.add_argument("--quick", action="store_true",
                   help=f"30B at 16384 tokens, backends {','.join(QUICK_BACKENDS)} (unless --backends), 10 iters")
    p.add_argument("--backends", type=csv_list,
                   help=f"comma list of {','.join(BACKENDS)} (default {','.join(DEFAULT_BACKENDS)})")
    p.add_argument("--backend", choices=BACKENDS, help=argparse.SUPPRESS)  # child mode: one backend, one shape
    p.add_argument("--save", choices=["keep", "recompute"], default="keep")
    p.add_argument("--wgrad-dtype", choices=["bf16"], default="bf16",
                   help="accepted for old callers: megamoe.moe returns weight grads in the weights' dtype")
    p.add_argument("--routing", choices=["uniform", "skewed"], default="uniform")
    p.add_argument("--skew-sigma", type=float, default=0.5,
                   help="--routing skewed: expert log-popularity ~ N(0, sigma^2); 0.5 gives a max/mean expert "
                        "load of about 2-3x, 2.0 lets a few experts take most rows")
    p.add_argument("--drop-frac", type=float, default=0.0, help="fraction of routes set to -1")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--eager-iters", type=int, default=3)
    p.add_argument("--eager-warmup", type=int, default=1)
    p.add_argument("--gmm-align", type=int, default=8,
                   help="pad each expert's rows to this multiple for grouped_mm (1: no padding)")
    p.add_argument("--compile-mode", default="default", help="torch.compile mode of grouped_mm_compile")
    p.add_argument("--rotate", type=int, default=3, help="copies of x/dy/routing used in turn")
    p.add_argument("--no-flush-l2", dest="flush_l2", action="store_false")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--peak", type=float, default=797.0, help="bf16 peak TFLOP/s for %%peak")
    p.add_argument("--child-timeout", type=float, default=480.0, help="seconds per child process")
    p.add_argument("--deadline", type=float, default=0.0,
                   help="seconds for the whole run: later children are skipped (reported, exit 1), not started")
    p.add_argument("--perturb", choices=BACKENDS,
                   help="self-test: scale this backend's output by --perturb-scale; its check must flag")
    p.add_argument("--perturb-scale", type=float, default=1.05)
    p.add_argument("--log", metavar="PATH", help="append every child's output here")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="add the rows of earlier runs' --json files where this run has none that ran (marked *)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--sustained", type=int, default=0, metavar="STEPS",
                   help="also run STEPS forward + backward steps back to back (no L2 flush) and report ms, "
                        "joules and median SM clock per step from NVML (bench/gpu_power.py)")
    p.add_argument("--kernels", action="store_true",
                   help="also list each backend's kernels of a forward and a backward: medians of 5 pairs "
                        "back to back (torch.profiler)")
    args = p.parse_args(argv)
    if args.backend:  # child
        if not args.json or len(args.preset or []) != 1 or len(args.tokens or []) != 1:
            p.error("--backend (child mode) needs --json, one --preset and one --tokens")
        return args
    explicit = args.backends is not None
    if args.quick:
        args.preset = args.preset or ["qwen3-30b-a3b"]
        args.backends = args.backends or list(QUICK_BACKENDS)
        args.iters = min(args.iters, 10)
        args.warmup = min(args.warmup, 3)
    if args.all:
        args.preset = list(ALL_PRESETS)
    args.preset = args.preset or list(ALL_PRESETS)
    args.tokens = args.tokens or [16384]
    args.backends = args.backends or list(DEFAULT_BACKENDS)
    bad = [b for b in args.backends if b not in BACKENDS]
    if bad:
        p.error(f"--backends: unknown {bad}; choose from {','.join(BACKENDS)}")
    args.explicit = set(args.backends) if explicit else set()
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.backend:
        return finish_child(run_child(args), args.json, ok_statuses=("ok", "unavailable"))

    # The parent never touches the GPU: a CUDA context here would count in every child's driver numbers.
    shapes = [Shape.of(p, t) for p in args.preset for t in args.tokens]
    results: list[dict] = []
    peak = args.peak

    def on_result(r: dict):
        results.append(r)
        label = f"{r['shape']['preset']} T={r['shape']['tokens']}"
        print(row_line(label, r["backend"], r, None, peak), file=sys.stderr, flush=True)

    run_children(args, shapes, args.backends, on_result)
    for path in args.merge or []:
        merge(path, shapes, results)
    records = analyse(args, shapes, results)
    print_header(args, results)
    print_table(args, records)
    print_notes(records)
    print_kernels(records)
    fails = failures(args, records, args.explicit)
    if args.json:
        meta = {"torch": torch.__version__, "args": {k: v for k, v in vars(args).items() if k != "explicit"},
                "err_flag": ERR_FLAG, "baselines": BASELINES}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "shapes": records, "failures": fails}, f, indent=1)
        print(f"\nwrote {args.json}")
    if fails:
        print("\nFAILED:\n  " + "\n  ".join(fails))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
