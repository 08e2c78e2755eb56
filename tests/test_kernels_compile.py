"""Every Triton kernel compiles for an H100/H200 (sm_90) on this CPU-only machine.

Runs batchinfer.kernels.compile_check in a fresh process without TRITON_INTERPRET: Triton 3.9
fixes interpreter-or-compiler when it is first imported (see batchinfer/kernels/interpreter.py),
and the CPU test process is interpreted. Marked slow (tens of seconds on a loaded machine).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from batchinfer.kernels.compile_check import VARIANTS

pytestmark = pytest.mark.slow


def test_kernels_compile_for_sm90(tmp_path):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    proc = subprocess.run(
        [sys.executable, "-m", "batchinfer.kernels.compile_check"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ok ")]
    assert len(lines) == len(VARIANTS), proc.stdout
