"""The examples run as written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(*args, cwd):
    r = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=cwd)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_resize_then_run_long(minilm, tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "posextend.cli", "resize-model", str(minilm), "minilm-2k", "--length", "2048"],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    out = _run(EXAMPLES / "run_long.py", "minilm-2k", cwd=tmp_path)
    assert "loaded minilm-2k: clean" in out and "(1, 2048) -> last_hidden_state (1, 2048, 384)" in out


def test_extend_in_memory(tmp_path):
    out = _run(EXAMPLES / "extend_in_memory.py", tmp_path / "m", cwd=tmp_path)
    assert "forward at 1024 tokens: (1, 1024, 384)" in out
    assert (tmp_path / "m" / "model.safetensors").exists()


def test_custom_strategy(tmp_path):
    out = _run(EXAMPLES / "custom_strategy.py", cwd=tmp_path)
    assert "mirror" in out and "(512, 64) -> (2048, 64) row 512 == row 511: True" in out
