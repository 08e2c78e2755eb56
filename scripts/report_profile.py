"""Time writing the end-of-run report of an output folder, in process, as a run does at its end.

    python3 scripts/report_profile.py OUT_DIR [--repeat 3] [--cprofile N]

matplotlib and the page module are imported first (a run imports them ahead, on a preflight
thread), then per repeat: the whole write_report (both files), and its parts: loading the records
and the numbers (build_report), the JSON, and per figure building it, its layout (constrained layout, or
margins.fit), drawing it with Agg, encoding the PNG (PIL) and base64. --cprofile N prints the N most expensive functions of one more write_report.
The report files in OUT_DIR's records folder are rewritten.
"""

from __future__ import annotations

import argparse
import base64
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cprofile", type=int, default=0)
    a = ap.parse_args()

    t = time.perf_counter()
    from batchinfer.observe import page, pagekit, plots, report
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    PNG = getattr(pagekit, "PNG_OPTIONS", {})
    try:
        from batchinfer.observe import margins
    except ImportError:  # before margins.py
        margins = None

    print(f"import page (matplotlib): {time.perf_counter() - t:.3f} s (a run does this ahead)")
    facts = report.previous_facts(a.out_dir)
    whole: list[float] = []
    for i in range(a.repeat):
        t = time.perf_counter()
        report.write_report(a.out_dir, facts)
        whole.append(time.perf_counter() - t)

        t = time.perf_counter()
        rep, steps, rows = report.build_report(a.out_dir, facts)
        t_build = time.perf_counter() - t
        t = time.perf_counter()
        json.dumps(rep, indent=1, default=str)
        t_json = time.perf_counter() - t
        figs = {
            "throughput": lambda: plots.throughput(steps, rows),
            "latency": lambda: plots.latency(rep),
            "lengths": lambda: plots.lengths(rows),
            "occupancy": lambda: plots.occupancy(steps),
            "step_times": lambda: plots.step_times(steps),
        }
        for f in (rep.get("answers") or {}).get("fields", []):
            if "counts" in f:
                figs[f"field {f['path']}"] = (lambda f=f: plots.value_counts(
                    f["path"], [(page._value(k), c) for k, c in f["counts"]], f["n"] - f["nulls"]))
        line = [f"run {i + 1}: write_report {whole[-1]:.3f} s; build_report {t_build:.3f} s, json {t_json:.3f} s"]
        total_png = 0
        for name, make in figs.items():
            t = time.perf_counter()
            fig = make()
            t_make = time.perf_counter() - t
            FigureCanvasAgg(fig)
            engine = fig.get_layout_engine()
            t = time.perf_counter()
            if engine is not None:
                engine.execute(fig)  # constrained layout: text extents of every label
            elif margins is not None:
                margins.fit(fig)  # margins from the strings that take room
            t_layout = time.perf_counter() - t
            fig.set_layout_engine("none")
            t = time.perf_counter()
            fig.canvas.draw()  # Agg rasterisation, no layout
            t_draw = time.perf_counter() - t
            rgba = fig.canvas.buffer_rgba()
            t = time.perf_counter()
            buf = io.BytesIO()
            Image.frombuffer("RGBA", (rgba.shape[1], rgba.shape[0]), rgba, "raw", "RGBA", 0, 1).save(
                buf, format="png", **PNG)
            t_png = time.perf_counter() - t
            t = time.perf_counter()
            base64.b64encode(buf.getvalue())
            t_b64 = time.perf_counter() - t
            line.append(f"  {name:18s} build {t_make * 1e3:6.1f}  layout {t_layout * 1e3:6.1f}  draw {t_draw * 1e3:6.1f}  "
                        f"png {t_png * 1e3:5.1f}  b64 {t_b64 * 1e3:4.1f} ms  {buf.tell() / 1024:6.1f} KiB")
            total_png += buf.tell()
        line.append(f"  PNG bytes in all: {total_png / 1024:.0f} KiB")
        print("\n".join(line))
    print(f"write_report: median {statistics.median(whole):.3f} s, min {min(whole):.3f} s over {len(whole)}")
    if a.cprofile:
        pr = cProfile.Profile()
        pr.enable()
        report.write_report(a.out_dir, facts)
        pr.disable()
        pstats.Stats(pr).sort_stats("cumulative").print_stats(a.cprofile)


if __name__ == "__main__":
    main()
