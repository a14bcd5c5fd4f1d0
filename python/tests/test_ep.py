"""Expert parallelism from PyTorch (megamoe.moe(..., group=pg), megamoe.ep).

Two processes, one GPU each, on the 2-GPU machine (scripts/device-test's
pytest-cuda step): each rank its half of a batch and half of the experts; y
and every gradient must be bitwise those of one GPU running the whole batch
with all experts. Elsewhere that test skips and says why; the argument checks
run everywhere.
"""
import pytest
import torch

import megamoe


class _FakeGroup:
    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n


def _inputs(T, H, I, E, k, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(T, H, generator=g) * 2 - 1).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, k, generator=g).to(torch.float32)
    w13 = ((torch.rand(E, 2 * I, H, generator=g) * 2 - 1) / H ** 0.5).to(torch.bfloat16)
    w2 = ((torch.rand(E, H, I, generator=g) * 2 - 1) / I ** 0.5).to(torch.bfloat16)
    dy = (torch.rand(T, H, generator=g) * 2 - 1).to(torch.bfloat16)
    return [t.to(device) for t in (x, idx, w, w13, w2, dy)]


def _two_ranks(rank: int, init_file: str, precision: str = "bf16") -> None:
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    try:
        H, I, E, k = 256, 256, 8, 2
        counts = (290, 310)  # uneven: max_tokens is agreed as 310
        T, L = sum(counts), E // 2
        s = slice(sum(counts[:rank]), sum(counts[:rank + 1]))
        e = slice(rank * L, (rank + 1) * L)
        for call in range(2):  # the buffer's epochs move on from call to call
            x, idx_a, w_a, w13_a, w2_a, dy = _inputs(T, H, I, E, k, f"cuda:{rank}", seed=7 + call)
            _, idx_b, w_b, w13_b, w2_b, _ = _inputs(T, H, I, E, k, f"cuda:{rank}", seed=70 + call)
            idx_a[::7, 1] = -1  # dropped routes
            # Two layers sharing one buffer, in training's order (forward a, forward b,
            # backward b, backward a), with a no-grad forward (an eval) in between.
            # FP8: the second layer with power-of-two scales.
            def two_layers(x, wa, w13a, w2a, wb, w13b, w2b, ids_a, ids_b, group=None):
                h = megamoe.moe(x, ids_a, wa, w13a, w2a, group=group, precision=precision)
                return megamoe.moe(h, ids_b, wb, w13b, w2b, group=group, precision=precision,
                                   fp8_scale="fp32" if precision == "bf16" else "pow2")

            full = [t.clone().requires_grad_() for t in (x, w_a, w13_a, w2_a, w_b, w13_b, w2_b)]
            y1 = two_layers(*full, idx_a, idx_b)
            y1.backward(dy)
            mine = [t.clone().requires_grad_() for t in (x[s], w_a[s], w13_a[e], w2_a[e], w_b[s], w13_b[e], w2_b[e])]
            y2 = two_layers(*mine, idx_a[s], idx_b[s], group=dist.group.WORLD)
            with torch.no_grad():
                y_eval = two_layers(*mine, idx_a[s], idx_b[s], group=dist.group.WORLD)
            y2.backward(dy[s])
            megamoe.check()
            assert torch.equal(y_eval, y2), f"rank {rank}: a no-grad forward differs"
            pairs = {"y": (y2, y1[s]), "dx": (mine[0].grad, full[0].grad[s])}
            for i, name in enumerate(("d_topk_weights a", "dw13 a", "dw2 a", "d_topk_weights b", "dw13 b", "dw2 b")):
                sl = s if name.startswith("d_topk") else e
                pairs[name] = (mine[i + 1].grad, full[i + 1].grad[sl])
            for name, (got, want) in pairs.items():
                assert torch.equal(got, want), f"rank {rank}, call {call}, {precision}: {name} differs from one GPU's"
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (the 2-GPU machine runs it)")
@pytest.mark.parametrize("precision", ["bf16", "fp8", "fp8_bwd"])
def test_cuda_ep2_is_bitwise_one_gpu_forward_and_backward(tmp_path, precision):
    import torch.multiprocessing as mp
    mp.spawn(_two_ranks, args=(str(tmp_path / "init"), precision), nprocs=2, join=True)


def test_ep_refuses_cpu_tensors_and_other_modes():
    x, idx, w, w13, w2, _ = _inputs(16, 128, 128, 4, 2, "cpu", seed=1)
    with pytest.raises(ValueError, match="CUDA tensors only"):
        megamoe.moe(x, idx, w, w13[:2], w2[:2], group=_FakeGroup(2))
    for kwargs, message in (({"save": "recompute"}, "runs save='keep'"),
                            ({"precision": "mxfp8"}, "mxfp8' needs Blackwell")):
        with pytest.raises(NotImplementedError, match=message):
            megamoe.moe(x, idx, w, w13[:2], w2[:2], group=_FakeGroup(2), **kwargs)
    # A group of one rank is the one-GPU layer.
    y = megamoe.moe(x, idx, w, w13, w2, group=_FakeGroup(1))
    assert torch.equal(y, megamoe.moe(x, idx, w, w13, w2))


def test_ep_sizes_follow_the_layouts():
    from megamoe._abi import ep_sizes
    try:
        a = ep_sizes(2048, 768, 128, 8, world=2, max_tokens=1024)
    except megamoe.MegaMoEError as e:  # a build without CUDA says so
        if "built without CUDA" in str(e):
            pytest.skip(str(e))
        raise
    b = ep_sizes(2048, 768, 128, 8, world=2, max_tokens=2048)
    alone = ep_sizes(2048, 768, 128, 8, world=2, max_tokens=1024, will_backward=False)
    assert alone["saved"] == 0 and a["saved"] > 0
    for key in ("symmetric", "ep_scratch", "scratch", "saved"):
        assert b[key] > a[key] > 0 or key == "saved" and b[key] > a[key], (key, a, b)
        assert a[key] % 256 == 0, (key, a[key])
    # The receive area alone: every other rank's max_tokens rows of H bf16.
    assert a["symmetric"] > 2 * 1024 * 2048 * 2
    with pytest.raises(megamoe.MegaMoEError, match="not divisible by ep_size"):
        ep_sizes(2048, 768, 128, 8, world=3, max_tokens=1024)
    # FP8: the owner's e4m3 operands in its scratch; the symmetric buffer (bf16 rows) and EP scratch as bf16's.
    for precision, scale in (("fp8", "fp32"), ("fp8_bwd", "fp32"), ("fp8", "pow2")):
        f = ep_sizes(2048, 768, 128, 8, world=2, max_tokens=1024, precision=precision, fp8_scale=scale)
        assert f["scratch"] > a["scratch"] and f["scratch"] % 256 == 0, (precision, scale, f, a)
        assert (f["symmetric"], f["ep_scratch"], f["saved"]) == (a["symmetric"], a["ep_scratch"], a["saved"]), precision
    with pytest.raises(megamoe.MegaMoEError, match="mxfp8 needs Blackwell"):
        ep_sizes(2048, 768, 128, 8, world=2, max_tokens=1024, precision="mxfp8")


def test_ep_fp8_weight_bytes_are_this_ranks_experts():
    """megamoe_fp8_weight_bytes with ep_size P: the buffer of one rank's E / P experts, which the Python
    weight cache fills from w13 [E/P, 2I, H] as a one-GPU layer of E / P experts."""
    import ctypes
    from megamoe import _abi
    cfg = _abi.config(2048, 768, 128, 8, precision="fp8")
    one_rank = ctypes.c_uint64()
    for world in (2, 4, 8):
        cfg.ep_size = world
        _abi.check(_abi.lib().megamoe_fp8_weight_bytes(ctypes.byref(cfg), ctypes.byref(one_rank)))
        assert one_rank.value == _abi.fp8_weight_bytes(2048, 768, 128 // world, 1, "fp8") > 0, world
    assert _abi.fp8_weight_bytes(2048, 768, 64, 1, "fp8") < _abi.fp8_weight_bytes(2048, 768, 128, 1, "fp8")


class _RankGroup(_FakeGroup):
    def __init__(self, n, r):
        super().__init__(n)
        self.r = r

    def rank(self):
        return self.r


def test_modules_hold_this_ranks_experts():
    from megamoe.modules import MegaMoEExperts, MoE, use_megamoe_experts
    experts = MegaMoEExperts(8, 128, 64, 2, ep_group=_RankGroup(4, 1))
    assert tuple(experts.gate_up_proj.shape) == (2, 128, 128) and tuple(experts.down_proj.shape) == (2, 128, 64)
    layer = MoE(128, 64, 8, 2, ep_group=_RankGroup(2, 0))
    assert layer.gate.out_features == 8 and layer.experts.gate_up_proj.shape[0] == 4
    with pytest.raises(ValueError, match="do not split evenly"):
        MegaMoEExperts(6, 128, 64, 2, ep_group=_RankGroup(4, 0))

    class HfExperts(torch.nn.Module):  # the transformers v5 layout
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.arange(8 * 4 * 3, dtype=torch.float32).reshape(8, 4, 3))
            self.down_proj = torch.nn.Parameter(torch.arange(8 * 3 * 2, dtype=torch.float32).reshape(8, 3, 2))

    model = torch.nn.Sequential(HfExperts())
    full_gu = model[0].gate_up_proj.detach().clone()
    assert use_megamoe_experts(model, ep_group=_RankGroup(4, 3)) == 1
    assert torch.equal(model[0].gate_up_proj, full_gu[6:8]) and model[0].down_proj.shape[0] == 2
    assert model[0]._megamoe_config["ep_group"].rank() == 3
