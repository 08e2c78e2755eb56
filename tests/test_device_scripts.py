"""The scripts a device call runs, checked on the CPU first: a broken one would spend the session's scarce
GPU time on a traceback. Each kernel sweep's --cpu-smoke runs its whole path on tiny work under the
Triton interpreter, in a fresh process (TRITON_INTERPRET must be set before triton is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("script", ["extend_shape_sweep.py", "flash_prefill_probe.py"])
def test_kernel_sweeps_pass_their_cpu_smoke(script):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--cpu-smoke"], check=False, capture_output=True,
                          text=True, timeout=300, env={**env, "CUDA_VISIBLE_DEVICES": ""}, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "cpu smoke ok" in done.stdout
