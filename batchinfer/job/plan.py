"""Stages 1 and 2 of a job: plan the inputs (files, ids, schema, output folder) and stream the rows not yet done.

Exactly-once resume: see batchinfer/io/manifest.py for the commit protocol. The finished ids come from
the committed parts; a row whose id is among them is skipped when the input is read again.
"""

from __future__ import annotations

import functools
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import polars as pl
import pyarrow as pa

from batchinfer.io import layout
from batchinfer.io import manifest as mf
from batchinfer.io.id_key import common_type, normalize_type
from batchinfer.io.ids import IdCheck, check_ids, describe_types
from batchinfer.io.model_files import model_components
from batchinfer.io.readers import InputError, InputFile, Reject, Row, input_columns, iter_rows, list_input_files, parquet_schema, partition_types
from batchinfer.io.resume import HASH_COLUMN, Finished, parts_to_widen, read_finished, rewrite_parts, row_hash
from batchinfer.io.store import Location, StoreError
from batchinfer.io.writer import existing_schema
from batchinfer.job.phases import PhaseTimer
from batchinfer.job.preflight import Preflight
from batchinfer.job.spec import JobError, JobSpec

log = logging.getLogger(__name__)


# ---- stage 1: plan the inputs ------------------------------------------------------------------------


@dataclass
class JobPlan:
    """Everything known before the engine starts: files, output folder state, fingerprint; and the
    preflight (the id scan, tokenizer and grammar, on threads while the model loads: plan_inputs)."""

    spec: JobSpec
    files: list[InputFile]
    preflight: Preflight
    model_dir: Path
    manifest: mf.Manifest
    finished: pl.Series  # canonical keys (io/id_key.py) of the ids already in the output
    key_types: dict[str, pa.DataType | None]
    recovered: int = 0
    lock: Any = None  # the output folder's lock (an open file); close() releases it
    outside_rows: int = 0  # committed rows whose id is in none of the current input files (inputs gone)
    outside_errors: int = 0  # ... of those, rows with an error
    redone: int = 0  # committed rows dropped because their input row changed (input.check_content)
    id_type_from_scan: bool = False  # key_types' id column is set by check(), from the scan (a fresh output)

    def close(self) -> None:
        if self.lock is not None:
            self.lock.close()
            self.lock = None

    @property
    def output_dir(self) -> Location:
        return self.manifest.folder

    @property
    def ids(self) -> IdCheck:
        """Every usable id of the input (waits for the preflight's scan; raises its InputError)."""
        return self.preflight.ids.result()

    @property
    def resumes(self) -> bool:
        """Whether the output held committed parts when planned (then the scan was done at once)."""
        return bool(self.manifest.parts)

    def check(self) -> None:
        """Wait for the preflight; raise the user's error it found (duplicate id, schema, tokenizer). Call
        before reading rows for the engine or the output's columns (key_types)."""
        self.preflight.check()
        if self.id_type_from_scan:
            self.id_type_from_scan = False
            self.key_types = _widen_ids(self.spec, self.manifest, self.ids, Finished(), self.key_types)

    @functools.cached_property
    def may_have_rows(self) -> bool:
        """False only when no input file can hold a row (Parquet footers say 0 rows, JSONL files are empty)."""
        import pyarrow.parquet as pq

        for f in self.files:
            try:
                if (pq.ParquetFile(f.path).metadata.num_rows if f.format == "parquet" else Path(f.path).stat().st_size) > 0:
                    return True
            except Exception:  # unreadable: the scan says why
                return True
        return False

    @functools.cached_property
    def pending_count(self) -> int:
        """Rows with an id not yet in the output (counted once: `finished` is fixed for the plan's life)."""
        if self.finished.is_empty():
            return self.ids.num_rows
        return self.ids.ids.lazy().filter(~pl.col("id").is_in(self.finished.implode())).select(pl.len()).collect().item()


def fingerprint_components(spec: JobSpec, model_dir: Path) -> dict[str, Any]:
    """The inputs of the fingerprint: everything that changes the outputs (not engine speed knobs)."""
    s = spec.structured
    structured = None
    if s is not None:
        c = s.constraint()
        structured = {"kind": c.kind, "value": c.value, "whitespace": c.whitespace, "backend": spec.grammar_backend}
        if c.max_string_length is not None:
            structured["max_string_length"] = c.max_string_length
    return {
        "model": {"files": model_components(model_dir), "dtype": spec.model.dtype, "max_model_len": spec.model.max_model_len,
                  **({"quantization": spec.model.quantization} if spec.model.quantization != "none" else {}),
                  **({"fp8_keep": list(spec.model.fp8_keep)} if spec.model.fp8_keep else {})},
        "prompt": _without(spec.prompt.model_dump(mode="json"), {"messages": None}),
        "sampling": _without(spec.sampling.model_dump(mode="json"), {"n": 1, "logprobs": None}),
        "structured": structured,
        "columns": {"id": spec.input.id_column, "keep": list(spec.output.keep_columns),
                    **({"check_content": True} if spec.input.check_content else {})},
    }


def _without(fields: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """fields less the later-added ones still at their default: output written before they existed
    keeps its fingerprint (and resumes)."""
    return {k: v for k, v in fields.items() if not (k in defaults and v == defaults[k])}


def check_schema(spec: JobSpec, tokenizer: Any, vocab_size: int) -> None:
    """Refuse a constraint the job's grammar backend cannot compile, before the engine loads (raises GrammarError).

    The backend is spec.grammar_backend (structured.backend), the one the engine then uses.
    """
    from batchinfer.structured.compiler import check_constraint

    if spec.structured is not None:
        check_constraint(spec.structured.constraint(), tokenizer, vocab_size, spec.grammar_backend)


def resolve_model(spec: JobSpec) -> Path:
    from batchinfer.models.loader import ModelLoadError, resolve_model_dir

    try:
        return resolve_model_dir(spec.model.path)
    except ModelLoadError as e:
        raise JobError(f"model.path: {e}") from None


def key_types(spec: JobSpec, files: list[InputFile], ids: IdCheck | None = None) -> dict[str, pa.DataType | None]:
    """Output types of the id and kept columns.

    The id: the common type of every input file's ids (io/id_key.py; widened again with the committed
    parts' type when the output is opened). Kept columns: from the first Parquet file that has them,
    else inferred from the first part."""
    names = [spec.input.id_column] + [c for c in spec.output.keep_columns if c != spec.input.id_column]
    types: dict[str, pa.DataType | None] = {n: None for n in names}
    hive = partition_types(files)
    for f in files:
        cols = input_columns(f)
        if cols is None:
            continue
        if spec.input.id_column not in cols:  # (the id scan says so too; here it costs one footer read)
            raise InputError(f"{f.path}: no id column '{spec.input.id_column}' (columns: {', '.join(cols)})")
        missing = [c for c in spec.output.keep_columns if c not in cols]
        if missing:
            raise InputError(f"output.keep_columns: {', '.join(missing)} not a column of {f.path} (columns: {', '.join(cols)})")
        schema = parquet_schema(f)
        for n in names:
            if types[n] is None:
                types[n] = schema.field(n).type if n in schema.names else hive[n]
    for n in names:  # JSONL inputs: a partition column's type is known, other columns are inferred
        if types[n] is None and n in hive:
            types[n] = hive[n]
    common = ids.id_type if ids is not None else None
    if common is not None:
        types[spec.input.id_column] = common.type
    if spec.input.check_content:
        types[HASH_COLUMN] = pa.string()
    return types


def check_writable(out: Location) -> None:
    """Create the output folder and its records folder and prove a file can be written there (a
    read-only folder, file system or bucket is the user's error: JobError, exit 2, before anything loads).
    The probe is written in the records folder's tmp/ and, on the local disk, renamed into the output
    folder and removed at once, the path every part takes."""
    probe = layout.tmp_dir(out) / f".probe-{os.getpid()}.tmp"  # in tmp/: removed by the next start if left behind
    try:
        out.makedirs()
        layout.records_dir(out).makedirs()
        probe.write_atomic(b"")
        if probe.atomic_rename:
            moved = out / probe.name
            probe.move_to(moved)
            moved.delete()
        else:
            probe.delete()
    except OSError as e:
        raise JobError(f"output.path: cannot write to {out}: {e.strerror or e}") from None


def plan_inputs(
    spec: JobSpec, overwrite: bool = False, pool: ThreadPoolExecutor | None = None, phases: PhaseTimer | None = None
) -> JobPlan:
    """Stage 1: list files, check their columns and the schema's text, open the output folder (recover,
    fingerprint check), and start the preflight on `pool`'s threads (none: at once, here): the id
    scan, the tokenizer, the grammar compile. Call JobPlan.check() before reading rows for the engine.

    An output that holds committed parts is a resume: its pending rows, the output's id type (older
    parts widened) and the input.check_content redo all need the ids, so there the scan is done at
    once; on a fresh output it runs while the model loads (check() then fixes the id type)."""
    model_dir = resolve_model(spec)
    out = output_location(spec)
    records = layout.records_dir(out)
    files = [f for f in list_input_files(spec.input.path, spec.input.format) if not (f.location.is_within(out) or f.location.is_within(records))]
    if not files:
        raise InputError(f"input.path: no input files outside output.path ({out})")
    types = key_types(spec, files)  # id and kept columns of every Parquet file (footers only)
    if spec.structured is not None:
        from batchinfer.structured.compiler import check_schema_text

        check_schema_text(spec.structured.constraint())  # a malformed schema or regex, before anything loads
    components = fingerprint_components(spec, model_dir)
    fp = mf.fingerprint_of(components)
    hashes = mf.component_hashes(components)
    if out.is_file():
        raise JobError(f"output.path: {out} is a file, not a folder")
    check_writable(out)
    lock = mf.lock_output(out)
    try:
        manifest, recovered = _open_manifest(spec, fp, hashes, overwrite)
        if not manifest.parts:  # a fresh output: nothing needs the ids before the engine starts
            plan = JobPlan(spec, files, Preflight(spec, files, model_dir, pool, phases), model_dir, manifest,
                           pl.Series("id", [], dtype=pl.Utf8), types, recovered, lock, id_type_from_scan=True)
        else:
            with phases.span("input_scan") if phases is not None else nullcontext():
                ids = check_ids(files, spec.input.id_column, spec.input.duplicates)
            types = key_types(spec, files, ids)
            preflight = Preflight(spec, files, model_dir, pool, phases, ids=ids)
            plan = _open_output(spec, files, preflight, model_dir, types, manifest, recovered, lock)
    except BaseException:
        lock.close()
        raise
    if pool is None:
        try:
            plan.check()  # done here already: raise its error now
        except BaseException:
            plan.close()
            raise
    return plan


def _open_manifest(spec: JobSpec, fp: str, hashes: dict[str, str], overwrite: bool) -> tuple[mf.Manifest, int]:
    """Under the folder lock: clear (--overwrite), clean temps, check the fingerprint, recover parts."""
    out = output_location(spec)
    if layout.migrate_legacy(out):
        log.info("moved the run records of %s to %s (this version keeps the output folder to the output)", out, layout.records_dir(out))
    if overwrite:
        mf.clear_output(out)
    removed = mf.remove_temp_files(out)
    if removed:
        log.info("removed %d unfinished temp file(s) from %s", removed, out)
    manifest = mf.Manifest.load(out)
    if manifest is not None and manifest.fingerprint != fp:
        if manifest.parts or mf.part_files(out):
            changed = [k for k in hashes if manifest.components.get(k) != hashes[k]]
            raise JobError(
                f"{out} holds output of a different job (changed: {', '.join(changed) or 'fingerprint'}); "
                "use --overwrite to replace it, or a new output.path"
            )
        manifest = None  # an earlier attempt that committed nothing: no output to protect
    if manifest is None:
        manifest = mf.Manifest(out, fp, hashes, spec.input.id_column)
    recovered, deleted = mf.recover(manifest)  # raises JobError for parts of another job
    manifest.save()
    if deleted:
        log.warning("deleted %d unreadable part file(s); their rows will be done again", deleted)
    if recovered:
        log.info("recovered %d committed part(s) missing from the manifest", recovered)
    return manifest, recovered


def _open_output(
    spec: JobSpec,
    files: list[InputFile],
    preflight: Preflight,
    model_dir: Path,
    key_types: dict[str, pa.DataType | None],
    manifest: mf.Manifest,
    recovered: int,
    lock: Any,
) -> JobPlan:
    """An output with committed parts: its finished ids, the id type (older parts widened), check_content."""
    out = spec.output.path  # a local path or a URI: layout.output_dir reads both
    ids = preflight.ids.result()
    finished = read_finished(manifest, spec.input.id_column)
    key_types = _widen_ids(spec, manifest, ids, finished, key_types)
    redone = _check_content(spec, files, manifest, finished) if spec.input.check_content else 0
    if redone:
        finished = read_finished(manifest, spec.input.id_column)
    if manifest.parts:
        schema = existing_schema(out, manifest.parts[0].name)
        key_types = {n: schema.field(n).type if n in schema.names and n != spec.input.id_column else t for n, t in key_types.items()}
    unique = finished.rows.unique("id", keep="first", maintain_order=True)
    current = unique.join(ids.ids.select("id"), on="id", how="semi")
    gone, twice = unique.height - current.height, finished.rows.height - unique.height
    outside = gone + twice
    outside_errors = int(finished.rows["error"].sum()) - int(current["error"].sum())
    if gone:
        log.warning("%d committed row(s) in %s have ids that are in none of the current input files (inputs "
                    "deleted or changed); they are kept, and not counted as rows of this job's input", gone, out)
    if twice:
        log.warning("%d committed row(s) in %s repeat an id of another committed row (written by an older "
                    "version); only one of each is counted", twice, out)
    return JobPlan(spec, files, preflight, model_dir, manifest, current["id"], key_types, recovered, lock,
                   outside, outside_errors, redone)


def _widen_ids(spec: JobSpec, manifest: mf.Manifest, ids: IdCheck, finished: Finished,
               key_types: dict[str, pa.DataType | None]) -> dict[str, pa.DataType | None]:
    """The output id type that holds every id of the inputs and the committed parts; rewrite older
    parts written with a narrower type (an int32 output meeting int64 or string ids), keys unchanged."""
    id_col = spec.input.id_column
    sources = list(ids.types) + list(finished.part_types.values())
    common = common_type(sources)
    if common is None:
        return key_types
    if len({str(normalize_type(s.type)) for s in sources if not pa.types.is_null(s.type)}) > 1:
        log.info("id column '%s' has several types (%s): the output holds it as %s", id_col, describe_types(sources), common.type)
    old = parts_to_widen(finished, common.type)
    if old:
        log.info("rewriting %d committed part(s) with the id column as %s", len(old), common.type)
        rewrite_parts(manifest, id_col, old, common.type)
    return {**key_types, id_col: common.type}


def _check_content(spec: JobSpec, files: list[InputFile], manifest: mf.Manifest, finished: Finished) -> int:
    """input.check_content: committed rows whose input row changed since are taken out of their parts
    (so they are done again, still once); returns how many."""
    stored = finished.rows.filter(pl.col("hash").is_not_null()).select("id", "hash")
    if stored.height == 0:
        return 0
    keys: list[str] = []
    hashes: list[str] = []
    for batch in iter_rows(files, spec.input.id_column, spec.input.batch_size):
        for item in batch:
            if isinstance(item, Row):
                keys.append(item.id_key(spec.input.id_column))
                hashes.append(row_hash(item.values))
    now = pl.DataFrame({"id": keys, "now": hashes}, schema={"id": pl.Utf8, "now": pl.Utf8})
    changed = stored.join(now, on="id", how="inner").filter(pl.col("hash") != pl.col("now"))
    if changed.height == 0:
        return 0
    parts = sorted(set(finished.rows.join(changed.select("id"), on="id", how="semi")["part"].to_list()))
    n = rewrite_parts(manifest, spec.input.id_column, parts, drop=changed["id"])
    log.warning("%d committed row(s) have changed input since they were answered (input.check_content); "
                "they are done again (first: id %r)", n, changed["id"][0])
    return n


def output_location(spec: JobSpec) -> Location:
    """The job's output folder (local or a URI); a path no store serves is the user's error."""
    try:
        return layout.output_dir(spec.output.path)
    except StoreError as e:
        raise JobError(f"output.path: {e}") from None


# ---- stage 2: pending rows ----------------------------------------------------------------------------


def pending_rows(plan: JobPlan, columns: list[str] | None = None) -> Iterator[Row | Reject]:
    """Stage 2: input rows not yet in the output (and rejects), streamed batch by batch."""
    id_col = plan.spec.input.id_column
    done = plan.finished.implode()
    if plan.spec.input.check_content:
        columns = None  # the content hash covers the whole row
    for batch in iter_rows(plan.files, id_col, plan.spec.input.batch_size, columns, plan.ids.rejected):
        if plan.finished.is_empty():
            yield from batch
            continue
        keys = pl.Series([i.id_key(id_col) if isinstance(i, Row) else None for i in batch], dtype=pl.Utf8)
        skip = keys.is_in(done).to_list()
        for item, is_done in zip(batch, skip):
            if not (is_done and isinstance(item, Row)):
                yield item
