"""The instruction mix of a kernel variant as an sm_90 GPU would run it, on a machine without a GPU.

Compiles the variants of batchinfer.kernels.compile_check (pointers and strides specialised as a launch
specialises them) to a cubin, disassembles it with the nvdisasm Triton ships, and prints each
variant's instruction count and its most frequent opcodes, with every memory, conversion and MMA
opcode counted. What it told us: BENCHMARKS.md (eighteenth session: the FP8 cache's V tile read from
shared memory a byte per instruction).
Usage: python3 scripts/kernel_sass.py [LABEL_SUBSTRING ...]   (TRITON_INTERPRET must be unset)
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

KEY_OPS = re.compile(r"(LDS|LDSM|STS|STSM|LDG|LDGSTS|F2F|F2FP|HADD2|HMMA|PRMT)")


def sass_counts(cubin: bytes) -> collections.Counter:
    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    ops: collections.Counter = collections.Counter()
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+(?:\.[A-Z0-9_]+)*)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def main() -> int:
    from batchinfer.kernels.compile_check import VARIANTS, compile_variant

    wanted = sys.argv[1:]
    for v in VARIANTS:
        name = f"{v.module}.{v.kernel} {v.label}".strip()
        if wanted and not any(w in name for w in wanted):
            continue
        ops = sass_counts(compile_variant(v).asm["cubin"])
        key = ", ".join(f"{o} {c}" for o, c in sorted(ops.items()) if KEY_OPS.match(o))
        print(f"{name}: {sum(ops.values())} instructions\n  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
