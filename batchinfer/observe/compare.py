"""Two runs compared answer by answer: `batchinfer compare OUT_A OUT_B`, and `compare_runs` for tests.

Rows are matched by id (the output's id column, as text). A row's answer is identical when its output
text and finish reason are (an error row: when both are errors without text); with sampling.n > 1,
when all its answers' texts are, in order (answers.output_frame; first differences by character). For each differing row:
the first differing output token (from the token-id sidecars, when both runs logged the row with
--log-token-ids) and the first differing character, the schema fields that differ, and how much of
the answer changed: the share outside the longest common start and end (0 %: identical, 100 %:
nothing in common at either end), in tokens where both have ids, else characters. The rows that
changed most come first. Beside that: per schema field agreement (over rows both answered without an
error), latency and throughput side by side, and the rows only one run has.

The job's config (model, structured spec) is read from each run's `_report.json`; a run written
without a report still compares by text. The result is a frozen dataclass (Comparison); `as_dict()` gives its JSON form, `summary_text()` the
lines the CLI prints, compare_page.write_compare_page the page. Speculative decoding must compare at
100 % identical against plain decoding; a dtype change (FP8) shows its agreement.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from batchinfer.io import layout
from batchinfer.io.manifest import Manifest
from batchinfer.io.store import Location
from batchinfer.observe import answers
from batchinfer.observe import labels as L

log = logging.getLogger(__name__)

MAX_CHANGED = 50  # RowChange entries kept (the rows that changed most)
MAX_IDS = 20  # ids listed of the rows only one run has
CONTEXT = 40  # characters shown either side of the first difference


@dataclass(frozen=True)
class RunSide:
    """One run of a comparison: what it is and its numbers (None where a run did not record one)."""

    out_dir: str
    model: str  # the model's name
    model_detail: str  # family, dtype, quantization, size
    device: str
    rows: int
    ok: int
    errors: int
    token_ids: bool  # has a --log-token-ids sidecar
    numbers: dict[str, float | None]  # NUMBERS key -> value


# key -> (label, formatter kind) of the side-by-side table
NUMBERS = {
    "wall_s": ("Wall time", "s"),
    "engine_s": ("Engine time", "s"),
    "documents_per_hour": ("Documents per hour (wall time)", "n"),
    "rows_per_s": ("Rows per second (engine time)", "n"),
    "output_tokens_per_s": ("Output tokens per second", "n"),
    "total_tokens_per_s": ("All tokens per second", "n"),
    "mean_output_tokens": ("Mean output length (tokens)", "n"),
    "ttft_p50": ("Time to first token, median", "s"),
    "ttft_p90": ("Time to first token, p90", "s"),
    "latency_p50": ("Row latency, median", "s"),
    "latency_p90": ("Row latency, p90", "s"),
    "latency_p99": ("Row latency, p99", "s"),
}


@dataclass(frozen=True)
class FieldAgreement:
    """How often one answer field is equal in both runs (rows both answered without an error)."""

    path: str
    compared: int
    agree: int

    @property
    def share(self) -> float | None:
        return self.agree / self.compared if self.compared else None


@dataclass(frozen=True)
class RowChange:
    """One row whose answer differs."""

    id: str
    changed_share: float  # share of the answer outside the common start and end (tokens or characters)
    first_token: int | None  # index of the first differing output token (None: a run has no ids for the row)
    token_a: int | None  # the token ids there (None: that answer ended before)
    token_b: int | None
    token_text_a: str | None  # the same tokens decoded (None where no tokenizer could be loaded)
    token_text_b: str | None
    first_char: int  # index of the first differing character of the output text
    context_a: str  # the text around the first difference
    context_b: str
    fields: tuple[str, ...]  # answer fields that differ
    same_prompt: bool | None  # both runs sent the same prompt token ids (None: not known, no sidecars)
    finish_a: str | None
    finish_b: str | None
    answer_a: str | None
    answer_b: str | None


@dataclass(frozen=True)
class Comparison:
    """Run B against run A, row by row (see the module docstring)."""

    a: RunSide
    b: RunSide
    matched: int
    identical: int
    only_a: int
    only_b: int
    only_a_ids: tuple[str, ...]
    only_b_ids: tuple[str, ...]
    fields: tuple[FieldAgreement, ...]
    changed: tuple[RowChange, ...]  # the rows that changed most first, at most MAX_CHANGED
    token_level: bool  # first differing tokens come from both runs' token-id sidecars
    same_prompt_differing: int  # differing rows whose prompt token ids are the same in both (the model changed them)
    first_token_positions: dict[str, float | None]  # rows, min / median / max over differing rows with ids
    first_token_hist: dict[str, list[float]] | None  # their histogram (answers.hist_bins: edges, counts)

    @property
    def differing(self) -> int:
        return self.matched - self.identical

    @property
    def identical_share(self) -> float | None:
        """identical / matched (None when no row matched)."""
        return self.identical / self.matched if self.matched else None

    def field(self, path: str) -> FieldAgreement:
        return next(f for f in self.fields if f.path == path)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["identical_share"] = self.identical_share
        d["differing"] = self.differing
        for f, fd in zip(self.fields, d["fields"]):
            fd["share"] = f.share
        return d

    def summary_text(self) -> str:
        return summary_text(self)


# ------------------------------------------------------------------------------------------ loading


def _side(out: "Location") -> tuple[RunSide, dict[str, Any] | None]:
    """(the run's side, its report dict or None when it has no run records)."""
    from batchinfer.observe.report import build_report, previous_facts

    from batchinfer.observe.records import part_locations

    has_ids = bool(part_locations(layout.token_ids_dir(out)))
    try:
        report, _, _ = build_report(out, previous_facts(out))
    except Exception as e:  # no records: the answers still compare
        log.warning("compare: %s has no usable run records (%s); its numbers are left out", out, e)
        manifest = Manifest.load(out)
        rows = sum(p.rows for p in manifest.parts) if manifest else 0
        errors = sum(p.errors for p in manifest.parts) if manifest else 0
        return RunSide(str(out), L.DASH, "", L.DASH, rows, rows - errors, errors, has_ids, {k: None for k in NUMBERS}), None
    t, tp, lat, h = report["totals"], report["throughput"], report["latency_s"], report["headline"]
    name, small = L.model_text(report["model"])
    numbers = {
        "wall_s": h["wall_s"], "engine_s": tp["engine_s"], "documents_per_hour": h["documents_per_hour"],
        "rows_per_s": tp["rows_per_s"], "output_tokens_per_s": tp["completion_tokens_per_s"],
        "total_tokens_per_s": tp["total_tokens_per_s"], "mean_output_tokens": report["lengths"]["completion_tokens"]["mean"],
        "ttft_p50": lat["ttft"]["p50"], "ttft_p90": lat["ttft"]["p90"],
        "latency_p50": lat["row"]["p50"], "latency_p90": lat["row"]["p90"], "latency_p99": lat["row"]["p99"],
    }
    side = RunSide(str(out), name, small, L.device_text(report["device"]), t["rows"], t["ok"], t["errors"], has_ids, numbers)
    return side, report


def _output(out: "Location") -> tuple[pl.LazyFrame, Manifest]:
    if not out.is_dir():
        raise FileNotFoundError(f"{out}: no such output folder")
    manifest = Manifest.load(out)
    lf = answers.output_frame(manifest)
    if manifest is None or lf is None:
        raise FileNotFoundError(f"{out}: no committed output ({layout.manifest_path(out)} with parts); was it written by batchinfer run?")
    return lf, manifest


class _Tokens:
    """Decodes single token ids with a run's tokenizer, when its model folder can still be read."""

    def __init__(self, report: dict[str, Any] | None) -> None:
        self._tok: Any = None
        from batchinfer.observe.runinfo import section

        path = section((report or {}).get("config"), "model").get("path")
        if path:
            try:
                from batchinfer.models.loader import load_tokenizer, resolve_model_dir

                self._tok = load_tokenizer(resolve_model_dir(path))
            except Exception as e:
                log.info("compare: no tokenizer for %s (%s); token ids are shown without text", path, e)

    def text(self, token: int | None) -> str | None:
        if self._tok is None or token is None:
            return None
        return self._tok.decode([token], skip_special_tokens=False)


# -------------------------------------------------------------------------------------------- rows


def _common_ends(a: Any, b: Any) -> tuple[int, int]:
    """(length of the common start, length of the common end not overlapping it)."""
    n = min(len(a), len(b))
    start = 0
    while start < n and a[start] == b[start]:
        start += 1
    end = 0
    while end < n - start and a[len(a) - 1 - end] == b[len(b) - 1 - end]:
        end += 1
    return start, end


def _changed_share(a: Any, b: Any) -> float:
    longest = max(len(a), len(b))
    if longest == 0:
        return 0.0
    start, end = _common_ends(a, b)
    return 1.0 - (start + end) / longest


def _around(text: str | None, i: int) -> str:
    text = text or ""
    lo = max(0, i - CONTEXT)
    return ("\u2026" if lo else "") + text[lo: i + CONTEXT] + ("\u2026" if i + CONTEXT < len(text) else "")


def _field_diffs(lf_a: pl.LazyFrame, lf_b: pl.LazyFrame, report_a: dict[str, Any] | None,
                 report_b: dict[str, Any] | None) -> tuple[tuple[FieldAgreement, ...], dict[str, tuple[str, ...]]]:
    """(per field agreement, id -> differing fields) for structured jobs; empty for free text."""
    def cols(lf: pl.LazyFrame, report: dict[str, Any] | None) -> pl.DataFrame | None:
        from batchinfer.observe.runinfo import section

        config = (report or {}).get("config")
        schema = answers.load_schema(config) or (report or {}).get("schema")
        return answers.answer_columns(lf, section(config, "structured"), schema)

    ca, cb = cols(lf_a, report_a), cols(lf_b, report_b)
    if ca is None or cb is None:
        return (), {}
    paths = [p for p in ca.columns if p != "_id" and p in cb.columns]
    both = ca.select("_id", *paths).join(cb.select("_id", *paths), on="_id", how="inner", suffix="__b")
    agreements = []
    diffs = []
    for p in paths:
        a_col, b_col = both.get_column(p), both.get_column(f"{p}__b")
        if a_col.dtype != b_col.dtype:
            a_col, b_col = a_col.cast(pl.Utf8, strict=False), b_col.cast(pl.Utf8, strict=False)
        same = a_col.eq_missing(b_col)
        agreements.append(FieldAgreement(p, both.height, int(same.sum())))
        diffs.append((~same).alias(p))
    per_row: dict[str, tuple[str, ...]] = {}
    if diffs:
        flags = pl.DataFrame([both.get_column("_id"), *diffs])
        for r in flags.iter_rows(named=True):
            names = tuple(p for p in paths if r[p])
            if names:
                per_row[r["_id"]] = names
    return tuple(agreements), per_row


def _token_ids(out: "Location", ids: list[str]) -> dict[str, tuple[list[int], list[int]]]:
    """id -> (prompt token ids, output token ids) from a run's sidecar, for the given ids."""
    from batchinfer.observe.tokenlog import scan_token_ids

    frame = scan_token_ids(out).filter(pl.col("id").is_in(ids)).collect()  # only the differing rows' ids
    return {i: (p, o) for i, p, o in frame.select("id", "prompt_token_ids", "output_token_ids").iter_rows()}


def compare_runs(out_a: str | Path, out_b: str | Path, max_changed: int = MAX_CHANGED) -> Comparison:
    """Compare the committed output of run B with run A's (see the module docstring).

    Raises FileNotFoundError (one line) when a folder has no committed output.
    """
    out_a, out_b = layout.output_dir(out_a), layout.output_dir(out_b)
    lf_a, _ = _output(out_a)
    lf_b, _ = _output(out_b)
    side_a, report_a = _side(out_a)
    side_b, report_b = _side(out_b)
    cols = ["_id", "output_text", "finish_reason"]
    a = lf_a.select(cols).collect()
    b = lf_b.select(cols).collect()
    joined = a.join(b, on="_id", how="inner", suffix="_b")
    same = joined.get_column("output_text").eq_missing(joined.get_column("output_text_b")) & joined.get_column(
        "finish_reason").eq_missing(joined.get_column("finish_reason_b"))
    differing = joined.filter(~same)
    only_a = a.join(b, on="_id", how="anti").get_column("_id").sort()
    only_b = b.join(a, on="_id", how="anti").get_column("_id").sort()
    fields, field_diffs = _field_diffs(lf_a, lf_b, report_a, report_b)

    diff_ids = differing.get_column("_id").to_list()
    one_answer = not answers.several_answers(lf_a) and not answers.several_answers(lf_b)  # the sidecar logs one
    ids_a = _token_ids(out_a, diff_ids) if side_a.token_ids and one_answer else {}
    ids_b = _token_ids(out_b, diff_ids) if side_b.token_ids and one_answer else {}
    token_level = bool(ids_a) and bool(ids_b)
    changes = []
    positions = []
    same_prompts = 0
    for r in differing.iter_rows(named=True):
        rid, ta, tb = r["_id"], r["output_text"] or "", r["output_text_b"] or ""
        char = _common_ends(ta, tb)[0]
        seq_a, seq_b, same_prompt = None, None, None
        if rid in ids_a and rid in ids_b:
            (prompt_a, seq_a), (prompt_b, seq_b) = ids_a[rid], ids_b[rid]
            same_prompt = prompt_a == prompt_b
            same_prompts += same_prompt
        if seq_a is not None and seq_b is not None:
            first = _common_ends(seq_a, seq_b)[0]
            positions.append(first)
            tok_a = seq_a[first] if first < len(seq_a) else None
            tok_b = seq_b[first] if first < len(seq_b) else None
            share = _changed_share(seq_a, seq_b)
        else:
            first = tok_a = tok_b = None
            share = _changed_share(ta, tb)
        changes.append(RowChange(
            rid, share, first, tok_a, tok_b, None, None, char, _around(ta, char), _around(tb, char),
            field_diffs.get(rid, ()), same_prompt, r["finish_reason"], r["finish_reason_b"],
            answers.cut(ta, answers.ANSWER_CHARS) if r["output_text"] is not None else None,
            answers.cut(tb, answers.ANSWER_CHARS) if r["output_text_b"] is not None else None,
        ))
    changes.sort(key=lambda c: (-len(c.fields), -c.changed_share, c.id))
    top = changes[:max_changed]
    if top and token_level:  # decode the first differing tokens of the rows shown
        dec_a, dec_b = _Tokens(report_a), _Tokens(report_b)
        top = [dataclasses.replace(c, token_text_a=dec_a.text(c.token_a), token_text_b=dec_b.text(c.token_b)) for c in top]
    pos = pl.Series(positions, dtype=pl.Int64)
    return Comparison(
        a=side_a, b=side_b, matched=joined.height, identical=int(same.sum()),
        only_a=only_a.len(), only_b=only_b.len(),
        only_a_ids=tuple(only_a.head(MAX_IDS).to_list()), only_b_ids=tuple(only_b.head(MAX_IDS).to_list()),
        fields=fields, changed=tuple(top), token_level=token_level, same_prompt_differing=same_prompts,
        first_token_positions={
            "rows": pos.len(),
            "min": float(pos.min()) if pos.len() else None,  # type: ignore[arg-type]
            "median": float(pos.median()) if pos.len() else None,  # type: ignore[arg-type]
            "max": float(pos.max()) if pos.len() else None,  # type: ignore[arg-type]
        },
        first_token_hist=answers.hist_bins(pos.cast(pl.Float64), integer=True) if pos.len() else None,
    )


# ------------------------------------------------------------------------------------------ text


def fmt_number(kind: str, x: Any) -> str:
    return L.seconds(x) if kind == "s" else L.num(x)


def token_text(c: RowChange) -> str:
    """"token 3: ' cat' (id 512) vs ' dog' (id 77)" for a change with token ids, else the character."""
    if c.first_token is None:
        return f"character {c.first_char}"

    def one(tok: int | None, text: str | None) -> str:
        if tok is None:
            return "(end of answer)"
        return f"{text!r} (id {tok})" if text is not None else f"id {tok}"

    return f"token {c.first_token}: {one(c.token_a, c.token_text_a)} vs {one(c.token_b, c.token_text_b)}"


def summary_text(c: Comparison, rows: int = 10) -> str:
    lines = [
        f"A: {c.a.out_dir} ({c.a.model}: {c.a.model_detail}; {c.a.device})",
        f"B: {c.b.out_dir} ({c.b.model}: {c.b.model_detail}; {c.b.device})",
        f"rows matched by id: {c.matched:,}; only in A: {c.only_a:,}; only in B: {c.only_b:,}",
        f"identical answers: {c.identical:,} of {c.matched:,} ({L.pct(c.identical_share)}); differing: {c.differing:,}",
    ]
    fp = c.first_token_positions
    if c.token_level and fp["rows"]:
        lines.append(f"first differing token (token-id sidecars): median position {L.num(fp['median'])} "
                     f"(min {L.num(fp['min'])}, max {L.num(fp['max'])}) over {fp['rows']:,} rows; "
                     f"{c.same_prompt_differing:,} of them had the same prompt tokens in both runs")
    elif c.differing:
        lines.append("first differences by character (token positions need --log-token-ids in both runs and one answer per row)")
    if c.fields:
        lines.append("field agreement: " + ", ".join(f"{f.path} {L.pct(f.share)}" for f in c.fields))
    width = max(len(label) for label, _ in NUMBERS.values())
    lines.append(f"{'':{width}}  {'A':>12}  {'B':>12}  {'B/A':>7}")
    for key, (label, kind) in NUMBERS.items():
        va, vb = c.a.numbers.get(key), c.b.numbers.get(key)
        lines.append(f"{label:{width}}  {fmt_number(kind, va):>12}  {fmt_number(kind, vb):>12}  {L.ratio(vb, va):>7}")
    if c.changed:
        lines.append(f"rows that changed most (of {c.differing:,}):")
        for ch in c.changed[:rows]:
            fields = f"; fields {', '.join(ch.fields)}" if ch.fields else ""
            prompt = {True: "; same prompt", False: "; prompt differs", None: ""}[ch.same_prompt]
            lines.append(f"  {ch.id}: {L.pct(ch.changed_share, 0)} changed; {token_text(ch)}{fields}{prompt}")
            lines.append(f"      A: {ch.context_a!r}")
            lines.append(f"      B: {ch.context_b!r}")
    for name, n, ids in (("A", c.only_a, c.only_a_ids), ("B", c.only_b, c.only_b_ids)):
        if n:
            lines.append(f"only in {name}: {', '.join(ids)}" + (f" ... ({n:,} in all)" if n > len(ids) else ""))
    return "\n".join(lines)
