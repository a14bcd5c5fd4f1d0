#!/usr/bin/env python3
"""megamoe against PyTorch MoE baselines: one process, one GPU, same inputs.

Times forward, backward and forward+backward of one Qwen3-MoE layer for
  megamoe     libmegamoe_c.so through ctypes (include/megamoe/c_api.h)
  grouped_mm  the TorchTitan pipeline: sort by expert, torch._grouped_mm, autograd
  hf_eager    the Hugging Face Qwen3MoeSparseMoeBlock per-expert loop, autograd
and prints one table (median ms, TFLOPS, % of peak, peak memory, speedup vs
grouped_mm) plus relative errors of every output against grouped_mm.

Math, per route (t, j) with e = topk_idx[t, j] (-1 = no route, dropped):
  z = w13[e] @ x[t];  a = silu(z[:I]) * z[I:];  y[t] += topk_w[t, j] * (w2[e] @ a)

  python3 bench/compare_torch.py --preset qwen3-30b-a3b --tokens 16384
  python3 bench/compare_torch.py --all --json out/compare.json
  python3 bench/compare_torch.py --device cpu --preset tiny --tokens 64 --skip-megamoe
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

# name: (hidden H, intermediate I, experts E, top_k k)
PRESETS = {
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "tiny": (256, 128, 8, 2),
}
ALL_SHAPES = [(p, t) for p in ("qwen3-30b-a3b", "qwen3-235b-a22b") for t in (4096, 16384)]
ERR_FLAG = 2e-2  # relative error above which a comparison is flagged (not fatal)
SKEW_SIGMA = 0.5  # --routing skewed: expert log-popularity ~ N(0, 0.5^2), max/mean load ~2-3x
FLUSH_BYTES = 256 << 20  # written before every timed region: > 4x the H200's L2
GIB = float(1 << 30)


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
        return cls(preset, tokens, *PRESETS[preset])

    def label(self) -> str:
        return f"{self.preset} T={self.tokens}"


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
        bias = torch.randn(E, generator=gen, device=device) * SKEW_SIGMA
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
        return torch._grouped_mm, "grouped_mm"
    try:
        a = torch.randn(16, 16, dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(2, 16, 16, dtype=torch.bfloat16, requires_grad=True)
        offs = torch.tensor([8, 16], dtype=torch.int32)
        torch._grouped_mm(a, b, offs=offs).float().sum().backward()
        return torch._grouped_mm, "grouped_mm"
    except (AttributeError, RuntimeError, NotImplementedError):
        return grouped_mm_loop, "grouped_mm[cpu-loop]"


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
    defaults to 8; --gmm-align 1 runs unpadded (same speed on the H200, and
    both match an fp64 reference on the CPU)."""
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
    gather's and index_select's atomic backward on the H200 (1.0 vs 1.3 vs
    2.5 ms at 30B, T=16384); one fused gate/up grouped_mm. The combine is
    TorchTitan's bf16 scatter_add (2x faster there than a bf16 index_add_)."""
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
    layout): torch.where per hit expert, F.linear, bf16 routing weights (HF
    casts them to the hidden dtype), bf16 index_add_. Host syncs by nature."""
    E = w13.shape[0]
    e_of = torch.where(idx < 0, E, idx.long())  # -1 -> class E, never visited
    mask = F.one_hot(e_of, E + 1).permute(2, 1, 0)  # [E+1, k, T]
    hit = (mask[:E].sum(dim=(1, 2)) > 0).nonzero().flatten().tolist()
    w_bf = w.to(x.dtype)
    y = torch.zeros_like(x)
    for e in hit:
        pos, tok = torch.where(mask[e])
        gate, up = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
        o = F.linear(F.silu(gate) * up, w2[e]) * w_bf[tok, pos, None]
        y.index_add_(0, tok, o)
    return y


# ------------------------------------------------------------ implementations


class TorchImpl:
    """A torch forward function, differentiated with autograd."""

    def __init__(self, name: str, forward: Callable, inputs: Inputs):
        self.name, self.forward, self.inp = name, forward, inputs
        self.bwd_flops_per_route = 12

    def fwd(self, s: int):
        r = self.inp.sets[s]
        return self.forward(r.x, r.idx, r.w, self.inp.w13, self.inp.w2)

    def bwd(self, y, s: int):
        r = self.inp.sets[s]
        wrt = [r.x, r.w, self.inp.w13, self.inp.w2]
        return torch.autograd.grad(y, wrt, r.dy, allow_unused=True, materialize_grads=True)

    def outputs(self, s: int) -> dict[str, torch.Tensor]:
        y = self.fwd(s)
        dx, dw, dw13, dw2 = self.bwd(y, s)
        return {"y": y.detach(), "dx": dx, "d_topk_w": dw, "dw13": dw13, "dw2": dw2}

    def reset(self):
        pass

    def extra_bytes(self) -> int:
        return 0

    def finish(self):
        pass

    def close(self):
        pass


class MegaMoeConfig(ctypes.Structure):
    _fields_ = [  # mirrors megamoe_config in include/megamoe/c_api.h
        ("hidden", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("num_experts", ctypes.c_int32),
        ("top_k", ctypes.c_int32),
        ("ep_rank", ctypes.c_int32),
        ("ep_size", ctypes.c_int32),
        ("max_tokens_per_rank", ctypes.c_int64),
        ("precision", ctypes.c_int32),
        ("save_policy", ctypes.c_int32),
        ("backend", ctypes.c_int32),
        ("device", ctypes.c_int32),
    ]


class MegaMoeLib:
    """ctypes binding of the C ABI; every non-zero return raises."""

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        P, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
        sigs = {
            "megamoe_workspace_create": ([ctypes.POINTER(MegaMoeConfig), ctypes.POINTER(P)], ctypes.c_int),
            "megamoe_workspace_destroy": ([P], None),
            "megamoe_workspace_bytes": ([P], ctypes.c_size_t),
            "megamoe_forward": ([P, i64] + [P] * 7, ctypes.c_int),
            "megamoe_backward": ([P, i64] + [P] * 10 + [i32, P], ctypes.c_int),
            "megamoe_check_device_errors": ([P, P], ctypes.c_int),
            "megamoe_last_error": ([], ctypes.c_char_p),
        }
        for name, (argtypes, restype) in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
        self.lib = lib

    def call(self, name: str, *args):
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            msg = (self.lib.megamoe_last_error() or b"").decode(errors="replace")
            raise RuntimeError(f"{name} returned {rc}: {msg}")


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    assert t.is_contiguous()
    return ctypes.c_void_p(t.data_ptr())


class MegaMoeImpl:
    """One megamoe workspace for one shape; outputs live in torch tensors."""

    name = "megamoe"

    def __init__(self, lib: MegaMoeLib, shape: Shape, inputs: Inputs, args, device: torch.device):
        self.lib, self.shape, self.inp, self.device = lib, shape, inputs, device
        self.recompute = args.save == "recompute"
        self.bwd_flops_per_route = 16 if self.recompute else 12
        self.wgrad_f32 = args.wgrad_dtype == "fp32"
        cuda = device.type == "cuda"
        cfg = MegaMoeConfig(
            hidden=shape.hidden, intermediate=shape.inter, num_experts=shape.experts,
            top_k=shape.top_k, ep_rank=0, ep_size=1, max_tokens_per_rank=shape.tokens,
            precision=0, save_policy=int(self.recompute), backend=1 if cuda else 0,
            device=torch.cuda.current_device() if cuda else 0,
        )
        self.ws = ctypes.c_void_p()
        lib.call("megamoe_workspace_create", ctypes.byref(cfg), ctypes.byref(self.ws))
        self.out: dict[str, torch.Tensor] | None = None

    def _stream(self) -> ctypes.c_void_p:
        if self.device.type != "cuda":
            return ctypes.c_void_p(None)
        return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

    def _outputs(self) -> dict[str, torch.Tensor]:
        # Allocated on first use (inside the memory measurement), then reused.
        # NaN-filled: an output the library fails to write must not pass the
        # check with a baseline's result left in recycled allocator memory.
        if self.out is None:
            T, k, dev = self.shape.tokens, self.shape.top_k, self.device
            wdt = torch.float32 if self.wgrad_f32 else torch.bfloat16
            nan = float("nan")
            self.out = {
                "y": torch.full_like(self.inp.sets[0].x, nan),
                "dx": torch.full_like(self.inp.sets[0].x, nan),
                "d_topk_w": torch.full((T, k), nan, device=dev),
                "dw13": torch.full(self.inp.w13.shape, nan, dtype=wdt, device=dev),
                "dw2": torch.full(self.inp.w2.shape, nan, dtype=wdt, device=dev),
            }
        return self.out

    def _args(self, s: int) -> list[ctypes.c_void_p]:
        r, w = self.inp.sets[s], self.inp
        return [_ptr(r.x), _ptr(r.idx), _ptr(r.w), _ptr(w.w13), _ptr(w.w2)]

    def fwd(self, s: int):
        o = self._outputs()
        T = ctypes.c_int64(self.shape.tokens)
        self.lib.call("megamoe_forward", self.ws, T, *self._args(s), _ptr(o["y"]), self._stream())

    def bwd(self, _state, s: int):
        o = self._outputs()
        grads = [_ptr(o[n]) for n in ("dx", "d_topk_w", "dw13", "dw2")]
        self.lib.call(
            "megamoe_backward", self.ws, ctypes.c_int64(self.shape.tokens), *self._args(s),
            _ptr(self.inp.sets[s].dy), *grads, ctypes.c_int32(int(self.wgrad_f32)), self._stream(),
        )

    def outputs(self, s: int) -> dict[str, torch.Tensor]:
        self.bwd(self.fwd(s), s)
        self.finish()
        return {n: t.clone() for n, t in self._outputs().items()}

    def reset(self):
        self.out = None

    def extra_bytes(self) -> int:
        # The workspace is cudaMalloc'd by the library, outside torch's allocator.
        return int(self.lib.lib.megamoe_workspace_bytes(self.ws))

    def finish(self):
        self.lib.call("megamoe_check_device_errors", self.ws, self._stream())

    def close(self):
        if self.ws:
            self.lib.lib.megamoe_workspace_destroy(self.ws)
            self.ws = ctypes.c_void_p()


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


def time_impl(impl, clock: Clock, iters: int, warmup: int, rotate: int) -> dict[str, list[float]]:
    def nothing(s):
        return None

    def fwd(_, s):
        return impl.fwd(s)

    def fwd_bwd(_, s):
        return impl.bwd(impl.fwd(s), s)

    samples = {
        "fwd": clock.time(nothing, fwd, iters, warmup, rotate),
        "bwd": clock.time(impl.fwd, impl.bwd, iters, warmup, rotate),  # forward untimed
        "fwd+bwd": clock.time(nothing, fwd_bwd, iters, warmup, rotate),
    }
    impl.finish()  # megamoe: one device-error check after the timed loops
    return samples


def peak_bytes(impl, device: torch.device) -> int | None:
    """Peak memory of one fwd+bwd beyond what was allocated before it (shared
    inputs, earlier results); for megamoe plus its workspace."""
    if device.type != "cuda":
        return None
    impl.reset()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = impl.bwd(impl.fwd(0), 0)
    torch.cuda.synchronize()
    del grads
    return torch.cuda.max_memory_allocated() - base + impl.extra_bytes()


# ------------------------------------------------------------- correctness


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b||_F / ||b||_F in fp32 math, fp64 sums, chunked over dim 0."""
    num = den = 0.0
    step = max(1, a.shape[0] // 16)
    for ca, cb in zip(a.detach().split(step), b.detach().split(step)):
        cb = cb.float()
        num += (ca.float() - cb).square().sum(dtype=torch.float64).item()
        den += cb.square().sum(dtype=torch.float64).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return math.sqrt(num / den)


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    return {n: rel_err(a[n], b[n]) for n in b}


# ----------------------------------------------------------------- driver


@dataclass
class ImplResult:
    name: str
    ms: dict[str, float] = field(default_factory=dict)  # median per phase
    samples: dict[str, list[float]] = field(default_factory=dict)
    tflops: dict[str, float] = field(default_factory=dict)
    peak_bytes: int | None = None
    workspace_bytes: int | None = None
    error: str | None = None


def flops(shape: Shape, routes: float, bwd_per_route: int) -> dict[str, float]:
    unit = routes * shape.hidden * shape.inter
    return {"fwd": 6 * unit, "bwd": bwd_per_route * unit, "fwd+bwd": (6 + bwd_per_route) * unit}


def log(msg: str):
    print(msg, file=sys.stderr, flush=True)


def run_impl(name: str, make: Callable[[], Any], shape: Shape, inputs: Inputs, args, clock: Clock,
             device: torch.device, ref: dict | None, iters: int, warmup: int):
    """Build, check against `ref`, measure memory, time. Returns (result,
    its outputs or None, errors vs ref). Never raises: errors go in the row."""
    res, outs, errs, impl = ImplResult(name), None, None, None
    try:
        log(f"[{shape.label()}] {name}: check, memory, timing ({iters} iters)")
        impl = make()
        outs = impl.outputs(0)
        if ref is not None:
            errs = compare(outs, ref)
        res.peak_bytes = peak_bytes(impl, device)
        res.workspace_bytes = impl.extra_bytes() or None
        res.samples = time_impl(impl, clock, iters, warmup, args.rotate)
        fl = flops(shape, inputs.routes(), impl.bwd_flops_per_route)
        for phase, xs in res.samples.items():
            res.ms[phase] = statistics.median(xs)
            res.tflops[phase] = fl[phase] / (res.ms[phase] * 1e-3) / 1e12
    except Exception as exc:  # noqa: BLE001 - a failing implementation must not stop the others
        res.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        log(f"[{shape.label()}] {res.name}: {res.error}")
    finally:
        if impl is not None:
            impl.close()
    return res, outs, errs


def run_shape(shape: Shape, args, device: torch.device, clock: Clock, lib) -> dict:
    inputs = make_inputs(shape, args, device)
    gmm, gmm_name = pick_grouped_mm(device)

    def fwd_gmm(*a):
        return grouped_mm_forward(*a, gmm=gmm, align=args.gmm_align)

    record: dict[str, Any] = {
        "shape": vars(shape), "routing": args.routing, "routes": inputs.routes(),
        "load_max_over_mean": max(s.load_max_over_mean for s in inputs.sets),
        "inputs_bytes": inputs.nbytes(), "impls": {}, "errors_vs_grouped_mm": {},
    }
    gres, ref, _ = run_impl(gmm_name, lambda: TorchImpl(gmm_name, fwd_gmm, inputs), shape, inputs, args,
                            clock, device, None, args.iters, args.warmup)
    results = [gres]
    if not args.skip_eager:
        eres, _, errs = run_impl("hf_eager", lambda: TorchImpl("hf_eager", hf_eager_forward, inputs), shape, inputs,
                                 args, clock, device, ref, args.eager_iters, args.eager_warmup)
        results.append(eres)
        if errs:
            record["errors_vs_grouped_mm"]["hf_eager"] = errs
    if not args.skip_megamoe:
        # Last: a device fault in a new library must not take the baselines down with it.
        mres, _, errs = run_impl("megamoe", lambda: make_megamoe(lib, shape, inputs, args, device), shape, inputs,
                                 args, clock, device, ref, args.iters, args.warmup)
        results.insert(0, mres)
        if errs:
            record["errors_vs_grouped_mm"]["megamoe"] = errs
    for r in results:
        record["impls"][r.name] = vars(r)
    record["ratios"] = ratios(results, gmm_name)
    return record


def make_megamoe(lib, shape, inputs, args, device):
    if isinstance(lib, str):  # the load error
        raise RuntimeError(lib)
    return MegaMoeImpl(lib, shape, inputs, args, device)


def ratios(results: list[ImplResult], gmm_name: str) -> dict:
    by = {r.name: r for r in results}
    g, m = by.get(gmm_name), by.get("megamoe")
    if not g or not m or not g.ms or not m.ms:
        return {}
    return {
        "megamoe_over_grouped_mm": {p: m.ms[p] / g.ms[p] for p in g.ms},
        "speedup_vs_grouped_mm": {p: g.ms[p] / m.ms[p] for p in g.ms},
    }


# ------------------------------------------------------------------ output


def fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def print_table(records: list[dict], peak_tflops: float):
    head = f"{'shape':<24} {'impl':<22} {'fwd ms':>9} {'bwd ms':>9} {'f+b ms':>9} " \
           f"{'TFLOPS':>7} {'%peak':>6} {'peak GiB':>9}  speedup vs grouped_mm fwd/bwd/f+b"
    print(head)
    print("-" * len(head))
    for rec in records:
        sh = rec["shape"]
        label = f"{sh['preset']} T={sh['tokens']}"
        gms = next((r["ms"] for n, r in rec["impls"].items() if n.startswith("grouped_mm")), {})
        for name, r in rec["impls"].items():
            if r["error"]:
                print(f"{label:<24} {name:<22} ERROR {r['error']}")
                continue
            ms, tf = r["ms"], r["tflops"].get("fwd+bwd")
            mem = None if r["peak_bytes"] is None else r["peak_bytes"] / GIB
            sp = "/".join(f"{gms[p] / ms[p]:.2f}" for p in ms) + "x" if gms else "-"
            print(f"{label:<24} {name:<22} {ms['fwd']:9.3f} {ms['bwd']:9.3f} {ms['fwd+bwd']:9.3f} "
                  f"{tf:7.1f} {100 * tf / peak_tflops:5.1f}% {fmt(mem, '9.3f'):>9}  {sp}")
            label = ""


def print_notes(records: list[dict]):
    for rec in records:
        sh = rec["shape"]
        label = f"{sh['preset']} T={sh['tokens']}"
        print(f"\n{label}: {rec['routes']:.0f} routes, {rec['routing']} routing, "
              f"busiest expert {rec['load_max_over_mean']:.2f}x the mean load")
        rat = rec.get("ratios")
        if rat:
            t = rat["megamoe_over_grouped_mm"]
            s = rat["speedup_vs_grouped_mm"]
            print("  megamoe / grouped_mm time: " + "  ".join(f"{p} {v:.3f}" for p, v in t.items()))
            print("  grouped_mm / megamoe (speedup): " + "  ".join(f"{p} {v:.2f}x" for p, v in s.items()))
        m = rec["impls"].get("megamoe")
        if m and m.get("workspace_bytes"):
            print(f"  megamoe peak includes its workspace: {m['workspace_bytes'] / GIB:.3f} GiB "
                  "(cudaMalloc'd outside torch's allocator)")
        for name, errs in rec["errors_vs_grouped_mm"].items():
            flag = not all(v <= ERR_FLAG for v in errs.values())  # NaN flags too
            txt = "  ".join(f"{n} {v:.2e}" for n, v in errs.items())
            print(f"  rel. error {name} vs grouped_mm: {txt}" + (f"   <-- FLAG > {ERR_FLAG:g}" if flag else ""))


def print_header(args, device: torch.device):
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__} on {dev}; megamoe lib {args.lib} "
          f"(bf16, save={args.save}, wgrad {args.wgrad_dtype}); peak {args.peak:g} TFLOP/s")
    print(f"median of {args.iters} iters after {args.warmup} warm-up (hf_eager: {args.eager_iters} "
          f"after {args.eager_warmup}); inputs rotate over {args.rotate} copies of x/dy/routing; "
          f"L2 flushed before each timed region: {'yes' if args.flush_l2 and device.type == 'cuda' else 'no'}")
    print(f"FLOPs: fwd 6*R*H*I, bwd 12*R*H*I (megamoe with recompute: 16), R = routes. "
          f"grouped_mm groups padded to {args.gmm_align} rows (TorchTitan bf16 default 8). "
          f"Peak memory = max_memory_allocated during one fwd+bwd minus what was allocated before.\n")


# -------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--all", action="store_true", help="both Qwen3 presets x tokens 4096, 16384")
    p.add_argument("--lib", default="build/libmegamoe_c.so")
    p.add_argument("--save", choices=["keep", "recompute"], default="keep")
    p.add_argument("--wgrad-dtype", choices=["bf16", "fp32"], default="fp32")
    p.add_argument("--routing", choices=["uniform", "skewed"], default="uniform")
    p.add_argument("--drop-frac", type=float, default=0.0, help="fraction of routes set to -1")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--eager-iters", type=int, default=3)
    p.add_argument("--eager-warmup", type=int, default=1)
    p.add_argument("--skip-eager", action="store_true")
    p.add_argument("--skip-megamoe", action="store_true")
    p.add_argument("--gmm-align", type=int, default=8,
                   help="pad each expert's rows to this multiple for grouped_mm (1: no padding)")
    p.add_argument("--rotate", type=int, default=3, help="copies of x/dy/routing used in turn")
    p.add_argument("--no-flush-l2", dest="flush_l2", action="store_false")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--peak", type=float, default=797.0, help="bf16 peak TFLOP/s for %%peak")
    p.add_argument("--json", metavar="PATH")
    return p.parse_args(argv)


def load_lib(args):
    """The library, or the reason it could not be loaded (shown in its rows)."""
    if args.skip_megamoe:
        return None
    try:
        return MegaMoeLib(args.lib)
    except OSError as exc:
        return f"cannot load {args.lib}: {exc}"


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("no CUDA device (use --device cpu for a smoke test)")
        device = torch.device("cuda", torch.cuda.current_device())
    shapes = [Shape.of(p, t) for p, t in ALL_SHAPES] if args.all else [Shape.of(args.preset, args.tokens)]
    lib = load_lib(args)
    clock = Clock(device, args.flush_l2)
    print_header(args, device)
    records = []
    for shape in shapes:
        records.append(run_shape(shape, args, device, clock, lib))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the shape's inputs and reference are gone
    print_table(records, args.peak)
    print_notes(records)
    if args.json:
        meta = {"torch": torch.__version__, "device": str(device), "args": vars(args)}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "shapes": records}, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
