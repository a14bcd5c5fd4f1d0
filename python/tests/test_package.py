"""What `pip install .` gives: declared dependencies and the `megamoe` program."""
import importlib.metadata as metadata
import subprocess
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_declares_what_the_package_imports():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(d.replace(" ", "").startswith("torch>=") for d in project["dependencies"]), project["dependencies"]
    assert any(d.startswith("transformers>=5") for d in project["optional-dependencies"]["train"])


def installed():
    try:
        return metadata.distribution("megamoe")
    except metadata.PackageNotFoundError:
        pytest.skip("megamoe is not pip-installed here (scripts/run-tests installs it before the Python tests)")


def test_installed_metadata_requires_torch():
    requires = installed().requires or []
    assert any(r.startswith("torch") for r in requires), requires
    assert any(r.startswith("transformers") and "extra == \"train\"" in r for r in requires), requires


def test_installed_megamoe_program_prints_its_usage():
    dist = installed()
    programs = [f for f in dist.files or [] if f.name == "megamoe" and f.parent.name in ("bin", "Scripts")]
    assert programs, "pip install . put no `megamoe` program in the environment's bin/"
    path = Path(dist.locate_file(programs[0])).resolve()
    out = subprocess.run([str(path), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # Every preset the library defines, in its order (include/megamoe/presets.h).
    from megamoe.presets import PRESETS
    presets = "|".join(PRESETS)
    assert presets.startswith("tiny|qwen3-30b-a3b|qwen3-235b-a22b|"), presets
    assert out.stdout.startswith(f"usage: megamoe run [--preset {presets}]"), out.stdout
