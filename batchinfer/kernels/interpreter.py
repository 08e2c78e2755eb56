"""Running the Triton kernels on CPU through the Triton interpreter (tests, debugging).

With Triton 3.9 the interpreter is a per-PROCESS choice made when `triton` is first imported:
Triton's own @jit helpers (tl.sum, tl.max, tl.cdiv, ...) are decorated then, so
  - kernels interpreted in a process that imported triton without TRITON_INTERPRET=1 fail with
    "Cannot call @triton.jit'd outside of the scope of a kernel", and
  - GPU compilation in a process that imported triton with it fails inside the interpreter's builder.
Loading "interpreted copies" of a module into a compiled process therefore does not work.
tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA before anything imports triton;
`ensure_interpreter` is the check a CPU test module makes, and a GPU compile check must run in a
fresh process (see batchinfer/kernels/compile_check.py).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator


def triton_is_interpreted() -> bool:
    """True when this process's Triton runs kernels in the interpreter (imports triton if needed)."""
    import triton.language.standard as standard
    from triton.runtime import JITFunction

    return not isinstance(standard.sum, JITFunction)


def ensure_interpreter() -> bool:
    """Switch this process to the interpreter if Triton is not imported yet and there is no CUDA
    device (a GPU process keeps compiled Triton unless TRITON_INTERPRET=1 was set explicitly).
    True if this process runs kernels interpreted."""
    if "triton" not in sys.modules:
        if os.environ.get("TRITON_INTERPRET") != "1":
            import torch

            if torch.cuda.is_available():
                return False
        os.environ["TRITON_INTERPRET"] = "1"
    return triton_is_interpreted()


@contextlib.contextmanager
def interpreter_env() -> Iterator[None]:
    """TRITON_INTERPRET=1 inside the block, the previous value restored after it. Interpreted kernels
    read the flag while they run; it does not make a compiled process interpreted (see above)."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
