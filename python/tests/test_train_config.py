"""The trainer's TOML and command line: every mistake is one line naming the key, exit status 2."""
import math

import pytest

from megamoe import train

BASE = {  # section -> {key: TOML value text}
    "model": {"preset": '"tiny"', "num_layers": "1"},
    "trainer": {"steps": "2", "batch_size": "2", "seq_len": "16", "lr": "3e-3", "device": '"cpu"'},
    "trainer.model.moe.dispatch": {"type": '"mega_moe"', "precision": '"bf16"'},
}


def toml(extra: dict | None = None, top: str = "") -> str:
    """BASE with `extra` ({section: {key: value text}}) set over it; `top` goes first, outside any table."""
    sections = {name: dict(keys) for name, keys in BASE.items()}
    for name, keys in (extra or {}).items():
        sections.setdefault(name, {}).update(keys)
    body = "".join(f"[{name}]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items()) for name, keys in sections.items())
    return top + body


def write(tmp_path, text, name="cfg.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


CASES = [
    ({"trainer": {"stpes": "5"}}, "", r"trainer.stpes: unknown key \(did you mean trainer.steps\?\)"),
    ({"optimiser": {"lr": "1"}}, "", r"optimiser: unknown section"),
    ({"trainer": {"activation_checkpointing": '"false"'}}, "",
     r"trainer.activation_checkpointing = 'false': expected true or false"),
    ({"trainer": {"activation_checkpointing": "1"}}, "", r"trainer.activation_checkpointing = 1: expected true or false"),
    ({"trainer": {"seed": "1.5"}}, "", r"trainer.seed = 1.5: expected an integer >= 0"),
    ({"trainer": {"log_every": "true"}}, "", r"trainer.log_every = True: expected an integer >= 1"),
    ({"trainer": {"log_every": "0"}}, "", r"trainer.log_every = 0: expected an integer >= 1"),
    ({"model": {"num_layers": "2.0"}}, "", r"model.num_layers = 2.0: expected an integer >= 1"),
    ({"trainer": {"lr": "nan"}}, "", r"trainer.lr = nan: expected a finite number > 0"),
    ({"trainer": {"lr": "-1e-3"}}, "", r"trainer.lr = -0.001: expected a finite number > 0"),
    ({"trainer": {"lr": '"fast"'}}, "", r"trainer.lr = 'fast': expected a finite number > 0"),
    ({"model": {"preset": "5"}}, "", r"model.preset = 5: expected one of 'tiny'"),
    ({"trainer": {"dtype": '"fp16"'}}, "", r"trainer.dtype = 'fp16': expected one of 'float32' \| 'bfloat16'"),
    ({}, "data = 3\n", r"data: expected a table \(\[data\]\), got 3"),
    ({"data": {"path": '"/nonexistent/corpus.txt"'}}, "", r"data.path = '/nonexistent/corpus.txt': No such file"),
    ({"trainer.model.moe.dispatch": {"fp8_scale": '"e8m0"'}}, "",
     r"trainer.model.moe.dispatch.fp8_scale = 'e8m0': expected one of 'fp32' \| 'pow2'"),
    ({"trainer.model.moe.dispatch": {"fp8_scale": '"pow2"'}}, "",
     r"trainer.model.moe.dispatch.fp8_scale = 'pow2' needs precision = 'fp8' or 'fp8_bwd' \(precision is 'bf16'\)"),
]


@pytest.mark.parametrize("extra,top,message", CASES, ids=[c[2].split(":")[0].replace("\\", "") for c in CASES])
def test_bad_config_is_one_line_naming_the_key(tmp_path, capsys, extra, top, message):
    text = toml(extra, top)
    with pytest.raises(train.ConfigError, match=message):
        train.load_config(write(tmp_path, text))
    assert train.main(["--config", write(tmp_path, text)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("megamoe.train: "), err


def test_data_file_too_small(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("abc")
    text = toml({"data": {"path": f'"{corpus}"'}})
    assert train.main(["--config", write(tmp_path, text)]) == 2
    assert "holds 3 bytes: expected at least seq_len + 2 = 18" in capsys.readouterr().err


def test_missing_or_broken_config_file(tmp_path, capsys):
    assert train.main(["--config", str(tmp_path / "nope.toml")]) == 2
    assert "--config" in capsys.readouterr().err
    assert train.main(["--config", write(tmp_path, "[model\n")]) == 2
    assert "not valid TOML" in capsys.readouterr().err


@pytest.mark.parametrize("steps", ["0", "-3"])
def test_steps_override_must_be_positive(tmp_path, capsys, steps):
    assert train.main(["--config", write(tmp_path, toml()), "--steps", steps]) == 2
    assert f"--steps {steps}: expected an integer >= 1" in capsys.readouterr().err


def test_values_keep_their_types(tmp_path):
    cfg = train.load_config(write(tmp_path, toml({"trainer": {"activation_checkpointing": "false", "log_every": "3"}})))
    assert cfg.activation_checkpointing is False and cfg.log_every == 3 and cfg.steps == 2
    cfg = train.load_config(write(tmp_path, toml({"trainer": {"activation_checkpointing": "true"}})))
    assert cfg.activation_checkpointing is True
    assert math.isclose(cfg.lr, 3e-3)
    assert cfg.fp8_scale == "fp32"  # the default
    cfg = train.load_config(write(tmp_path, toml({"trainer.model.moe.dispatch": {"precision": '"fp8"',
                                                                                  "fp8_scale": '"pow2"'}})))
    assert cfg.precision == "fp8" and cfg.fp8_scale == "pow2"


def test_help_lists_every_key_with_its_default(capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    defaults = train.TrainConfig()
    for key in train.KEYS:
        assert f"{key.name} = " in out, key.path
    for text in ("steps = 30", "log_every = 1", "activation_checkpointing = false", 'type = "mega_moe"',
                 f"seq_len = {defaults.seq_len}", "[trainer.model.moe.dispatch]"):
        assert text in out, text


def test_presets_come_from_the_library():
    from megamoe import _abi
    import ctypes
    count = ctypes.c_int32()
    info = _abi.PresetInfo()
    _abi.check(_abi.lib().megamoe_preset(0, ctypes.byref(info), ctypes.byref(count)))
    assert set(train.PRESETS) == {"tiny", "qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b", "qwen3-next-80b-a3b",
                                  "deepseek-v3"} and count.value == 6
    assert train.PRESETS["qwen3-30b-a3b"]["hidden_size"] == 2048
    assert train.PRESETS["qwen3-235b-a22b"]["moe_intermediate_size"] == 1536
    assert train.PRESETS["mixtral-8x7b"]["moe_intermediate_size"] == 14336
    with pytest.raises(_abi.MegaMoEError, match=r"preset index 6 is out of range \[0, 6\)"):
        _abi.check(_abi.lib().megamoe_preset(6, ctypes.byref(info), None))
