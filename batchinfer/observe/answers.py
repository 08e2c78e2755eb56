"""What the answers are and what they say: read from the committed output parts.

  output_frame(manifest)     the committed output (plus its ids as text, `_id`) as a polars LazyFrame
  answer_columns(frame, ...) the answers' fields as dotted-path columns ("address.city")
  field_stats(...)           per field of a structured job: counts of enum and boolean values,
                             a histogram of numbers, lengths and top values of strings, null share
  sample_answers(...)        a few successful rows (input excerpt, answer) and a few of each error kind

Field kinds come from the job's JSON schema where it is known (so an enum value no answer chose still
shows, with 0), else from the column types. Only rows without an error count: the answers that
matched their schema.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from batchinfer.io.manifest import Manifest

ANSWER_CHARS = 500  # a sample answer is cut here
MAX_FIELDS = 40
TOP_VALUES = 5
HIST_BINS = 20
CHOICE_FIELD = "answer"  # the one field of a choice / regex job: its output text


# ------------------------------------------------------------------------------------------ output


ANSWERS_SEP = "\n\u2500\u2500\u2500\n"  # between the answers of a row with sampling.n > 1


def output_frame(manifest: Manifest | None) -> pl.LazyFrame | None:
    """The committed parts as one LazyFrame with the id's canonical key (io/id_key.py, what the row
    records hold) added as `_id` (None: no output).

    An output of sampling.n > 1 (a list column `answers`, no `output_text`) gets `output_text`: its
    answers' texts in order, joined by ANSWERS_SEP, so that a row's answers read, and compare, as one.
    """
    if manifest is None or not manifest.parts or not manifest.id_column:
        return None
    from batchinfer.io.id_key import array_keys
    from batchinfer.io.manifest import scan_parts

    lf = scan_parts(manifest.part_locations)
    canonical = pl.col(manifest.id_column).map_batches(lambda s: pl.from_arrow(array_keys(s.to_arrow())), return_dtype=pl.Utf8)
    lf = lf.with_columns(canonical.alias("_id"))
    names = lf.collect_schema().names()
    if "output_text" not in names and "answers" in names:
        texts = pl.col("answers").list.eval(pl.element().struct.field("output_text").fill_null(""))
        lf = lf.with_columns(texts.list.join(ANSWERS_SEP).alias("output_text"))
    return lf


def several_answers(lf: pl.LazyFrame) -> bool:
    """Whether the output has a row per id with several answers (sampling.n > 1)."""
    return "answers" in lf.collect_schema().names()


# ------------------------------------------------------------------------------------- field kinds


@dataclass(frozen=True)
class FieldSpec:
    """One leaf field of the answers: dotted path, kind and (for enums) the allowed values."""

    path: str
    kind: str  # enum | boolean | integer | number | string | array | json
    values: tuple[Any, ...] = ()


def load_schema(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """The job's JSON schema (inline, or read from its file while it is still there), else None."""
    structured = config.get("structured") if isinstance(config, dict) else None
    v = structured.get("json_schema") if isinstance(structured, dict) else None
    if isinstance(v, dict):
        return v
    if not isinstance(v, str):
        return None
    try:
        return json.loads(v) if v.lstrip().startswith("{") else json.loads(Path(v).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def schema_fields(schema: dict[str, Any], max_depth: int = 8) -> list[FieldSpec]:
    """The leaf fields of a JSON schema (objects with properties are walked into, as dotted paths)."""
    from batchinfer.structured.arrow import resolve_ref

    out: list[FieldSpec] = []

    def walk(node: Any, path: str, depth: int) -> None:
        node = resolve_ref(node, schema)
        if not isinstance(node, dict) or depth > max_depth:
            out.append(FieldSpec(path, "json"))
            return
        for key in ("anyOf", "oneOf"):
            if key in node:
                branches = [b for b in node[key] if not (isinstance(b, dict) and b.get("type") == "null")]
                if len(branches) == 1:
                    return walk(branches[0], path, depth + 1)
                out.append(FieldSpec(path, "json"))
                return
        if "enum" in node or "const" in node:
            values = tuple(node["enum"]) if "enum" in node else (node["const"],)
            scalars = tuple(v for v in values if v is not None)
            kind = "boolean" if scalars and all(isinstance(v, bool) for v in scalars) else "enum"
            out.append(FieldSpec(path, kind, scalars))
            return
        t = node.get("type")
        types = [x for x in (t if isinstance(t, list) else [t]) if x not in (None, "null")]
        if not types and "properties" in node:
            types = ["object"]
        if types == ["object"] and isinstance(node.get("properties"), dict) and node["properties"]:
            for name, sub in node["properties"].items():
                walk(sub, f"{path}.{name}" if path else name, depth + 1)
            return
        if set(types) == {"integer", "number"}:
            types = ["number"]
        kind = types[0] if len(types) == 1 and types[0] in ("boolean", "integer", "number", "string", "array") else "json"
        out.append(FieldSpec(path, kind, (True, False) if kind == "boolean" else ()))

    walk(schema, "", 0)
    return [f if f.path else FieldSpec(CHOICE_FIELD, f.kind, f.values) for f in out]


def _kind_of(dtype: pl.DataType) -> str:
    if dtype == pl.Boolean:
        return "boolean"
    if dtype.is_integer():
        return "integer"
    if dtype.is_numeric():
        return "number"
    if dtype == pl.Utf8:
        return "string"
    if isinstance(dtype, (pl.List, pl.Array)):
        return "array"
    return "json"


# ----------------------------------------------------------------------------------- answer columns


def _flatten(expr: pl.Expr, dtype: pl.DataType, path: str) -> list[tuple[str, pl.Expr, pl.DataType]]:
    if isinstance(dtype, pl.Struct):
        out = []
        for f in dtype.fields:
            out += _flatten(expr.struct.field(f.name), f.dtype, f"{path}.{f.name}" if path else f.name)
        return out
    return [(path or CHOICE_FIELD, expr, dtype)]


def _flatten_json(value: Any, path: str, into: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten_json(v, f"{path}.{k}" if path else str(k), into)
    else:
        into[path or CHOICE_FIELD] = value


def answer_columns(lf: pl.LazyFrame, structured: dict[str, Any] | None, schema: dict[str, Any] | None) -> pl.DataFrame | None:
    """`_id` plus one column per answer field (dotted paths), for rows without an error; None when
    the job's answers have no fields (free text).

    A JSON-schema job's typed `output` column is flattened (structs into dotted paths); where the
    schema has no Arrow type its answers are JSON text, parsed here; a choice or regex job has one
    field, `answer` (its output text). With sampling.n > 1 there is one row per answer.
    """
    structured = structured or {}
    if several_answers(lf):  # sampling.n > 1: every answer counts, each with its own error
        lf = lf.select("_id", "answers").explode("answers").filter(pl.col("answers").is_not_null()).unnest("answers")
    names = lf.collect_schema()
    ok = lf.filter(pl.col("error").is_null()) if "error" in names else lf
    if structured.get("json_schema") is not None and "output" in names:
        from batchinfer.structured.arrow import arrow_type_for_schema

        typed = schema is not None and arrow_type_for_schema(schema) is not None
        if typed or isinstance(names["output"], pl.Struct):
            cols = _flatten(pl.col("output"), names["output"], "")
            return ok.select("_id", *[e.alias(p) for p, e, _ in cols]).collect()
        frame = ok.select("_id", "output").collect()  # JSON text
        flat = []
        for text in frame.get_column("output").to_list():
            row: dict[str, Any] = {}
            try:
                _flatten_json(json.loads(text) if text is not None else None, "", row)
            except ValueError:
                row = {CHOICE_FIELD: text}
            flat.append(row)
        paths = list(dict.fromkeys(p for r in flat for p in r))
        data = {p: pl.Series(p, [_scalar(r.get(p)) for r in flat], strict=False) for p in paths}
        return pl.DataFrame({"_id": frame.get_column("_id"), **data})
    if structured.get("choice") is not None or structured.get("regex") is not None:
        return ok.select("_id", pl.col("output_text").alias(CHOICE_FIELD)).collect()
    return None


def _scalar(v: Any) -> Any:
    """A parsed JSON value as one polars-friendly scalar (lists and objects as JSON text)."""
    if isinstance(v, (dict, list)):
        return json.dumps(v, ensure_ascii=False, separators=(",", ":"))
    return v


def answer_specs(answers: pl.DataFrame, schema: dict[str, Any] | None, structured: dict[str, Any] | None) -> list[FieldSpec]:
    """The fields to describe: the schema's (where present in the answers), else by column type."""
    structured = structured or {}
    present = [c for c in answers.columns if c != "_id"]
    if structured.get("choice") is not None:
        return [FieldSpec(CHOICE_FIELD, "enum", tuple(structured["choice"]))]
    known = {f.path: f for f in schema_fields(schema)} if schema is not None else {}
    out = []
    for path in present:
        spec = known.get(path)
        dtype = answers.schema[path]
        data_kind = _kind_of(dtype)
        if spec is None or (spec.kind in ("integer", "number", "boolean") and data_kind in ("string", "json")):
            spec = FieldSpec(path, data_kind, (True, False) if data_kind == "boolean" else ())
        out.append(spec)
    return out[:MAX_FIELDS]


# ------------------------------------------------------------------------------------------ stats


def hist_bins(s: pl.Series, integer: bool) -> dict[str, list[float]]:
    lo, hi = float(s.min()), float(s.max())  # type: ignore[arg-type]
    if integer and hi - lo < HIST_BINS:
        edges = [lo - 0.5 + i for i in range(int(hi - lo) + 2)]
    elif integer:
        width = math.ceil((hi - lo + 1) / HIST_BINS)
        edges = [lo - 0.5 + i * width for i in range(HIST_BINS + 1)]
    else:
        width = (hi - lo) / HIST_BINS or 1.0
        edges = [lo + i * width for i in range(HIST_BINS + 1)]
    idx = ((s.cast(pl.Float64) - edges[0]) / (edges[1] - edges[0])).floor().cast(pl.Int64).clip(0, len(edges) - 2)
    counts = idx.value_counts().sort(idx.name)
    full = [0] * (len(edges) - 1)
    for i, n in counts.iter_rows():
        full[int(i)] = int(n)
    return {"edges": edges, "counts": full}


def field_stats(answers: pl.DataFrame, specs: list[FieldSpec]) -> list[dict[str, Any]]:
    """One dict per field: path, kind, n (answers), nulls, null_share and the kind's numbers."""
    out = []
    n = answers.height
    for spec in specs:
        s = answers.get_column(spec.path)
        nulls = s.null_count()
        d: dict[str, Any] = {"path": spec.path, "kind": spec.kind, "n": n, "nulls": nulls,
                             "null_share": nulls / n if n else None}
        v = s.drop_nulls()
        if spec.kind in ("enum", "boolean"):
            counts = {(_key(k)): int(c) for k, c in v.value_counts(sort=True).iter_rows()}
            order = [_key(x) for x in spec.values] + [k for k in counts if k not in {_key(x) for x in spec.values}]
            d["counts"] = [[k, counts.get(k, 0)] for k in dict.fromkeys(order)]
        elif spec.kind in ("integer", "number") and v.dtype.is_numeric() and v.cast(pl.Float64).is_finite().any():
            f = v.cast(pl.Float64)
            f = f.filter(f.is_finite())
            d.update(min=float(f.min()), p50=float(f.median()), mean=float(f.mean()), max=float(f.max()))  # type: ignore[arg-type]
            d["hist"] = hist_bins(f, spec.kind == "integer" and v.dtype.is_integer())
        elif spec.kind == "array" and isinstance(v.dtype, (pl.List, pl.Array)) and v.len():
            lens = v.list.len()
            d["lengths"] = {"min": int(lens.min()), "p50": float(lens.median()), "max": int(lens.max())}  # type: ignore[arg-type]
        elif v.len():
            text = v.cast(pl.Utf8) if v.dtype != pl.Utf8 else v
            lens = text.str.len_chars()
            d["lengths"] = {"min": int(lens.min()), "p50": float(lens.median()), "max": int(lens.max())}  # type: ignore[arg-type]
            top = text.value_counts(sort=True).head(TOP_VALUES)
            d["distinct"] = text.n_unique()
            d["top"] = [[cut(k, 80), int(c)] for k, c in top.iter_rows()]
        out.append(d)
    return out


def _key(v: Any) -> Any:
    """An enum value as a JSON-able key (bools as true/false text would lose their type: keep them)."""
    return v if isinstance(v, (str, bool, int, float)) or v is None else json.dumps(v)


def cut(text: Any, limit: int) -> str:
    text = str(text)
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


# ---------------------------------------------------------------------------------- sample answers


def sample_answers(lf: pl.LazyFrame | None, records: pl.DataFrame, n_ok: int = 5, n_per_kind: int = 3) -> dict[str, Any]:
    """A few successful rows and a few rows of each error kind, each with its input excerpt.

    records: the run's row records (id, failed, error, excerpt, ...); rows with an excerpt come first.
    The answers are read from the output (the truth); errors from the records (the same messages).
    """
    from batchinfer.observe.records import error_kind

    rec = records.with_row_index("_order")
    excerpt = dict(zip(rec.get_column("id").to_list(), rec.get_column("excerpt").to_list()))
    candidates = (
        rec.filter(~pl.col("failed"))
        .sort([pl.col("excerpt").is_null(), pl.col("_order")])
        .head(max(n_ok * 20, 100)).get_column("id").to_list()
    )
    ok: list[dict[str, Any]] = []
    if lf is not None and candidates:
        have = lf.collect_schema().names()
        cols = [pl.col(c) if c in have else pl.lit(None).alias(c) for c in ("output_text", "finish_reason", "completion_tokens")]
        got = lf.filter(pl.col("_id").is_in(candidates)).select("_id", *cols).collect()
        by_id = {r["_id"]: r for r in got.iter_rows(named=True)}
        present = [i for i in candidates if i in by_id]
        # rows with an excerpt first; among them, answers not shown yet before repeats
        seen: set[Any] = set()
        varied = []
        for i in present:
            text = by_id[i]["output_text"]
            if text not in seen:
                seen.add(text)
                varied.append(i)
        chosen = varied[:n_ok]
        chosen += [i for i in present if i not in chosen][: n_ok - len(chosen)]
        for i in sorted(chosen, key=present.index):
            r = by_id[i]
            ok.append({"id": i, "excerpt": excerpt.get(i), "answer": cut(r["output_text"] or "", ANSWER_CHARS),
                       "finish_reason": r["finish_reason"], "completion_tokens": r["completion_tokens"]})
    errors: dict[str, dict[str, Any]] = {}
    failed = rec.filter(pl.col("failed")).with_columns(
        pl.col("error").fill_null("").map_elements(error_kind, return_dtype=pl.Utf8).alias("kind"))
    for (kind,), group in failed.sort([pl.col("excerpt").is_null(), pl.col("_order")]).group_by("kind", maintain_order=True):
        rows = [{"id": r["id"], "excerpt": r["excerpt"], "error": cut(r["error"] or "", ANSWER_CHARS)}
                for r in group.head(n_per_kind).iter_rows(named=True)]
        errors[str(kind)] = {"count": group.height, "rows": rows}
    errors = dict(sorted(errors.items(), key=lambda kv: -kv[1]["count"]))
    return {"ok": ok, "errors": errors}


def reject_samples(path: Any, n: int = 3) -> dict[str, Any] | None:
    """How many input lines were rejected (no usable id) and the first few, from the rejects file (a Location)."""
    if not path.exists():
        return None
    examples, count = [], 0
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        count += 1
        if len(examples) < n:
            try:
                r = json.loads(line)
                examples.append({"file": Path(str(r.get("file", ""))).name, "line": r.get("line"),
                                 "reason": r.get("reason"), "text": cut(r.get("text", ""), 200)})
            except ValueError:
                examples.append({"text": cut(line.strip(), 200)})
    return {"count": count, "examples": examples}
