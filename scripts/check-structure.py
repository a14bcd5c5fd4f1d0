#!/usr/bin/env python3
"""The structure rules of the source tree, checked (scripts/run-tests runs this):
  - no file in src/ over 600 lines, no function there over 150 (C++, CUDA);
  - no "session N" in src/ or python/ (history lives in git and docs/perf-log.md);
  - the Python package's modules import one another in one downward chain
    (no cycle), and take no private (_name) names from one another.
Exit status 1, with every breach named, when a rule does not hold."""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 150
# The package's modules, top to bottom: each may import only those after it.
PYTHON_CHAIN = ["train", "presets", "modules", "functional", "ep", "peer", "_ops", "_memory", "_abi"]
CONTROL = re.compile(r"^\s*(if|for|while|switch|catch|do|else|return|case)\b")


def strip_comments_and_strings(text: str) -> str:
    """C++ text with comments and string/char literals blanked (newlines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("".join(c if c == "\n" else " " for c in text[i:j]))
            i = j
        elif text[i] in "\"'":
            q, j = text[i], i + 1
            while j < n and text[j] != q:
                j += 2 if text[j] == "\\" else 1
            out.append(" " * (j + 1 - i))
            i = j + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def without_template_prefix(header: str) -> str:
    """A declaration's text without its leading template <...> parameter lists."""
    while True:
        m = re.match(r"\s*template\s*<", header)
        if not m:
            return header
        depth, i = 1, m.end()
        while i < len(header) and depth:
            depth += {"<": 1, ">": -1}.get(header[i], 0)
            i += 1
        header = header[i:]


def long_functions(path: Path) -> list[str]:
    """Functions (free, member or kernel; lambdas count in theirs) longer than the limit."""
    text = strip_comments_and_strings(path.read_text())
    found, stack, last = [], [], 0  # stack: (is_function, start line)
    for i, c in enumerate(text):
        if c in ";{}":
            if c == "{":
                header = without_template_prefix(text[last:i]).strip()
                inside_function = any(f for f, _ in stack)
                is_function = (not inside_function and header.endswith(")") or
                               not inside_function and re.search(r"\)\s*(const|noexcept|override|final|\s)*$", header))
                is_function = bool(is_function) and not CONTROL.match(header) and "=" not in header.split("(")[0]
                stack.append((is_function, text.count("\n", 0, i) + 1))
            elif c == "}" and stack:
                is_function, start = stack.pop()
                end = text.count("\n", 0, i) + 1
                if is_function and end - start + 1 > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(ROOT)}:{start}: a function of {end - start + 1} lines")
            last = i + 1
    return found


def python_imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module imported from the package, names taken from it) for every import in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.append((node.module.split(".")[0], [a.name for a in node.names]))
            else:
                out.extend((a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megamoe."):
            out.append((node.module.split(".")[1], [a.name for a in node.names]))
    return out


def private_attributes(path: Path, modules: set[str]) -> list[str]:
    """`module._name` uses of another package module's private names."""
    tree = ast.parse(path.read_text())
    return [f"{node.value.id}.{node.attr}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
            and node.attr.startswith("_") and not node.attr.startswith("__")]


def main() -> int:
    problems = []
    for path in sorted((ROOT / "src").rglob("*")):
        if path.suffix not in (".h", ".cpp", ".cu", ".cuh"):
            continue
        lines = path.read_text().count("\n")
        if lines > MAX_FILE_LINES:
            problems.append(f"{path.relative_to(ROOT)}: {lines} lines (at most {MAX_FILE_LINES})")
        problems += long_functions(path)
    for folder in ("src", "python"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in (".h", ".cpp", ".cu", ".cuh", ".py"):
                for n, line in enumerate(path.read_text().splitlines(), 1):
                    if re.search(r"\bsession [0-9]", line, re.IGNORECASE):
                        problems.append(f"{path.relative_to(ROOT)}:{n}: a session number ({line.strip()[:60]})")
    package = ROOT / "python" / "megamoe"
    modules = {p.stem for p in package.glob("*.py")} - {"__init__"}
    unknown = modules - set(PYTHON_CHAIN)
    if unknown:
        problems.append(f"python/megamoe: modules not placed in the import chain: {sorted(unknown)}")
    for path in sorted(package.glob("*.py")):
        if path.stem == "__init__":
            continue
        here = PYTHON_CHAIN.index(path.stem) if path.stem in PYTHON_CHAIN else -1
        for module, names in python_imports(path):
            if module not in PYTHON_CHAIN:
                continue
            if PYTHON_CHAIN.index(module) <= here:
                problems.append(f"python/megamoe/{path.name}: imports {module}, which is not below it")
            problems += [f"python/megamoe/{path.name}: takes the private name {module}.{n}" for n in names
                         if n.startswith("_")]
        problems += [f"python/megamoe/{path.name}: uses the private name {a}" for a in private_attributes(path, modules)]
    for p in problems:
        print("check-structure:", p)
    print(f"check-structure: {'no breaches' if not problems else f'{len(problems)} breaches'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
