"""Does CUDA's start-up let the main thread run? (issue 21: what can overlap the CLI's imports)

    python3 scripts/cuda_init_probe.py            # both orders, each in a fresh process

In a fresh process: import torch, then either
- serial: import the run path's modules (job driver, engine, model runner), then torch.cuda.init() and a
  first cuBLAS matmul, one after the other on the main thread; or
- overlapped: the CUDA part on a thread started first, the imports on the main thread meanwhile,
  while a 1 ms ticker records how long the main thread was held up.
Prints each part's time and the whole; if CUDA's start-up released the GIL the overlapped whole is
shorter by about the smaller of the two parts.
"""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import json, sys, threading, time
t0 = time.perf_counter()
import torch
t_torch = time.perf_counter() - t0
out = {"torch_import_s": t_torch}

def cuda_part():
    t = time.perf_counter()
    torch.cuda.init()
    out["cuda_init_s"] = time.perf_counter() - t
    t = time.perf_counter()
    a = torch.ones(256, 256, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    out["first_matmul_s"] = time.perf_counter() - t

def imports():
    t = time.perf_counter()
    import batchinfer.job.driver, batchinfer.engine.engine, batchinfer.engine.model_runner  # noqa: F401
    import batchinfer.models.loader  # noqa: F401
    out["imports_s"] = time.perf_counter() - t

start = time.perf_counter()
if sys.argv[1] == "serial":
    imports()
    cuda_part()
else:
    th = threading.Thread(target=cuda_part)
    th.start()
    imports()
    stalls, last = [], time.perf_counter()
    while th.is_alive():
        time.sleep(0.001)
        now = time.perf_counter()
        stalls.append(now - last)
        last = now
    th.join()
    out["longest_stall_after_imports_s"] = max(stalls) if stalls else 0.0
out["whole_s"] = time.perf_counter() - start
print(json.dumps(out))
"""


def main() -> None:
    for mode in ("serial", "overlapped", "serial", "overlapped"):
        r = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True)
        if r.returncode:
            print(r.stderr[-2000:], file=sys.stderr)
            raise SystemExit(1)
        data = json.loads(r.stdout.strip().splitlines()[-1])
        print(mode, " ".join(f"{k}={v:.3f}" for k, v in data.items()), flush=True)


if __name__ == "__main__":
    main()
