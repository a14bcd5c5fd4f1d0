"""The Hugging Face Qwen3-MoE drop-in and the trainer."""
import math
from pathlib import Path

import pytest
import torch

import megamoe
from megamoe import train

transformers = pytest.importorskip("transformers")


def tiny_model(seed=0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=128, intermediate_size=128, moe_intermediate_size=128,
                         num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, norm_topk_prob=True, decoder_sparse_step=1)
    cfg._experts_implementation = "eager"
    model = Qwen3MoeForCausalLM(cfg)
    for p in model.parameters():  # transformers leaves expert weights uninitialised in some versions
        if p.dim() == 3:
            torch.nn.init.normal_(p, std=0.05)
    return model


def loss_and_grads(model, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_swapped_experts_give_the_same_loss_and_gradients():
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    base = tiny_model()
    loss_a, grads_a = loss_and_grads(base, ids)
    swapped = tiny_model()
    names_before = [n for n, _ in swapped.named_parameters()]
    assert megamoe.use_megamoe_experts(swapped) == 2
    assert [n for n, _ in swapped.named_parameters()] == names_before  # checkpoint names unchanged
    loss_b, grads_b = loss_and_grads(swapped, ids)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    for n in grads_a:
        torch.testing.assert_close(grads_b[n], grads_a[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_swapped_model_runs_inference(mode):
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    base, swapped = tiny_model(), tiny_model()
    megamoe.use_megamoe_experts(swapped)
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        want = base(input_ids=ids).logits
        got = swapped(input_ids=ids).logits
    assert not got.requires_grad
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_swap_refuses_a_model_without_moe_experts():
    with pytest.raises(ValueError, match="no MoE experts module"):
        megamoe.use_megamoe_experts(torch.nn.Linear(4, 4))


def write(tmp_path, text):
    p = tmp_path / "cfg.toml"
    p.write_text(text)
    return str(p)


TINY = """
[model]
preset = "tiny"
num_layers = 1
[trainer]
steps = 25
batch_size = 4
seq_len = 32
lr = 3e-3
device = "cpu"
[trainer.model.moe.dispatch]
type = "{dispatch}"
precision = "{precision}"
"""


def test_tiny_trainer_loss_decreases(tmp_path):
    cfg = train.load_config(write(tmp_path, TINY.format(dispatch="mega_moe", precision="bf16")))
    history = train.train(cfg)
    first = sum(h["loss"] for h in history[:3]) / 3
    last = sum(h["loss"] for h in history[-3:]) / 3
    assert last < 0.8 * first, (first, last)


def test_a_run_ends_with_a_summary_line(tmp_path, capsys):
    assert train.main(["--config", write(tmp_path, TINY.format(dispatch="mega_moe", precision="bf16")),
                       "--steps", "2"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("megamoe.train: done: 2 steps of tiny x 1 layers, dispatch mega_moe (bf16) on cpu; loss ")
    assert "median step" in last and "tok/s" in last


def test_mega_moe_and_eager_trainers_agree_on_the_first_steps(tmp_path):
    runs = {}
    for dispatch in ("mega_moe", "eager"):
        cfg = train.load_config(write(tmp_path, TINY.format(dispatch=dispatch, precision="bf16")))
        cfg.steps = 3
        runs[dispatch] = [h["loss"] for h in train.train(cfg)]
    for a, b in zip(runs["mega_moe"], runs["eager"]):
        assert abs(a - b) < 1e-4 * max(1.0, abs(b)), runs


@pytest.mark.parametrize("dispatch,precision,device,message", [
    ("magic", "bf16", "cpu", "dispatch.type = 'magic'"),
    ("mega_moe", "fp16", "cpu", "dispatch.precision = 'fp16'"),
    ("grouped_mm", "fp8", "cpu", "needs type = 'mega_moe'"),
])
def test_bad_trainer_options_fail_at_start_up(tmp_path, dispatch, precision, device, message):
    text = TINY.format(dispatch=dispatch, precision=precision).replace('device = "cpu"', f'device = "{device}"')
    with pytest.raises(train.ConfigError, match=message):
        train.load_config(write(tmp_path, text))
    assert train.main(["--config", write(tmp_path, text)]) == 2


def test_cuda_only_options_are_named(tmp_path):
    if torch.cuda.is_available():
        text = TINY.format(dispatch="mega_moe", precision="mxfp8").replace('device = "cpu"', 'device = "cuda"')
        with pytest.raises(train.ConfigError, match="mxfp8' needs Blackwell"):
            train.load_config(write(tmp_path, text))
    else:
        text = TINY.format(dispatch="mega_moe", precision="bf16").replace('device = "cpu"', 'device = "cuda"')
        with pytest.raises(train.ConfigError, match="trainer.device = 'cuda' but no CUDA device"):
            train.load_config(write(tmp_path, text))


def test_expert_parallel_options_are_checked_at_start_up(tmp_path):
    base = TINY.format(dispatch="mega_moe", precision="bf16")
    with pytest.raises(train.ConfigError, match="ep = 2 needs type = 'mega_moe' on CUDA"):  # TINY runs on the CPU
        train.load_config(write(tmp_path, base.replace('precision = "bf16"', 'precision = "bf16"\nep = 2')))
    with pytest.raises(train.ConfigError, match="dispatch.ep = 0"):
        train.load_config(write(tmp_path, base.replace('precision = "bf16"', 'precision = "bf16"\nep = 0')))


def _losses(cmd, tmp_path, name):
    import json
    import subprocess
    import sys
    out = tmp_path / f"{name}.json"
    subprocess.run([sys.executable, "-m", *cmd, "--steps", "12", "--json", str(out)], check=True, timeout=600)
    return [h["loss"] for h in json.loads(out.read_text())]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (the 2-GPU machine runs it)")
def test_cuda_ep2_training_follows_the_one_gpu_run(tmp_path):
    """torchrun --nproc-per-node 2 with ep = 2 against one GPU on the same global batch."""
    root = Path(__file__).resolve().parents[2]
    one = _losses(["megamoe.train", "--config", str(root / "configs" / "tiny-cuda.toml")], tmp_path, "one")
    two = _losses(["torch.distributed.run", "--nproc-per-node", "2", "-m", "megamoe.train", "--config",
                   str(root / "configs" / "tiny-ep2.toml")], tmp_path, "two")
    assert len(one) == len(two) == 12
    # The first step's loss is the same model on the same tokens: equal up to bf16 reduction order.
    assert abs(one[0] - two[0]) < 1e-2 * abs(one[0]), (one, two)
    # Then the runs drift only as far as bf16 data-parallel training does.
    assert max(abs(a - b) / abs(a) for a, b in zip(one, two)) < 0.03, (one, two)
    assert two[-1] < two[0] - 0.5, two  # and it learns


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (the 2-GPU machine runs it)")
def test_cuda_ep2_fp8_training_follows_the_one_gpu_fp8_run(tmp_path):
    """precision fp8 with ep = 2 (the owners' GEMMs in e4m3) against one GPU in fp8 on the same global batch."""
    root = Path(__file__).resolve().parents[2]
    configs = {}
    for name in ("tiny-cuda", "tiny-ep2"):
        text = (root / "configs" / f"{name}.toml").read_text()
        assert 'precision = "bf16"' in text, name
        configs[name] = tmp_path / f"{name}-fp8.toml"
        configs[name].write_text(text.replace('precision = "bf16"', 'precision = "fp8"'))
    one = _losses(["megamoe.train", "--config", str(configs["tiny-cuda"])], tmp_path, "one")
    two = _losses(["torch.distributed.run", "--nproc-per-node", "2", "-m", "megamoe.train", "--config",
                   str(configs["tiny-ep2"])], tmp_path, "two")
    assert len(one) == len(two) == 12
    assert abs(one[0] - two[0]) < 1e-2 * abs(one[0]), (one, two)
    assert max(abs(a - b) / abs(a) for a, b in zip(one, two)) < 0.03, (one, two)
    assert two[-1] < two[0] - 0.5, two


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_fp8_training_tracks_bf16(tmp_path):
    """precision fp8 and fp8_bwd on the GPU: the same model, data and seed as bf16; the first loss of
    fp8_bwd is bf16's (its forward is BF16), fp8's within e4m3's error; all losses finite and falling."""
    runs = {}
    for precision in ("bf16", "fp8", "fp8_bwd"):
        text = TINY.format(dispatch="mega_moe", precision=precision).replace('device = "cpu"', 'device = "cuda"')
        text = text.replace("[trainer]\n", '[trainer]\ndtype = "bfloat16"\n')
        cfg = train.load_config(write(tmp_path, text))
        cfg.steps = 20
        runs[precision] = [h["loss"] for h in train.train(cfg)]
    bf16 = runs["bf16"]
    assert abs(runs["fp8_bwd"][0] - bf16[0]) <= 1e-6 * abs(bf16[0]), runs
    assert abs(runs["fp8"][0] - bf16[0]) <= 2e-2 * abs(bf16[0]), runs
    for precision in ("fp8", "fp8_bwd"):
        losses = runs[precision]
        assert all(math.isfinite(v) for v in losses), runs
        assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, runs
        assert abs(losses[-1] - bf16[-1]) <= 0.1 * abs(bf16[-1]), runs


def test_compiled_trainer_follows_the_eager_one(tmp_path):
    # trainer.compile: every decoder layer under torch.compile (megamoe's ops opaque in the
    # graph); the same losses as the eager layers on the same weights and data.
    runs = {}
    for compiled in (False, True):
        cfg = train.load_config(write(tmp_path, TINY.format(dispatch="mega_moe", precision="bf16")))
        cfg.steps, cfg.compile = 2, compiled
        runs[compiled] = [h["loss"] for h in train.train(cfg)]
    for a, b in zip(runs[True], runs[False]):
        assert abs(a - b) < 1e-4 * max(1.0, abs(b)), runs


def test_compile_with_expert_parallelism_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    text = TINY.format(dispatch="mega_moe", precision="bf16").replace(
        "[trainer.model.moe.dispatch]", "compile = true\n[trainer.model.moe.dispatch]\nep = 2")
    with pytest.raises(train.ConfigError, match="trainer.compile = true with trainer.model.moe.dispatch.ep = 2"):
        train.load_config(write(tmp_path, text))
