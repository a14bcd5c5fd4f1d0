"""A small trainer: python -m megamoe.train --config FILE.toml

Builds a Qwen3-MoE causal LM (transformers, random weights, never
downloaded) at a preset's layer shapes, picks the MoE experts implementation
from [trainer.model.moe.dispatch], trains on a byte-level synthetic corpus
(or a text file) and logs loss, step time and tokens/s.

    [model]
    preset = "tiny"            # tiny | qwen3-30b-a3b | qwen3-235b-a22b
    num_layers = 2
    [trainer]
    steps = 30
    batch_size = 4
    seq_len = 128
    lr = 1e-3
    device = "auto"            # auto | cpu | cuda
    dtype = "float32"          # float32 | bfloat16 (CUDA needs bfloat16 for mega_moe)
    activation_checkpointing = false
    seed = 0
    [trainer.model.moe.dispatch]
    type = "mega_moe"          # mega_moe | grouped_mm | eager
    precision = "bf16"         # bf16 | fp8 | fp8_bwd | mxfp8
    [data]
    path = "synthetic"         # synthetic, or a UTF-8 text file
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field

import torch

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib  # type: ignore

PRESETS = {
    # hidden, moe_intermediate, experts, top_k, heads, kv_heads, head_dim
    "tiny": dict(hidden_size=128, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "qwen3-30b-a3b": dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128),
    "qwen3-235b-a22b": dict(hidden_size=4096, moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8,
                            num_attention_heads=64, num_key_value_heads=4, head_dim=128),
}
DISPATCH_TYPES = ("mega_moe", "grouped_mm", "eager")
PRECISIONS = ("bf16", "fp8", "fp8_bwd", "mxfp8")


class ConfigError(ValueError):
    """A bad or unsupported option; the message names it."""


@dataclass
class TrainConfig:
    preset: str = "tiny"
    num_layers: int = 2
    steps: int = 30
    batch_size: int = 4
    seq_len: int = 128
    lr: float = 1e-3
    device: str = "auto"
    dtype: str = "float32"
    activation_checkpointing: bool = False
    seed: int = 0
    dispatch: str = "mega_moe"
    precision: str = "bf16"
    data: str = "synthetic"
    log_every: int = 1
    extra: dict = field(default_factory=dict)


def load_config(path: str) -> TrainConfig:
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    model, trainer, data = raw.get("model", {}), raw.get("trainer", {}), raw.get("data", {})
    dispatch = trainer.get("model", {}).get("moe", {}).get("dispatch", {})
    cfg = TrainConfig(
        preset=model.get("preset", "tiny"), num_layers=int(model.get("num_layers", 2)),
        steps=int(trainer.get("steps", 30)), batch_size=int(trainer.get("batch_size", 4)),
        seq_len=int(trainer.get("seq_len", 128)), lr=float(trainer.get("lr", 1e-3)),
        device=trainer.get("device", "auto"), dtype=trainer.get("dtype", "float32"),
        activation_checkpointing=bool(trainer.get("activation_checkpointing", False)),
        seed=int(trainer.get("seed", 0)), dispatch=dispatch.get("type", "mega_moe"),
        precision=dispatch.get("precision", "bf16"), data=data.get("path", "synthetic"),
        log_every=int(trainer.get("log_every", 1)))
    validate(cfg)
    return cfg


def resolve_device(cfg: TrainConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device = 'cuda' but no CUDA device is available")
    if cfg.device not in ("cpu", "cuda"):
        raise ConfigError(f"trainer.device = {cfg.device!r}: expected auto | cpu | cuda")
    return torch.device(cfg.device)


def validate(cfg: TrainConfig) -> None:
    """Rejects unsupported combinations at start-up, naming the option."""
    if cfg.preset not in PRESETS:
        raise ConfigError(f"model.preset = {cfg.preset!r}: expected one of {sorted(PRESETS)}")
    if cfg.dispatch not in DISPATCH_TYPES:
        raise ConfigError(f"trainer.model.moe.dispatch.type = {cfg.dispatch!r}: expected one of {DISPATCH_TYPES}")
    if cfg.precision not in PRECISIONS:
        raise ConfigError(f"trainer.model.moe.dispatch.precision = {cfg.precision!r}: expected one of {PRECISIONS}")
    if cfg.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"trainer.dtype = {cfg.dtype!r}: expected float32 | bfloat16")
    device = resolve_device(cfg)
    if cfg.dispatch != "mega_moe" and cfg.precision != "bf16":
        raise ConfigError(f"trainer.model.moe.dispatch.precision = {cfg.precision!r} needs type = 'mega_moe' "
                          f"(the {cfg.dispatch} baseline is bf16 only)")
    if cfg.dispatch == "mega_moe" and device.type == "cuda":
        if cfg.precision == "mxfp8":
            raise ConfigError("trainer.model.moe.dispatch.precision = 'mxfp8' needs Blackwell tensor cores; "
                              "on Hopper it exists only as a CPU emulation")
        if cfg.precision in ("fp8", "fp8_bwd"):
            raise ConfigError(f"trainer.model.moe.dispatch.precision = {cfg.precision!r}: the FP8 CUDA kernels are "
                              "not built yet (bf16 only on CUDA; the CPU reference emulates FP8)")
        if cfg.dtype != "bfloat16":
            raise ConfigError("trainer.dtype must be 'bfloat16' for dispatch type 'mega_moe' on CUDA")
    for name in ("steps", "batch_size", "seq_len", "num_layers"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name} = {getattr(cfg, name)} must be >= 1")


def synthetic_corpus(n_bytes: int, seed: int) -> bytes:
    """Seeded sentences from a tiny grammar: learnable structure, no download."""
    g = torch.Generator().manual_seed(seed)
    subjects = ["the expert", "a token", "the router", "each layer", "the gradient", "one warp", "the kernel"]
    verbs = ["routes", "computes", "sends", "loads", "sums", "stores", "waits for"]
    objects = ["the tile", "eight experts", "a row", "the pool", "its weights", "the slot", "a barrier"]
    out = []
    size = 0
    while size < n_bytes:
        i, j, k = (int(torch.randint(len(x), (1,), generator=g)) for x in (subjects, verbs, objects))
        s = f"{subjects[i]} {verbs[j]} {objects[k]}. "
        out.append(s)
        size += len(s)
    return "".join(out).encode()[:n_bytes]


def load_data(cfg: TrainConfig) -> torch.Tensor:
    if cfg.data == "synthetic":
        raw = synthetic_corpus(max(1 << 16, cfg.batch_size * (cfg.seq_len + 1) * 4), cfg.seed)
    else:
        with open(cfg.data, "rb") as f:
            raw = f.read()
        if len(raw) < cfg.seq_len + 2:
            raise ConfigError(f"data.path = {cfg.data!r} holds {len(raw)} bytes, fewer than seq_len + 2")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


def build_model(cfg: TrainConfig, device: torch.device):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from .modules import use_megamoe_experts

    torch.manual_seed(cfg.seed)
    p = PRESETS[cfg.preset]
    mcfg = Qwen3MoeConfig(vocab_size=256, num_hidden_layers=cfg.num_layers, intermediate_size=p["moe_intermediate_size"],
                          max_position_embeddings=max(cfg.seq_len, 128), decoder_sparse_step=1,
                          norm_topk_prob=True, output_router_logits=False, tie_word_embeddings=False, **p)
    impl = {"eager": "eager", "grouped_mm": "grouped_mm", "mega_moe": "eager"}[cfg.dispatch]
    mcfg._experts_implementation = impl
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    with torch.device(device):
        model = Qwen3MoeForCausalLM(mcfg).to(dtype)
    if cfg.dispatch == "mega_moe":
        use_megamoe_experts(model, precision=cfg.precision)
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def batches(data: torch.Tensor, cfg: TrainConfig, device: torch.device):
    g = torch.Generator().manual_seed(cfg.seed + 1)
    while True:
        starts = torch.randint(0, data.numel() - cfg.seq_len - 1, (cfg.batch_size,), generator=g)
        chunk = torch.stack([data[s:s + cfg.seq_len + 1] for s in starts.tolist()])
        yield chunk[:, :-1].to(device), chunk[:, 1:].to(device)


def train_step(model, opt, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One optimizer step on next-byte prediction; returns the (detached) loss."""
    logits = model(input_ids=inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def progress(step: int, total: int, loss: float, ms: float, tok_s: float) -> str:
    width = 24
    done = int(width * step / total)
    return f"[{'#' * done}{'.' * (width - done)}] {step:4d}/{total} loss {loss:7.4f} step {ms:8.1f} ms {tok_s:10.0f} tok/s"


def train(cfg: TrainConfig, out=sys.stdout) -> list[dict]:
    device = resolve_device(cfg)
    model = build_model(cfg, device)
    data = load_data(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    it = batches(data, cfg, device)
    history = []
    tokens = cfg.batch_size * cfg.seq_len
    print(f"megamoe.train: preset {cfg.preset}, {cfg.num_layers} layers, dispatch {cfg.dispatch} ({cfg.precision}), "
          f"{device}, {cfg.dtype}, batch {cfg.batch_size} x {cfg.seq_len}, checkpointing {cfg.activation_checkpointing}",
          file=out)
    for step in range(1, cfg.steps + 1):
        inputs, labels = next(it)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        value = train_step(model, opt, inputs, labels).item()  # one sync per step, for the log
        ms = (time.perf_counter() - t0) * 1e3
        if not math.isfinite(value):
            raise RuntimeError(f"megamoe.train: loss became {value} at step {step}")
        history.append({"step": step, "loss": value, "step_ms": ms, "tokens_per_s": tokens / (ms / 1e3)})
        if step % cfg.log_every == 0 or step == cfg.steps:
            print(progress(step, cfg.steps, value, ms, tokens / (ms / 1e3)), file=out, flush=True)
    return history


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megamoe.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="TOML file (see the module docstring)")
    ap.add_argument("--steps", type=int, help="override trainer.steps")
    ap.add_argument("--json", help="write the per-step history here")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config)
        if args.steps:
            cfg.steps = args.steps
            validate(cfg)
    except (ConfigError, OSError, tomllib.TOMLDecodeError) as e:
        print(f"megamoe.train: {e}", file=sys.stderr)
        return 2
    history = train(cfg)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(history, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
