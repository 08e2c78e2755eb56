"""kernels/README.md lists every kernel module (that kernels import no upper layer is checked by
tests/test_import_graph.py)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "batchinfer" / "kernels"


def test_kernels_readme_lists_every_kernel_module():
    readme = (ROOT / "kernels" / "README.md").read_text()
    missing = [p.name for p in KERNELS.glob("*.py") if p.name != "__init__.py" and f"`{p.name}`" not in readme]
    assert not missing, missing
