"""The megamoe op against plain PyTorch, autograd, checkpointing, compile, errors."""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import megamoe
from conftest import cuda_only
from reference_moe import moe_reference, random_inputs


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
    ws = megamoe.Workspace(128, 128, 4, 2, max_tokens=5)
    torch.library.opcheck(torch.ops.megamoe.moe_fwd.default, (x, idx, w, w13, w2, ws.id))


def test_backward_after_another_forward_recomputes_and_stays_right():
    ws = megamoe.Workspace(128, 128, 4, 2, max_tokens=7)
    a, b = random_inputs(seed=1), random_inputs(seed=2)
    ya = megamoe.moe(*a, workspace=ws)
    yb = megamoe.moe(*b, workspace=ws)  # the workspace now holds b's forward
    ya.sum().backward()
    yb.sum().backward()
    ref = random_inputs(seed=1)
    moe_reference(*ref).sum().backward()
    torch.testing.assert_close(a[3].grad, ref[3].grad, rtol=1e-10, atol=1e-12)


def test_activation_checkpointing_gives_the_same_gradients():
    layer = megamoe.MoE(128, 128, 4, 2, max_tokens=16, dtype=torch.float64)
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
    layer = megamoe.MoE(128, 128, 4, 2, max_tokens=16, dtype=torch.float64)
    h = torch.randn(16, 128, dtype=torch.float64, requires_grad=True)
    eager_y = layer(h)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    y = compiled(h)
    torch.testing.assert_close(y, eager_y)
    y.sum().backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()


def test_bad_inputs_give_clear_errors():
    x, idx, w, w13, w2 = random_inputs()
    bad = idx.clone()
    bad[1, 0] = 9
    with pytest.raises(megamoe.MegaMoEError, match=r"topk_idx\[1,0\] = 9 is out of range"):
        megamoe.moe(x, bad, w, w13, w2)
    ws = megamoe.Workspace(128, 128, 4, 2, max_tokens=4)
    with pytest.raises(megamoe.MegaMoEError, match="exceeds max_tokens_per_rank = 4"):
        megamoe.moe(x, idx, w, w13, w2, workspace=ws)
    ws7 = megamoe.Workspace(128, 128, 4, 2, max_tokens=7)
    with pytest.raises(megamoe.MegaMoEError, match=r"w13: expected shape \[4, 256, 128\], got \[4, 128, 128\]"):
        megamoe.moe(x, idx, w, w13[:, :128], w2, workspace=ws7)
    with pytest.raises(ValueError, match="precision='fp16'"):
        megamoe.Workspace(128, 128, 4, 2, max_tokens=4, precision="fp16")


@cuda_only
def test_cuda_matches_cpu_reference_and_adds_no_host_sync():
    cpu = random_inputs(T=300, H=256, I=128, E=8, k=2, dtype=torch.bfloat16)
    gpu = random_inputs(T=300, H=256, I=128, E=8, k=2, dtype=torch.bfloat16, device="cuda")
    ref = grads(megamoe.moe, cpu)
    ws = megamoe.Workspace(256, 128, 8, 2, max_tokens=300, device="cuda")
    megamoe.moe(*gpu, workspace=ws)  # warm-up: module load, tensor-map encoder
    for t in gpu:
        t.grad = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        ours = grads(lambda *a: megamoe.moe(*a, workspace=ws), gpu)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for a, b in zip(ours, ref):
        err = (a.cpu().double() - b.double()).norm() / b.double().norm()
        assert err < 1e-2, err
    ws.check_device_errors()


@cuda_only
def test_cuda_forward_backward_capture_in_a_graph():
    gpu = random_inputs(T=256, H=256, I=128, E=8, k=2, dtype=torch.bfloat16, device="cuda", drop=False)
    x, idx, w, w13, w2 = (t.detach() for t in gpu)
    w = w.float()  # the raw op takes fp32 routing weights (megamoe.moe casts)
    ws = megamoe.Workspace(256, 128, 8, 2, max_tokens=256, device="cuda")
    dy = torch.randn_like(x)
    eager_y = torch.ops.megamoe.moe_fwd(x, idx, w, w13, w2, ws.id)
    eager = torch.ops.megamoe.moe_bwd(dy, x, idx, w, w13, w2, ws.id)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.megamoe.moe_fwd(x, idx, w, w13, w2, ws.id)
        g = torch.ops.megamoe.moe_bwd(dy, x, idx, w, w13, w2, ws.id)
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
    ws = megamoe.Workspace(256, 128, 8, 2, max_tokens=256, device="cuda")
    dy = torch.randn(x.shape, device="cuda", dtype=x.dtype)
    params = (x, w, w13, w2)

    def step():
        for t in params:
            t.grad = None
        megamoe.moe(x, idx, w, w13, w2, workspace=ws).backward(dy)

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
        megamoe.moe(x, idx, w, w13, w2, workspace=ws).backward(dy)
    for t in params:
        t.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for t, ref in zip(params, eager):
        assert torch.equal(t.grad, ref)
    ws.check_device_errors()


def test_strided_inputs_and_huge_ids():
    x, idx, w, w13, w2 = random_inputs()
    xt = x.detach().t().contiguous().t()  # same values, column-major
    y_ref = megamoe.moe(x.detach(), idx, w.detach(), w13.detach(), w2.detach())
    ws = megamoe.Workspace(128, 128, 4, 2, max_tokens=7)
    y = torch.ops.megamoe.moe_fwd(xt, idx, w.detach(), w13.detach(), w2.detach(), ws.id)
    torch.testing.assert_close(y, y_ref)
    assert y.is_contiguous()
    huge = idx.long()
    huge[0, 0] = 2 ** 32 + 1  # would wrap to 1 if narrowed blindly
    with pytest.raises(megamoe.MegaMoEError, match=r"topk_idx\[0,0\] = 4 is out of range"):
        megamoe.moe(x, huge, w, w13, w2)


def test_workspaces_are_freed_with_their_owner():
    import gc
    from megamoe import ops
    ws = megamoe.Workspace(128, 128, 4, 2, max_tokens=7)
    wid = ws.id
    assert wid in ops._HANDLES
    del ws
    gc.collect()
    assert wid not in ops._HANDLES
