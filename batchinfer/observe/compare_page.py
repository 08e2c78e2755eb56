"""The comparison page (`batchinfer compare A B --html PATH`): one self-contained file (pagekit.py).

Top to bottom: the two runs, the share of identical answers, per field agreement (with a plot), where
answers first differ (a histogram of the first differing token), latency and throughput side by
side, the rows that changed most, and the rows only one run has.
"""

from __future__ import annotations

import os
from pathlib import Path

from matplotlib.figure import Figure

from batchinfer.io.manifest import atomic_write_text
from batchinfer.observe import labels as L
from batchinfer.observe import plots
from batchinfer.observe.compare import NUMBERS, Comparison, fmt_number, token_text
from batchinfer.observe.pagekit import document, esc, facts, grid, img


def _agreement_plot(c: Comparison) -> Figure:
    fields = list(c.fields)[:25]
    fig = Figure(figsize=(6, 0.4 * len(fields) + 1.2), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title("Field agreement")
    names = [f.path for f in fields][::-1]
    shares = [100.0 * (f.share or 0.0) for f in fields][::-1]
    bars = ax.barh(names, shares, color="tab:green")
    for bar, v in zip(bars, shares):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {v:.1f} %", va="center", fontsize=8)
    ax.set_xlim(0, 115)
    ax.set_xlabel("rows with the same value (%)")
    return fig


def render_compare(c: Comparison) -> str:
    fp = c.first_token_positions
    where = (f"median token {L.num(fp['median'])}" if c.token_level and fp["rows"]
             else ("by character (no token ids in both runs)" if c.differing else L.DASH))
    items = [
        ("identical", "Identical answers", L.pct(c.identical_share), f"{L.count(c.identical)} of {L.count(c.matched)} rows matched by id"),
        ("differing", "Differing answers", L.count(c.differing), f"first difference: {where}"),
        ("only-a", "Only in A", L.count(c.only_a), ""),
        ("only-b", "Only in B", L.count(c.only_b), ""),
        ("model-a", "A: model", c.a.model, f"{c.a.model_detail}; {c.a.device}"),
        ("model-b", "B: model", c.b.model, f"{c.b.model_detail}; {c.b.device}"),
    ]
    body = [
        "<h1>Two runs compared</h1>",
        f'<p class="sub">A {esc(c.a.out_dir)}<br>B {esc(c.b.out_dir)}</p>',
        facts(items),
    ]
    if c.fields:
        rows = [[f.path, L.pct(f.share), f"{L.count(f.agree)} of {L.count(f.compared)}"] for f in c.fields]
        body += ['<h2 id="fields">Field agreement</h2>',
                 "<p>rows both runs answered without an error</p>",
                 grid(["Field", "Same value", "Rows"], rows, numeric=(1, 2), id_="field-agreement"),
                 img("field-agreement", "field agreement", _agreement_plot(c))]
    if c.first_token_hist is not None:
        h = c.first_token_hist
        fig = plots.histogram("Position of the first differing output token", h["edges"], h["counts"], True)
        body += ["<h2>Where answers first differ</h2>", img("first-token", "first differing token", fig)]
    head = ["", "A", "B", "B / A"]
    rows = [[label, fmt_number(kind, c.a.numbers.get(k)), fmt_number(kind, c.b.numbers.get(k)),
             L.ratio(c.b.numbers.get(k), c.a.numbers.get(k))] for k, (label, kind) in NUMBERS.items()]
    rows = [["Rows (ok / errors)", f"{L.count(c.a.ok)} / {L.count(c.a.errors)}", f"{L.count(c.b.ok)} / {L.count(c.b.errors)}", ""], *rows]
    body += ['<h2 id="side-by-side">Latency and throughput</h2>', grid(head, rows, numeric=(1, 2, 3), id_="numbers")]
    if c.changed:
        prompt = {True: "same", False: "differs", None: L.DASH}
        rows = [[ch.id, L.pct(ch.changed_share, 0), token_text(ch), ", ".join(ch.fields) or L.DASH,
                 prompt[ch.same_prompt], ch.context_a, ch.context_b] for ch in c.changed]
        body += [f'<h2 id="changed">Rows that changed most ({L.count(len(c.changed))} of {L.count(c.differing)})</h2>',
                 "<p>changed: the share of the answer outside its common start and end; the texts are shown "
                 "around the first differing character</p>",
                 grid(["Row", "Changed", "First difference", "Fields", "Prompt", "A", "B"], rows, numeric=(1,), text=(5, 6),
                      id_="changed-rows")]
    for name, n, ids in (("A", c.only_a, c.only_a_ids), ("B", c.only_b, c.only_b_ids)):
        if n:
            more = f" \u2026 ({L.count(n)} in all)" if n > len(ids) else ""
            body.append(f'<h2 id="only-{name.lower()}">Only in {name} ({L.count(n)})</h2><p>{esc(", ".join(ids))}{esc(more)}</p>')
    return document("batchinfer compare", "\n".join(body))


def write_compare_page(c: Comparison, path: str | Path) -> Path:
    """Write the comparison page to path (atomically); returns its absolute path."""
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"--html {path}: folder {path.parent} does not exist")
    atomic_write_text(path, render_compare(c))
    return Path(os.path.abspath(path))
