"""The megamoe op against plain PyTorch, autograd, checkpointing, compile, errors."""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import megamoe
from conftest import cuda_only
from reference_moe import moe_reference, random_inputs

NO_FP8 = torch.empty(0, dtype=torch.uint8)  # bf16: the ops take no FP8 weight buffer


def grads(fn, inputs):
    x, idx, w, w13, w2 = inputs
    y = fn(x, idx, w, w13, w2)
    dy = torch.linspace(-1, 1, y.numel(), dtype=y.dtype, device=y.device).reshape(y.shape)
    (y * dy).sum().backward()
    return [y.detach()] + [t.grad.detach().clone() for t in (x, w, w13, w2)]


def test_forward_and_gradients_match_plain_pytorch_in_float64():
    ours = grads(megamoe.moe, random_inputs())
    ref = grads(moe_reference, random_inputs())
    for name, a, b in zip(("y", "dx", "d_topk_weights", "dw13", "dw2"), ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_dropped_route_has_zero_weight_gradient():
    x, idx, w, w13, w2 = random_inputs()
    megamoe.moe(x, idx, w, w13, w2).sum().backward()
    assert w.grad[2, 1] == 0 and idx[2, 1] == -1
    assert torch.count_nonzero(w.grad) == w.numel() - 1


def test_bf16_on_cpu_emulates_the_gpu_rounding():
    ours = grads(megamoe.moe, random_inputs(dtype=torch.bfloat16))
    ref = grads(moe_reference, random_inputs())
    for a, b in zip(ours, ref):
        err = (a.double() - b).norm() / b.norm()
        assert err < 2e-2, err


def test_opcheck():
    x, idx, w, w13, w2 = random_inputs(T=5)
    torch.library.opcheck(torch.ops.megamoe.moe_fwd.default, (x, idx, w, w13, w2, NO_FP8, False, "bf16", True, False))
    # fp8_lookup (the compiled path's in-op cache look-up) is a no-op off CUDA
    torch.library.opcheck(torch.ops.megamoe.moe_fwd.default,
                          (x, idx, w, w13, w2, NO_FP8, False, "bf16", True, False, True))


def test_interleaved_calls_of_different_sizes_are_exact():
    # Each backward gets its own forward's state through autograd: a later,
    # larger call in between cannot disturb it (no shared per-layer state).
    a, b = random_inputs(T=7, seed=1), random_inputs(T=20, seed=2)
    ya = megamoe.moe(*a)
    yb = megamoe.moe(*b)
    ya.sum().backward()
    yb.sum().backward()
    for inputs, seed, T in ((a, 1, 7), (b, 2, 20)):
        ref = random_inputs(T=T, seed=seed)
        moe_reference(*ref).sum().backward()
        for got, want in zip((inputs[0], inputs[2], inputs[3], inputs[4]), (ref[0], ref[2], ref[3], ref[4])):
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12)


def test_threads_with_different_token_counts_keep_their_own_state():
    # Each thread's backward gets its own forward's saved state (no cache shared between calls).
    import threading

    errors = []

    def worker(T, seed):
        try:
            for _ in range(3):
                ours, ref = random_inputs(T=T, seed=seed), random_inputs(T=T, seed=seed)
                megamoe.moe(*ours).sum().backward()
                moe_reference(*ref).sum().backward()
                for got, want in zip((ours[0], ours[2], ours[3], ours[4]), (ref[0], ref[2], ref[3], ref[4])):
                    torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(T, seed)) for T, seed in ((5, 1), (40, 2), (17, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_inference_needs_no_autograd(mode):
    x, idx, w, w13, w2 = random_inputs()
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx:
        y = megamoe.moe(x, idx, w, w13, w2)
        layer = megamoe.MoE(128, 128, 4, 2, dtype=torch.float64)
        out = layer(torch.randn(3, 5, 128, dtype=torch.float64))
    torch.testing.assert_close(y, moe_reference(x, idx, w, w13, w2).detach(), rtol=1e-10, atol=1e-12)
    assert not y.requires_grad and out.shape == (3, 5, 128)


def test_saved_layout_in_python_matches_the_library():
    # The fake (symbolic) forward sizes the saved tensor in Python: it must equal the C++ layout.
    for T, H, I, E, k in [(1, 128, 128, 4, 2), (300, 256, 128, 8, 2), (16384, 2048, 768, 128, 8),
                          (257, 4096, 1536, 128, 8), (10, 128, 256, 4, 4), (0, 128, 128, 16, 4)]:
        assert megamoe._abi.saved_bytes(T, H, I, E, k) == megamoe.buffer_sizes(T, H, I, E, k)[1], (T, H, I, E, k)
        assert megamoe.buffer_sizes(T, H, I, E, k, save="recompute")[1] == 0
        assert megamoe.buffer_sizes(T, H, I, E, k, will_backward=False)[1] == 0


def test_sizes_that_overflow_are_errors():
    for tokens in (2 ** 62, 2 ** 63 - 1, 536870912):
        with pytest.raises(megamoe.MegaMoEError, match=r"max_tokens_per_rank \* top_k = 1 \* \d+ \* 8 exceeds 2\^30"):
            megamoe.buffer_sizes(tokens, 2048, 768, 128, 8)


def test_activation_checkpointing_gives_the_same_gradients():
    layer = megamoe.MoE(128, 128, 4, 2, dtype=torch.float64)
    h = torch.randn(2, 8, 128, dtype=torch.float64, requires_grad=True)
    layer(h).square().sum().backward()
    plain = [h.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    h.grad = None
    layer.zero_grad()
    checkpoint(layer, h, use_reentrant=False).square().sum().backward()
    ckpt = [h.grad] + [p.grad for p in layer.parameters()]
    for a, b in zip(plain, ckpt):
        torch.testing.assert_close(a, b)


def test_compile_without_graph_breaks():
    layer = megamoe.MoE(128, 128, 4, 2, dtype=torch.float64)
    h = torch.randn(16, 128, dtype=torch.float64, requires_grad=True)
    eager_y = layer(h)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    y = compiled(h)
    torch.testing.assert_close(y, eager_y)
    y.sum().backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_cold_fullgraph(checkpointing, dynamic):
    # A freshly built layer compiled before any eager call (what a trainer does).
    torch._dynamo.reset()
    layer = megamoe.MoE(128, 128, 4, 2, dtype=torch.float64)
    fn = (lambda h: checkpoint(layer, h, use_reentrant=False)) if checkpointing else layer
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for T in (16, 24):
        h = torch.randn(T, 128, dtype=torch.float64, requires_grad=True)
        y = compiled(h)
        y.square().sum().backward()
        h2 = h.detach().clone().requires_grad_()
        layer(h2).square().sum().backward()
        torch.testing.assert_close(h.grad, h2.grad)


def test_bad_inputs_give_clear_errors():
    x, idx, w, w13, w2 = random_inputs()
    bad = idx.clone()
    bad[1, 0] = 9
    with pytest.raises(megamoe.MegaMoEError, match=r"topk_idx\[1,0\] = 9 is out of range"):
        megamoe.moe(x, bad, w, w13, w2)
    with pytest.raises(ValueError, match=r"w13: expected \[E, 2I, H\] = \[4, 256, 128\] \(I = 128 from w2"):
        megamoe.moe(x, idx, w, w13[:, :128], w2)  # [E, I, H]
    with pytest.raises(ValueError, match=r"w13: expected \[E, 2I, H\] = \[4, 256, 128\]"):
        megamoe.moe(x, idx, w, w13.transpose(1, 2), w2)  # [E, H, 2I]
    with pytest.raises(ValueError, match=r"w13: expected 3 dims \[E, 2I, H\], got shape \[4, 32768\]"):
        megamoe.moe(x, idx, w, w13.reshape(4, -1), w2)
    with pytest.raises(ValueError, match=r"w2: expected \[E, H, I\] = \[4, 128, I\]"):
        megamoe.moe(x, idx, w, w13, w2.transpose(0, 1))
    with pytest.raises(ValueError, match="precision='fp16'"):
        megamoe.moe(x, idx, w, w13, w2, precision="fp16")
    with pytest.raises(ValueError, match=r"fp8_scale='e8m0' is not one of \['fp32', 'pow2'\]"):
        megamoe.moe(x, idx, w, w13, w2, precision="fp8", fp8_scale="e8m0")


def test_fp8_scale_reaches_the_library():
    """fp8_scale picks the block scales of the library's FP8 recipe (here the CPU reference's emulation):
    pow2 and fp32 scales round differently, both stay within FP8's error of bf16; a bad value in the C
    struct is refused by the library, naming the field."""
    import ctypes
    from megamoe import _abi
    x, idx, w, w13, w2 = random_inputs(T=6, dtype=torch.bfloat16)
    bf16 = megamoe.moe(x, idx, w, w13, w2).double()
    ys = {s: megamoe.moe(x, idx, w, w13, w2, precision="fp8", fp8_scale=s).double() for s in ("fp32", "pow2")}
    assert not torch.equal(ys["fp32"], ys["pow2"])
    for s, y in ys.items():
        err = (y - bf16).norm() / bf16.norm()
        assert 0 < err < 0.1, (s, err)
    with pytest.raises(ValueError, match="fp8_scale='pow2' needs precision 'fp8' or 'fp8_bwd' \\(got 'bf16'\\)"):
        megamoe.moe(x, idx, w, w13, w2, fp8_scale="pow2")
    with pytest.raises(ValueError, match="fp8_scale='pow2' needs precision 'fp8' or 'fp8_bwd' \\(got 'bf16'\\)"):
        _abi.fp8_weight_bytes(128, 128, 4, 2, "bf16", "pow2")
    cfg = _abi.config(128, 128, 4, 2, precision="fp8", fp8_scale="pow2")
    assert (cfg.precision, cfg.fp8_scale) == (_abi.OPTIONS["precision"]["fp8"], _abi.OPTIONS["fp8_scale"]["pow2"])
    cfg.fp8_scale = 2
    scratch, saved = ctypes.c_uint64(), ctypes.c_uint64()
    with pytest.raises(megamoe.MegaMoEError, match=r"fp8_scale: expected 0 \(fp32\) or 1 \(pow2\), got 2"):
        _abi.check(_abi.lib().megamoe_buffer_sizes(ctypes.byref(cfg), 8, 1, ctypes.byref(scratch),
                                                   ctypes.byref(saved)))
    cfg.fp8_scale, cfg.cuda_paths = 1, 8
    with pytest.raises(megamoe.MegaMoEError, match=r"cuda_paths: expected bits 0-2 \(0 = the defaults\), got 8"):
        _abi.check(_abi.lib().megamoe_buffer_sizes(ctypes.byref(cfg), 8, 1, ctypes.byref(scratch),
                                                   ctypes.byref(saved)))


@cuda_only
def test_cuda_matches_cpu_reference_and_adds_no_host_sync():
    cpu = random_inputs(T=300, H=256, I=128, E=8, k=2, dtype=torch.bfloat16)
    gpu = random_inputs(T=300, H=256, I=128, E=8, k=2, dtype=torch.bfloat16, device="cuda")
    ref = grads(megamoe.moe, cpu)
    megamoe.moe(*gpu)  # warm-up: module load, tensor-map encoder, scratch
    for t in gpu:
        t.grad = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        ours = grads(megamoe.moe, gpu)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for a, b in zip(ours, ref):
        err = (a.cpu().double() - b.double()).norm() / b.double().norm()
        assert err < 1e-2, err
    megamoe.check()


@cuda_only
def test_cuda_forward_backward_capture_in_a_graph():
    gpu = random_inputs(T=256, H=256, I=128, E=8, k=2, dtype=torch.bfloat16, device="cuda", drop=False)
    x, idx, w, w13, w2 = (t.detach() for t in gpu)
    w = w.float()  # the raw op takes fp32 routing weights (megamoe.moe casts)
    dy = torch.randn_like(x)
    none8 = x.new_empty(0, dtype=torch.uint8)  # bf16: no FP8 weight buffer
    eager_y, eager_saved = torch.ops.megamoe.moe_fwd(x, idx, w, w13, w2, none8, False, "bf16", True, False)
    eager = torch.ops.megamoe.moe_bwd(dy, x, idx, w, w13, w2, eager_saved, none8, "bf16", False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, saved = torch.ops.megamoe.moe_fwd(x, idx, w, w13, w2, none8, False, "bf16", True, False)
        g = torch.ops.megamoe.moe_bwd(dy, x, idx, w, w13, w2, saved, none8, "bf16", False)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager_y)
    for a, b in zip(g, eager):
        assert torch.equal(a, b)


@cuda_only
def test_cuda_autograd_step_captured_in_a_graph():
    # What a trainer does with CUDA graphs: forward + autograd backward captured
    # together (after the side-stream warm-up torch requires), replayed, and
    # compared bitwise with the same step run eagerly.
    x, idx, w, w13, w2 = random_inputs(T=256, H=256, I=128, E=8, k=2, dtype=torch.bfloat16,
                                       device="cuda", drop=False)
    dy = torch.randn(x.shape, device="cuda", dtype=x.dtype)
    params = (x, w, w13, w2)

    def step():
        for t in params:
            t.grad = None
        megamoe.moe(x, idx, w, w13, w2).backward(dy)

    step()
    eager = [t.grad.clone() for t in params]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for t in params:
        t.grad = None
    with torch.cuda.graph(graph):
        megamoe.moe(x, idx, w, w13, w2).backward(dy)
    for t in params:
        t.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for t, ref in zip(params, eager):
        assert torch.equal(t.grad, ref)
    megamoe.check()


def test_strided_inputs_and_huge_ids():
    x, idx, w, w13, w2 = random_inputs()
    xt = x.detach().t().contiguous().t()  # same values, column-major
    y_ref = megamoe.moe(x.detach(), idx, w.detach(), w13.detach(), w2.detach())
    y, _ = torch.ops.megamoe.moe_fwd(xt, idx, w.detach(), w13.detach(), w2.detach(), NO_FP8, False, "bf16", False,
                                     False)
    torch.testing.assert_close(y, y_ref)
    assert y.is_contiguous()
    for value in (2 ** 32 + 1, 2 ** 31 + 1, -(2 ** 40)):  # 2**32 + 1 would wrap to 1 if narrowed blindly
        huge = idx.long()
        huge[0, 1] = value
        with pytest.raises(megamoe.MegaMoEError, match=rf"topk_idx\[0,1\] = {value} is out of range"):
            megamoe.moe(x, huge, w, w13, w2)


def test_silent_coercions_are_refused():
    x, idx, w, w13, w2 = (t.detach() for t in random_inputs())
    cases = [
        ((x, idx.float() + 0.7, w, w13, w2), r"topk_idx: expected int32 or int64 expert ids, got torch.float32"),
        ((x, idx.bool(), w, w13, w2), r"topk_idx: expected int32 or int64 expert ids, got torch.bool"),
        ((x, idx.to(torch.int16), w, w13, w2), r"topk_idx: expected int32 or int64 expert ids, got torch.int16"),
        ((x.to(torch.int8), idx, w, w13, w2), r"x: dtype torch.int8 is not supported on cpu"),
        ((x.to(torch.complex64), idx, w, w13, w2), r"x: dtype torch.complex64 is not supported on cpu"),
        ((x.half(), idx, w, w13, w2), r"x: dtype torch.float16 .*\(float16 would be computed with bfloat16 rounding"),
        ((x, idx, idx, w13, w2), r"topk_weights: expected a bfloat16, float32 or float64 tensor, got torch.int(32|64)"),
        ((x, idx, w, w13.half(), w2), r"w13: expected a bfloat16, float32 or float64 tensor, got torch.float16"),
        ((x, idx, w, w13, w2.to(torch.complex128)), r"w2: expected a bfloat16, float32 or float64 tensor"),
    ]
    for args, pattern in cases:
        with pytest.raises(TypeError, match=pattern):
            megamoe.moe(*args)
    with pytest.raises(TypeError, match="workspace"):  # no per-layer state to hand in (and none ignored)
        megamoe.moe(x, idx, w, w13, w2, workspace=None)


@cuda_only
def test_cuda_interleaved_calls_keep_their_own_state():
    # Two layers' forwards, then their backwards in reverse, the second larger
    # (its scratch reuses and outgrows the first's): gradients equal isolated runs.
    a = random_inputs(T=300, H=256, I=128, E=8, k=2, dtype=torch.bfloat16, device="cuda", seed=1)
    b = random_inputs(T=700, H=256, I=128, E=8, k=2, dtype=torch.bfloat16, device="cuda", seed=2)
    alone = [grads(megamoe.moe, inputs) for inputs in (a, b)]
    for t in a + b:
        t.grad = None
    ya = megamoe.moe(*a)
    yb = megamoe.moe(*b)  # larger: the scratch grows
    for y, inputs, ref in ((yb, b, alone[1]), (ya, a, alone[0])):
        dy = torch.linspace(-1, 1, y.numel(), dtype=y.dtype, device=y.device).reshape(y.shape)
        (y * dy).sum().backward()
        for got, want in zip([inputs[0].grad, inputs[2].grad, inputs[3].grad, inputs[4].grad], ref[1:]):
            assert torch.equal(got, want)
    assert megamoe.memory_stats()["scratch_bytes"] >= megamoe.buffer_sizes(700, 256, 128, 8, 2)[0]
    megamoe.check()


@cuda_only
def test_cuda_bad_ids_raise_at_the_next_call_at_check_and_with_validate(monkeypatch):
    x, idx, w, w13, w2 = random_inputs(T=256, H=256, I=128, E=8, k=2, dtype=torch.bfloat16, device="cuda",
                                       drop=False)
    bad = idx.clone()
    bad[5, 1] = 8  # E = 8: out of range
    pattern = r"topk_idx\[5,1\] = 8 is out of range \[-1, num_experts = 8\)"
    y = megamoe.moe(x.detach(), bad, w.detach(), w13.detach(), w2.detach())  # no exception, no sync
    with pytest.raises(megamoe.MegaMoEError, match=pattern):
        megamoe.check()
    assert torch.isnan(y).all()
    megamoe.moe(x.detach(), bad, w.detach(), w13.detach(), w2.detach())
    torch.cuda.synchronize()  # the failing kernel has run: the next call raises
    with pytest.raises(megamoe.MegaMoEError, match=pattern):
        megamoe.moe(x.detach(), idx, w.detach(), w13.detach(), w2.detach())
    with pytest.raises(megamoe.MegaMoEError, match=pattern):
        megamoe.moe(x.detach(), bad, w.detach(), w13.detach(), w2.detach(), validate=True)
    monkeypatch.setenv("MEGAMOE_CHECK", "1")
    with pytest.raises(megamoe.MegaMoEError, match=pattern):
        megamoe.moe(x.detach(), bad, w.detach(), w13.detach(), w2.detach())
    monkeypatch.delenv("MEGAMOE_CHECK")
    huge = bad.long()
    huge[5, 1] = 2 ** 31 + 1  # saturates to the int32 limit on the way in; the message says so
    with pytest.raises(megamoe.MegaMoEError, match=r"topk_idx\[5,1\] = 2147483647 \(or beyond: int64 ids are "):
        megamoe.moe(x.detach(), huge, w.detach(), w13.detach(), w2.detach(), validate=True)
    with pytest.raises(ValueError, match=r"w13 is on cpu but x is on cuda:0"):
        megamoe.moe(x.detach(), idx, w.detach(), w13.detach().cpu(), w2.detach())
    with pytest.raises(TypeError, match=r"x: dtype torch.float32 is not supported on cuda: expected bfloat16"):
        megamoe.moe(x.detach().float(), idx, w.detach(), w13.detach(), w2.detach())
    megamoe.check()  # nothing left pending
    y = megamoe.moe(x.detach(), idx, w.detach(), w13.detach(), w2.detach())
    assert torch.isfinite(y).all()


@cuda_only
def test_cuda_inference_saves_nothing():
    x, idx, w, w13, w2 = random_inputs(T=256, H=256, I=128, E=8, k=2, dtype=torch.bfloat16, device="cuda")
    with torch.inference_mode():
        megamoe.moe(x, idx, w, w13, w2)  # warm-up: scratch
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = megamoe.moe(x, idx, w, w13, w2)
        assert torch.cuda.memory_allocated() - before == y.numel() * y.element_size()


def test_backward_writes_no_gradient_for_the_saved_buffer():
    # The forward's uint8 `saved` output has no gradient; autograd must not
    # zero-fill one of its size on every backward (134 us at Qwen3-30B-A3B).
    x, idx, w, w13, w2 = random_inputs(dtype=torch.bfloat16)
    y = megamoe.moe(x, idx, w, w13, w2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y.sum().backward()
    # (sum's backward fills its ones with aten::fill_; a materialised gradient comes from aten::zeros.)
    zeros = [e.name for e in prof.events() if e.name in ("aten::zeros", "aten::zeros_like", "aten::zero_")]
    assert zeros == [], zeros
    assert x.grad is not None and w13.grad is not None


def test_forward_output_unused_in_the_loss_gives_no_gradients():
    x, idx, w, w13, w2 = random_inputs()
    y = megamoe.moe(x, idx, w, w13, w2)
    (x.sum() + 0 * y.detach().sum()).backward()  # y itself is not on the loss's graph
    assert w13.grad is None and w.grad is None


@cuda_only
def test_cuda_fp8_weights_are_quantised_once_per_optimizer_step(monkeypatch):
    from megamoe import _memory
    fills = []
    real_fill = _memory.fill_fp8_weights
    monkeypatch.setattr(_memory, "fill_fp8_weights", lambda *a: (fills.append(a[3]), real_fill(*a))[1])
    x, idx, w, w13, w2 = random_inputs(T=256, H=256, I=128, E=8, k=2, dtype=torch.bfloat16, device="cuda", drop=False)
    w13, w2 = torch.nn.Parameter(w13.detach()), torch.nn.Parameter(w2.detach())

    def step():
        y = megamoe.moe(x.detach(), idx, w.detach(), w13, w2, precision="fp8")
        y.float().square().sum().backward()
        return y.detach()

    y1 = step()
    assert fills == ["fp8"]  # the forward filled it, the backward read it
    assert megamoe.memory_stats()["fp8_weight_bytes"] >= megamoe.fp8_weight_bytes(256, 128, 8, 2, "fp8")
    assert torch.equal(step(), y1) and fills == ["fp8"]  # same weights: no refill, same result
    torch.optim.AdamW([w13, w2], lr=1e-2, fused=True).step()  # no version bump: the step hook marks it stale
    y2 = step()
    assert len(fills) == 2 and not torch.equal(y2, y1)
    fresh = megamoe.moe(x.detach(), idx, w.detach(), w13.detach(), w2.detach(), precision="fp8",
                        fp8_weight_cache=False)
    assert torch.equal(y2, fresh)  # the cached weights are the new ones
    with torch.no_grad():
        w2.mul_(0.5)  # an in-place change outside any optimizer: its version counter says so
    step()
    assert len(fills) == 4  # (the uncached call above filled one of its own)
    fills.clear()
    megamoe.moe(x.detach(), idx, w.detach(), w13, w2, precision="fp8_bwd",
                fp8_weight_cache=False).float().sum().backward()
    assert fills == ["fp8_bwd"]  # no cache: the backward quantises its own (the bf16 forward reads none)


@cuda_only
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_cuda_fp8_weights_are_cached_under_torch_compile(monkeypatch, precision, backend):
    # Compiled (fullgraph, with checkpointing: forward, recomputed forward,
    # backward), the ops look the layer's FP8 weights up in their bodies: one
    # fill per optimizer step, as in eager mode, and the results of weights
    # quantised afresh (the cache off), before and after a step.
    from megamoe import _memory
    torch._dynamo.reset()
    fills = []
    real_fill = _memory.fill_fp8_weights
    monkeypatch.setattr(_memory, "fill_fp8_weights", lambda *a: (fills.append(a[3]), real_fill(*a))[1])
    torch.manual_seed(0)
    layer = megamoe.MoE(256, 128, 8, 2, precision=precision, device="cuda", dtype=torch.bfloat16)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    compiled = torch.compile(lambda h: checkpoint(layer, h, use_reentrant=False), backend=backend, fullgraph=True)
    h = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)

    def step(fn):
        hh = h.detach().clone().requires_grad_()
        y = fn(hh)
        y.float().square().sum().backward()
        return y.detach(), hh.grad

    def fresh():  # eager, the cache off: this call quantises the current weights itself
        layer.experts._megamoe_config["fp8_weight_cache"] = False
        try:
            return step(layer)
        finally:
            layer.experts._megamoe_config["fp8_weight_cache"] = True

    def rel(a, b):  # relative Frobenius distance
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    g_before = None
    for round_ in range(2):
        fills.clear()
        y, g = step(compiled)
        assert fills == [precision], fills  # one fill, for the forward, its recomputation and the backward
        layer.zero_grad()
        step(compiled)
        assert fills == [precision]  # the same weights: no refill
        layer.zero_grad()
        y_ref, g_ref = fresh()
        if backend == "aot_eager":  # the same kernels on the same values: the same bits
            assert torch.equal(y, y_ref) and torch.equal(g, g_ref), round_
        else:  # inductor's router may round differently, and a few e4m3 roundings flip with it
            # (measured: 2 of 16384 dx elements one bf16 step apart); stale weights move far more
            assert rel(y, y_ref) < 5e-3 and rel(g, g_ref) < 5e-3, (round_, rel(y, y_ref), rel(g, g_ref))
            if g_before is not None:  # the step moved dx 10x further than any rounding flip
                assert rel(g, g_ref) < 0.1 * rel(g_before, g_ref), (rel(g, g_ref), rel(g_before, g_ref))
        g_before = g
        if round_ == 0:
            opt.step()  # new weights: the next compiled call quantises them once
        layer.zero_grad()


def test_fp8_weight_bytes_hold_both_orientations_and_the_scales():
    H, I, E = 2048, 768, 128
    scales = 4 * E * (2 * I // 128) * (H // 128) + 4 * E * (H // 128) * (I // 128)
    align = lambda n: (n + 255) // 256 * 256
    assert megamoe.fp8_weight_bytes(H, I, E, 8, "bf16") == 0
    fp8_bwd = megamoe.fp8_weight_bytes(H, I, E, 8, "fp8_bwd")  # the transposed copies only
    assert fp8_bwd >= 3 * E * I * H + scales and fp8_bwd <= 3 * E * I * H + scales + 4 * 256
    fp8 = megamoe.fp8_weight_bytes(H, I, E, 8, "fp8")  # and the forward's orientation
    assert fp8 - fp8_bwd == align(2 * E * I * H) + align(E * H * I)


@cuda_only
def test_cuda_fp8_weights_first_used_under_inference_mode_then_trained():
    x, idx, w, w13, w2 = random_inputs(T=128, H=256, I=128, E=8, k=2, dtype=torch.bfloat16, device="cuda", drop=False)
    w13, w2 = torch.nn.Parameter(w13.detach()), torch.nn.Parameter(w2.detach())
    with torch.inference_mode():  # an evaluation before training: the kept buffer must stay a normal tensor
        y_eval = megamoe.moe(x.detach(), idx, w.detach(), w13, w2, precision="fp8")
    with torch.no_grad():
        w13.mul_(1.5)  # changed since the evaluation: refilled outside inference mode
    y = megamoe.moe(x.detach(), idx, w.detach(), w13, w2, precision="fp8")
    y.float().sum().backward()
    assert not torch.equal(y.detach(), y_eval) and w13.grad is not None


def test_modules_pass_the_fp8_weight_cache_choice_through(monkeypatch):
    import megamoe.modules as modules
    seen = []
    monkeypatch.setattr(modules, "moe", lambda *a, **kw: (seen.append(kw), a[0])[1])
    layer = megamoe.MoE(64, 32, 4, 2, precision="fp8", fp8_weight_cache=False, fp8_scale="pow2")
    layer(torch.randn(3, 64))
    assert seen[-1]["precision"] == "fp8" and seen[-1]["fp8_weight_cache"] is False
    assert seen[-1]["fp8_scale"] == "pow2"
    megamoe.MoE(64, 32, 4, 2)(torch.randn(3, 64))
    assert seen[-1]["fp8_weight_cache"] is True and seen[-1]["fp8_scale"] == "fp32"  # the defaults


# What the compiled FP8 weight cache relies on (megamoe/_memory.py, "FP8 weights"): under
# torch.compile a custom op's body receives the bf16 parameters as the
# Parameter objects themselves, forward, recomputed forward (checkpointing)
# and backward, with their version counters, so the cache sees optimizer
# steps. A PyTorch that passed copies or plain aliases would make the
# compiled cache miss on every call: this test says so first.
@torch.library.custom_op("megamoe_test::seen_weight", mutates_args=())
def _seen_weight(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    _SEEN.append(("fwd", w, w._version))
    return x @ w


@_seen_weight.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op("megamoe_test::seen_weight_bwd", mutates_args=())
def _seen_weight_bwd(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    _SEEN.append(("bwd", w, w._version))
    return g @ w.t()


@_seen_weight_bwd.register_fake
def _(g, w):
    return g.new_empty(g.shape[0], w.shape[0])


def _seen_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _seen_backward(ctx, g):
    x, w = ctx.saved_tensors
    return _seen_weight_bwd(g, w), x.t() @ g


_seen_weight.register_autograd(_seen_backward, setup_context=_seen_setup)
_SEEN: list = []


class _SeenLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.bfloat16))

    def forward(self, x):
        return torch.relu(_seen_weight(x, self.w.to(torch.bfloat16)))  # megamoe.moe's w13.to(compute)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_ops_see_the_parameters_themselves(backend, checkpointing):
    torch._dynamo.reset()
    _SEEN.clear()
    layer = _SeenLayer()
    fn = (lambda x: checkpoint(layer, x, use_reentrant=False)) if checkpointing else layer
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for step in range(2):
        compiled(torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)).float().sum().backward()
        opt.step()
    calls = ["fwd", "fwd", "bwd"] if checkpointing else ["fwd", "bwd"]
    assert [c for c, _, _ in _SEEN] == calls * 2, _SEEN
    assert all(w is layer.w for _, w, _ in _SEEN), [type(w) for _, w, _ in _SEEN]
    assert [v for _, _, v in _SEEN] == [0] * len(calls) + [1] * len(calls)
