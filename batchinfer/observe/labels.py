"""The report's vocabulary, shared by the numbers (report.py), the pages (page.py, compare_page.py)
and the comparison (compare.py): which percentiles and latency columns there are, their human labels,
and how a number is written for a person (units, thousands separators, "6.1 %", "2 min 05 s").

Depends on nothing else of batchinfer, so every observe module can import it and none imports back.
"""

from __future__ import annotations

import math
import time
from typing import Any

PERCENTILES = (0.5, 0.9, 0.95, 0.99)

# report["latency_s"] key -> row-record column
LATENCY_COLUMNS = {"queue_wait": "queue_wait_s", "ttft": "ttft_s", "decode": "decode_s", "row": "latency_s"}
LATENCY_LABELS = {
    "queue_wait": "Queue wait",
    "ttft": "Time to first token",
    "decode": "Decode time",
    "row": "Row latency (arrival to finish)",
}
LENGTH_LABELS = {"prompt_tokens": "Prompt length", "completion_tokens": "Output length"}
STEP_LABELS = {"step": "Engine step", "schedule": "Scheduling (CPU)"}
# a distribution's keys (report._dist) -> column heads
DIST_HEADS = (("count", "n"), ("mean", "mean"), ("p50", "median"), ("p90", "p90"), ("p95", "p95"),
              ("p99", "p99"), ("max", "max"))
FINISH_LABELS = {"stop": "stopped (EOS or stop string)", "length": "cut at max_tokens", "error": "error"}

DASH = "\u2013"


def count(n: Any) -> str:
    """1234 -> "1,234"; None -> "–"."""
    return DASH if n is None else f"{int(n):,}"


def plural(n: Any, word: str, many: str | None = None) -> str:
    """"1 row", "2 rows", "1,234 errors" (many: the plural when it is not word + "s")."""
    return f"{count(n)} {word if n == 1 else (many or word + 's')}"


def pct(frac: Any, digits: int = 1) -> str:
    """A share 0..1 as "6.1 %" (None -> "–"); shares that round to 0 or 100 but are not say "< 0.1 %"."""
    if frac is None or (isinstance(frac, float) and math.isnan(frac)):
        return DASH
    p = 100.0 * float(frac)
    step = 10.0**-digits
    if 0 < p < step:
        return f"< {step:g} %"
    if 100 - step < p < 100:
        return f"> {100 - step:.{digits}f} %"
    return f"{p:.{digits}f} %"


def num(x: Any, unit: str = "") -> str:
    """A measured number with 3-4 significant digits and thousands separators, then its unit."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return DASH
    x = float(x)
    a = abs(x)
    if a >= 1000:
        text = f"{x:,.0f}"
    elif a >= 100:
        text = f"{x:.0f}"
    elif a >= 10:
        text = f"{x:.1f}"
    elif a >= 1 or a == 0:
        text = f"{x:.2f}".rstrip("0").rstrip(".") if x != int(x) else f"{int(x)}"
    else:
        text = f"{x:.3g}"
    return f"{text} {unit}".rstrip() if unit else text


def seconds(s: Any) -> str:
    """A duration for a person: "850 ms", "12.3 s", "4 min 05 s", "2 h 03 min"."""
    if s is None:
        return DASH
    s = float(s)
    if s < 1:
        return f"{s * 1000:.0f} ms" if s >= 0.001 else f"{s * 1000:.2f} ms"
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        m, r = divmod(round(s), 60)
        return f"{m} min {r:02d} s"
    h, r = divmod(round(s), 3600)
    return f"{h} h {r // 60:02d} min"


def milliseconds(ms: Any) -> str:
    return DASH if ms is None else seconds(float(ms) / 1000.0)


def clock(epoch_s: Any) -> str:
    """A UTC wall-clock time: "2026-12-01 10:11:13 UTC"."""
    if epoch_s is None:
        return DASH
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(epoch_s)))


def ratio(b: Any, a: Any) -> str:
    """b relative to a, as "1.23×" (for side-by-side tables)."""
    if a is None or b is None or not a:
        return DASH
    return f"{float(b) / float(a):.2f}\u00d7"


def model_text(m: dict[str, Any]) -> tuple[str, str]:
    """("name", "family · dtype · quantization · size") of the report's model facts."""
    parts = [m.get("family") or m.get("architecture"), m.get("dtype")]
    quant = m.get("quantization")
    parts.append("no quantization" if quant in (None, "none") else f"quantization {quant}")
    if m.get("params"):
        parts.append(_params(m["params"]))
    return str(m.get("name") or DASH), " \u00b7 ".join(str(p) for p in parts if p)


def _params(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit} parameters"
    return f"{n} parameters"


def device_text(d: dict[str, Any]) -> str:
    name = str(d.get("name") or DASH)
    return f"{d['count']} \u00d7 {name}" if d.get("count", 1) > 1 else name
