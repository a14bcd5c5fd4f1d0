"""A small trainer: python -m megamoe.train --config FILE.toml

Builds a Qwen3-MoE causal LM (transformers, random weights, never
downloaded) at a preset's layer shapes, picks the MoE experts implementation
from [trainer.model.moe.dispatch], trains on a byte-level synthetic corpus
(or a text file) and logs loss, step time and tokens/s. The TOML keys, their
types and defaults are the table KEYS below (`--help` prints it); an unknown
key or section, a value of the wrong type or out of range is a one-line error
naming the key (exit status 2).

Expert parallelism: `ep = N` in [trainer.model.moe.dispatch], launched as
`torchrun --nproc-per-node N -m megamoe.train --config ...`. Every process is
one GPU; the N ranks form one expert-parallel group (each holds E / N
experts, megamoe.ep) and, for everything else, one data-parallel group
(PyTorch DDP, the experts left out of its all-reduce). Each rank trains on
its 1 / N of the global batch (batch_size sequences per step in all), and
the expert gradients are divided by N so that every gradient is that of the
global batch's mean loss, as on one GPU.
"""
from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib  # type: ignore

from .presets import PRESETS

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
    compile: bool = False
    seed: int = 0
    dispatch: str = "mega_moe"
    precision: str = "bf16"
    fp8_scale: str = "fp32"
    data: str = "synthetic"
    log_every: int = 1
    ep: int = 1
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Key:
    """One TOML key: where it lives, the TrainConfig field it sets, its type and limits."""
    section: str
    name: str
    attr: str
    kind: type
    help: str
    choices: tuple = ()
    minimum: float | None = None

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}"

    def expected(self) -> str:
        if self.choices:
            return "one of " + " | ".join(repr(c) for c in self.choices)
        what = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}[self.kind]
        return what + (f" >= {self.minimum:g}" if self.minimum is not None and self.kind is int else
                       f" > {self.minimum:g}" if self.minimum is not None else "")


KEYS = (
    Key("model", "preset", "preset", str, "layer shapes", choices=tuple(PRESETS)),
    Key("model", "num_layers", "num_layers", int, "decoder layers", minimum=1),
    Key("trainer", "steps", "steps", int, "optimizer steps (--steps overrides)", minimum=1),
    Key("trainer", "batch_size", "batch_size", int, "sequences per step", minimum=1),
    Key("trainer", "seq_len", "seq_len", int, "bytes per sequence", minimum=1),
    Key("trainer", "lr", "lr", float, "AdamW learning rate", minimum=0.0),
    Key("trainer", "device", "device", str, "where to train", choices=("auto", "cpu", "cuda")),
    Key("trainer", "dtype", "dtype", str, "model dtype (CUDA mega_moe needs bfloat16)",
        choices=("float32", "bfloat16")),
    Key("trainer", "activation_checkpointing", "activation_checkpointing", bool, "recompute layers in the backward"),
    Key("trainer", "compile", "compile", bool,
        "torch.compile every decoder layer (one graph for all; megamoe's ops opaque in it)"),
    Key("trainer", "seed", "seed", int, "weights and batches", minimum=0),
    Key("trainer", "log_every", "log_every", int, "print every N steps (and the last)", minimum=1),
    Key("trainer.model.moe.dispatch", "type", "dispatch", str, "MoE experts implementation", choices=DISPATCH_TYPES),
    Key("trainer.model.moe.dispatch", "precision", "precision", str, "mega_moe numerics", choices=PRECISIONS),
    Key("trainer.model.moe.dispatch", "fp8_scale", "fp8_scale", str,
        "FP8 block scales (fp8, fp8_bwd): amax / 448, or the power of two above it", choices=("fp32", "pow2")),
    Key("trainer.model.moe.dispatch", "ep", "ep", int, "expert-parallel ranks (torchrun processes, one GPU each)",
        minimum=1),
    Key("data", "path", "data", str, '"synthetic", or a UTF-8 text file (at least seq_len + 2 bytes)'),
)
SECTIONS = ("model", "trainer", "trainer.model", "trainer.model.moe", "trainer.model.moe.dispatch", "data")


def keys_help() -> str:
    """The KEYS table as text (for --help)."""
    defaults = TrainConfig()
    lines = ["TOML keys (default; expected):"]
    for section in dict.fromkeys(k.section for k in KEYS):
        lines.append(f"  [{section}]")
        for k in (k for k in KEYS if k.section == section):
            default = getattr(defaults, k.attr)
            shown = json.dumps(default) if not isinstance(default, float) else f"{default:g}"
            entry = f"{k.name} = {shown}"
            lines.append(f"    {entry:<34} # {k.help}; {k.expected()}")
    return "\n".join(lines)


def _check_value(key: Key, value):
    """The value if it has the key's type and limits, else ConfigError naming the key."""
    bad = ConfigError(f"{key.path} = {value!r}: expected {key.expected()}")
    if key.kind is bool:
        if not isinstance(value, bool):
            raise bad
    elif key.kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
    elif key.kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad
        value = float(value)
    elif not isinstance(value, str):
        raise bad
    if key.choices and value not in key.choices:
        raise bad
    if key.minimum is not None and (value < key.minimum if key.kind is int else value <= key.minimum):
        raise bad
    return value


def _walk(table: dict, prefix: str, out: dict) -> None:
    """Flattens the TOML document to {"section.key": value}, refusing unknown sections and keys."""
    known = {k.path for k in KEYS}
    for name, value in table.items():
        path = f"{prefix}.{name}" if prefix else name
        if path in SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: expected a table ([{path}]), got {value!r}")
            _walk(value, path, out)
        elif path in known:
            out[path] = value
        else:
            close = difflib.get_close_matches(path, sorted(known | set(SECTIONS)), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"{path}: unknown {'section' if isinstance(value, dict) else 'key'}{hint}; "
                              "`python -m megamoe.train --help` lists the keys")


def config_from_dict(raw: dict) -> TrainConfig:
    values: dict = {}
    _walk(raw, "", values)
    cfg = TrainConfig()
    for key in KEYS:
        if key.path in values:
            setattr(cfg, key.attr, values[key.path])
    validate(cfg)  # checks every value against its key, naming the key
    return cfg


def load_config(path: str) -> TrainConfig:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML: {e}") from None
    return config_from_dict(raw)


def resolve_device(cfg: TrainConfig) -> torch.device:
    if cfg.ep > 1 and cfg.device != "cpu" and torch.cuda.is_available():  # torchrun: this process's GPU
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device = 'cuda' but no CUDA device is available")
    return torch.device(cfg.device)


def _numerics(cfg: TrainConfig) -> str:
    """The precision as the trainer prints it, with the FP8 scales when they are not the default."""
    return cfg.precision + (", pow2 scales" if cfg.fp8_scale == "pow2" else "")


def validate(cfg: TrainConfig) -> None:
    """Checks every value against its key (an integer lr becomes a float) and rejects unsupported
    combinations at start-up, naming the option."""
    for key in KEYS:  # from the TOML or set from Python (benchmarks, --steps): the same limits
        setattr(cfg, key.attr, _check_value(key, getattr(cfg, key.attr)))
    device = resolve_device(cfg)
    if cfg.dispatch != "mega_moe" and cfg.precision != "bf16":
        raise ConfigError(f"trainer.model.moe.dispatch.precision = {cfg.precision!r} needs type = 'mega_moe' "
                          f"(the {cfg.dispatch} baseline is bf16 only)")
    if cfg.fp8_scale != "fp32" and cfg.precision not in ("fp8", "fp8_bwd"):
        raise ConfigError(f"trainer.model.moe.dispatch.fp8_scale = {cfg.fp8_scale!r} needs precision = 'fp8' or "
                          f"'fp8_bwd' (precision is {cfg.precision!r})")
    if cfg.dispatch == "mega_moe" and device.type == "cuda":
        if cfg.precision == "mxfp8":
            raise ConfigError("trainer.model.moe.dispatch.precision = 'mxfp8' needs Blackwell tensor cores; "
                              "on Hopper it exists only as a CPU emulation")
        if cfg.dtype != "bfloat16":
            raise ConfigError("trainer.dtype must be 'bfloat16' for dispatch type 'mega_moe' on CUDA")
    if cfg.compile and cfg.ep > 1:
        raise ConfigError(f"trainer.compile = true with trainer.model.moe.dispatch.ep = {cfg.ep} is not supported "
                          "yet: the expert-parallel layer runs outside torch.compile's graphs (megamoe.ep, a graph "
                          "break in every layer) and has not been run compiled under DDP; set compile = false")
    if cfg.ep > 1:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if cfg.dispatch != "mega_moe" or device.type != "cuda":
            raise ConfigError(f"trainer.model.moe.dispatch.ep = {cfg.ep} needs type = 'mega_moe' on CUDA")
        if world != cfg.ep:
            raise ConfigError(f"trainer.model.moe.dispatch.ep = {cfg.ep}, but {world} process(es) run: launch with "
                              f"torchrun --nproc-per-node {cfg.ep}")
        if cfg.batch_size % cfg.ep != 0:
            raise ConfigError(f"trainer.batch_size = {cfg.batch_size} does not split over ep = {cfg.ep} ranks")
        experts = PRESETS[cfg.preset]["num_experts"]
        if experts % cfg.ep != 0:
            raise ConfigError(f"trainer.model.moe.dispatch.ep = {cfg.ep} does not divide the preset's {experts} "
                              "experts")
    if cfg.data != "synthetic":
        try:
            size = os.path.getsize(cfg.data)
        except OSError as e:
            raise ConfigError(f"data.path = {cfg.data!r}: {e.strerror or e}") from None
        if size < cfg.seq_len + 2:
            raise ConfigError(f"data.path = {cfg.data!r} holds {size} bytes: expected at least seq_len + 2 = "
                              f"{cfg.seq_len + 2}")


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
        with open(cfg.data, "rb") as f:  # validate() checked that it exists and is long enough
            raw = f.read()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


def build_model(cfg: TrainConfig, device: torch.device, ep_group=None):
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
    if cfg.dispatch == "mega_moe":  # every rank built the same weights: each keeps its experts
        per_rank = cfg.batch_size // cfg.ep * cfg.seq_len if ep_group is not None else None
        use_megamoe_experts(model, precision=cfg.precision, fp8_scale=cfg.fp8_scale, ep_group=ep_group,
                            max_tokens=per_rank)
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.compile:  # regional: the layers share one compiled graph (compiled at the first step)
        for layer in model.model.layers:
            layer.compile()
    return model


def batches(data: torch.Tensor, cfg: TrainConfig, device: torch.device, rank: int = 0, world: int = 1):
    """The global batch of each step (the same on every rank), this rank's 1 / world of it."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    share = cfg.batch_size // world
    while True:
        starts = torch.randint(0, data.numel() - cfg.seq_len - 1, (cfg.batch_size,), generator=g)
        chunk = torch.stack([data[s:s + cfg.seq_len + 1] for s in starts.tolist()])[rank * share:(rank + 1) * share]
        yield chunk[:, :-1].to(device), chunk[:, 1:].to(device)


def train_step(model, opt, inputs: torch.Tensor, labels: torch.Tensor, expert_params=(), world: int = 1
               ) -> torch.Tensor:
    """One optimizer step on next-byte prediction; returns the (detached) loss. With expert
    parallelism, the experts' gradients (summed over every rank's tokens) are divided by world,
    as DDP averages the others."""
    logits = model(input_ids=inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    for p in expert_params:
        if p.grad is not None:
            p.grad.div_(world)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def progress(step: int, total: int, loss: float, ms: float, tok_s: float) -> str:
    width = 24
    done = int(width * step / total)
    return f"[{'#' * done}{'.' * (width - done)}] {step:4d}/{total} loss {loss:7.4f} step {ms:8.1f} ms {tok_s:10.0f} tok/s"


def _expert_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """The experts' parameters sharded by expert parallelism (tagged by use_megamoe_experts)."""
    return [(n, p) for n, p in model.named_parameters() if getattr(p, "_megamoe_ep", False)]


def train(cfg: TrainConfig, out=None) -> list[dict]:
    out = out or sys.stdout
    device = resolve_device(cfg)
    rank, world, ep_group = 0, 1, None
    if cfg.ep > 1:
        import torch.distributed as dist
        torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl", device_id=device)
        rank, world, ep_group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
        out = out if rank == 0 else open(os.devnull, "w")
    model = build_model(cfg, device, ep_group)
    experts = _expert_parameters(model) if world > 1 else []
    data = load_data(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    if world > 1:  # data-parallel for the rest; the experts are this rank's own
        from torch.nn.parallel import DistributedDataParallel as DDP
        DDP._set_params_and_buffers_to_ignore_for_model(model, [n for n, _ in experts])
        model = DDP(model, device_ids=[device.index])
    it = batches(data, cfg, device, rank, world)
    history = []
    tokens = cfg.batch_size * cfg.seq_len // world  # this rank's share of the step
    print(f"megamoe.train: preset {cfg.preset}, {cfg.num_layers} layers, dispatch {cfg.dispatch} ({_numerics(cfg)}), "
          f"{device}, {cfg.dtype}, batch {cfg.batch_size} x {cfg.seq_len}, checkpointing {cfg.activation_checkpointing}"
          + (", decoder layers compiled" if cfg.compile else ""), file=out)
    for step in range(1, cfg.steps + 1):
        inputs, labels = next(it)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = train_step(model, opt, inputs, labels, [p for _, p in experts], world)
        if world > 1:  # the global batch's mean loss, for the log
            import torch.distributed as dist
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        value = loss.item()  # one sync per step, for the log
        ms = (time.perf_counter() - t0) * 1e3
        if not math.isfinite(value):
            raise RuntimeError(f"megamoe.train: loss became {value} at step {step}")
        history.append({"step": step, "loss": value, "step_ms": ms, "tokens_per_s": tokens / (ms / 1e3)})
        if step % cfg.log_every == 0 or step == cfg.steps:
            print(progress(step, cfg.steps, value, ms, tokens / (ms / 1e3)), file=out, flush=True)
    return history


def summary(cfg: TrainConfig, history: list[dict], device: torch.device) -> str:
    """One line at the end of a run: what ran, where the loss went, the median step."""
    ms = statistics.median(h["step_ms"] for h in history)
    line = (f"megamoe.train: done: {len(history)} steps of {cfg.preset} x {cfg.num_layers} layers, dispatch "
            f"{cfg.dispatch} ({_numerics(cfg)}) on {device}; loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}; "
            f"median step {ms:.1f} ms, {cfg.batch_size * cfg.seq_len / cfg.ep / (ms / 1e3):.0f} tok/s"
            + (f" per GPU ({cfg.ep} GPUs, expert-parallel)" if cfg.ep > 1 else ""))
    if device.type == "cuda":
        line += f"; peak memory {torch.cuda.max_memory_allocated(device) / 2 ** 30:.2f} GiB"
    return line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megamoe.train", description=__doc__.split("\n\n")[0],
                                 epilog=keys_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="TOML file (keys below)")
    ap.add_argument("--steps", type=int, help="override trainer.steps (>= 1)")
    ap.add_argument("--json", help="write the per-step history here")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config)
        if args.steps is not None:
            if args.steps < 1:
                raise ConfigError(f"--steps {args.steps}: expected an integer >= 1")
            cfg.steps = args.steps
        device = resolve_device(cfg)
        import transformers  # noqa: F401  (the model comes from it: say so before anything is built)
    except ConfigError as e:
        print(f"megamoe.train: {e}", file=sys.stderr)
        return 2
    except ImportError:
        print("megamoe.train: the trainer builds its model with transformers >= 5, which is not installed "
              "(pip install 'megamoe[train]')", file=sys.stderr)
        return 2
    history = train(cfg)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, rank 0 reports
        return 0
    print(summary(cfg, history, device))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(history, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
