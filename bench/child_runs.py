"""Benchmark rows in child processes, one at a time, under a per-child limit and an overall deadline.

Each child writes its result as JSON to a file named on its command line; a
child that dies or overruns becomes an error row carrying the end of its output.
Shared by compare_torch.py and train_step_bench.py.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable


def log(msg: str):
    print(msg, file=sys.stderr, flush=True)


def finish_child(result: dict, path: str, ok_statuses=("ok",)) -> int:
    """A child's last act: its result as JSON where the parent looks, and its exit status."""
    with open(path, "w") as f:
        json.dump(result, f)
    return 0 if result.get("status") in ok_statuses else 1


class ChildRuns:
    def __init__(self, prefix: str, child_timeout: float, deadline: float = 0.0, log_path: str | None = None):
        self.start = time.monotonic()
        self.child_timeout, self.deadline = child_timeout, deadline
        self.tmp = tempfile.mkdtemp(prefix=prefix)
        self.logf = open(log_path, "a") if log_path else None
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.count = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.logf:
            self.logf.close()
        return False

    def run(self, label: str, base: dict, make_argv: Callable[[str], list[str]]) -> dict:
        """Runs make_argv(json_path) as a child in its own process session; returns its JSON, or
        base with status "skipped" (deadline) or "error" (why, and the last lines it printed)."""
        limit = self.child_timeout
        if self.deadline:
            left = self.deadline - (time.monotonic() - self.start)
            if left < 20:
                return {**base, "status": "skipped", "error": f"--deadline {self.deadline:g} s reached"}
            limit = min(limit, left)
        self.count += 1
        out_json = os.path.join(self.tmp, f"{self.count}.json")
        log(f"[{label}] child process (limit {limit:.4g} s)")
        t0 = time.monotonic()
        proc = subprocess.Popen(make_argv(out_json), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self.env,
                                start_new_session=True, text=True, errors="replace")
        chunks: list[str] = []
        reader = threading.Thread(target=lambda: chunks.extend(proc.stdout), daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)  # the child and anything it started
            proc.wait()
        reader.join(timeout=10)
        output = "".join(chunks)
        wall = time.monotonic() - t0
        if self.logf:
            self.logf.write(f"===== {label} rc={proc.returncode} {wall:.1f} s\n{output}\n")
            self.logf.flush()
        try:
            with open(out_json) as f:
                res = json.load(f)
        except (OSError, ValueError):
            why = f"timed out after {limit:.4g} s" if timed_out else f"child exited with {proc.returncode}"
            tail = " | ".join(output.strip().splitlines()[-3:])
            res = {**base, "status": "error", "error": f"{why}: {tail}"[:400]}
        if timed_out and res.get("status") == "ok":
            res["status"], res["error"] = "error", f"timed out after {limit:.4g} s"
        res["wall_s"] = wall
        return res
