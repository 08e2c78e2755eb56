"""Datasheet ceilings of common accelerators, for a roofline without measuring (the run report).

`roofline.measure_ceilings` times a copy and a matrix product on the device at hand; a report written
later, or on another machine, cannot. These are the vendors' published peaks instead: memory
bandwidth, and dense (no sparsity) 16-bit tensor-core FLOP/s. They are upper bounds that no kernel
reaches, so a floor built on them is lower (and a run's fraction of it smaller) than one on measured
ceilings. Only 16-bit dtypes have an entry; other dtypes give no datasheet roofline.
"""

from __future__ import annotations

from batchinfer.bench.roofline import Ceilings

# (words that must all be in torch.cuda.get_device_name(), lower case, split at spaces and dashes) -> (bytes/s, dense 16-bit FLOP/s).
# The first match wins, so variants come before the plain name.
DATASHEET: tuple[tuple[tuple[str, ...], float, float], ...] = (
    (("b200",), 8.0e12, 2.25e15),
    (("h200", "nvl"), 4.8e12, 835e12),
    (("h200",), 4.8e12, 989e12),
    (("h100", "nvl"), 3.9e12, 835e12),
    (("h100", "pcie"), 2.0e12, 756e12),
    (("h100",), 3.35e12, 989e12),
    (("a100", "40gb"), 1.555e12, 312e12),
    (("a100", "pcie"), 1.935e12, 312e12),
    (("a100",), 2.039e12, 312e12),
    (("l40s",), 864e9, 362e12),
    (("l4",), 300e9, 121e12),
    (("a10g",), 600e9, 125e12),
    (("a10",), 600e9, 125e12),
)
SIXTEEN_BIT = ("bfloat16", "float16", "torch.bfloat16", "torch.float16")


def datasheet_ceilings(device_name: str | None, dtype: str) -> Ceilings | None:
    """The published ceilings of a device by its name, for a 16-bit dtype; None when not in the table."""
    if not device_name or dtype not in SIXTEEN_BIT:
        return None
    words = set(device_name.lower().replace("-", " ").split())
    for needed, bandwidth, flops in DATASHEET:
        if words.issuperset(needed):
            return Ceilings(device=device_name, copy_bytes_per_s=bandwidth, matmul_flops_per_s=flops)
    return None
