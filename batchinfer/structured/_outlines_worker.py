"""Child process that builds one outlines-core Index under a memory limit.

outlines-core turns a regex into a token-level automaton up front; on a large vocabulary and a
complex schema that can take minutes and gigabytes. Running it in a child lets the parent enforce
a wall-clock timeout (kill) and an address-space limit (RLIMIT_AS) without risking its own memory.
Protocol: stdin = pickle((regex, vocabulary, mem_limit_bytes)); stdout = pickle(Index).
This module imports only outlines-core so the child starts in a fraction of a second.
"""

from __future__ import annotations

import pickle
import resource
import sys


def main() -> int:
    regex, vocabulary, mem_limit = pickle.loads(sys.stdin.buffer.read())
    if mem_limit:
        resource.setrlimit(resource.RLIMIT_AS, (mem_limit, mem_limit))
    import outlines_core

    try:
        index = outlines_core.Index(regex, vocabulary)
    except MemoryError:
        sys.stderr.write("outlines-core ran out of its memory limit\n")
        return 3
    except Exception as e:  # the regex is not supported: report it to the parent
        sys.stderr.write(f"{type(e).__name__}: {e}\n")
        return 2
    sys.stdout.buffer.write(pickle.dumps(index))
    return 0


if __name__ == "__main__":
    sys.exit(main())
