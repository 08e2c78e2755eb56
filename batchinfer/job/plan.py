"""Stages 1 and 2 of a job: plan the inputs (files, ids, schema, output folder) and stream the rows not yet done.

Exactly-once resume: see batchinfer/io/manifest.py for the commit protocol. The finished ids come from
the committed parts; a row whose id is among them is skipped when the input is read again.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import polars as pl
import pyarrow as pa

from batchinfer.io import manifest as mf
from batchinfer.io.ids import IdCheck, check_ids
from batchinfer.io.model_files import model_components
from batchinfer.io.readers import InputError, InputFile, Reject, Row, input_columns, iter_rows, list_input_files
from batchinfer.io.writer import existing_schema
from batchinfer.job.spec import JobError, JobSpec

log = logging.getLogger(__name__)


# ---- stage 1: plan the inputs ------------------------------------------------------------------------


@dataclass
class JobPlan:
    """Everything known before the engine starts: files, ids, output folder state, fingerprint."""

    spec: JobSpec
    files: list[InputFile]
    ids: IdCheck
    model_dir: Path
    manifest: mf.Manifest
    finished: pl.Series  # ids (as text) already in the output
    key_types: dict[str, pa.DataType | None]
    recovered: int = 0
    lock: Any = None  # the output folder's lock (an open file); close() releases it

    def close(self) -> None:
        if self.lock is not None:
            self.lock.close()
            self.lock = None

    @property
    def output_dir(self) -> Path:
        return Path(self.spec.output.path)

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
    return {
        "model": {"files": model_components(model_dir), "dtype": spec.model.dtype, "max_model_len": spec.model.max_model_len},
        "prompt": _without(spec.prompt.model_dump(mode="json"), {"messages": None}),
        "sampling": _without(spec.sampling.model_dump(mode="json"), {"n": 1, "logprobs": None}),
        "structured": structured,
        "columns": {"id": spec.input.id_column, "keep": list(spec.output.keep_columns)},
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


def _check_schema_of_model(spec: JobSpec, model_dir: Path) -> None:
    from batchinfer.models.loader import load_model_info, load_tokenizer

    info = load_model_info(str(model_dir), spec.model.dtype)
    check_schema(spec, load_tokenizer(model_dir), info.vocab_size)


def resolve_model(spec: JobSpec) -> Path:
    from batchinfer.models.loader import ModelLoadError, resolve_model_dir

    try:
        return resolve_model_dir(spec.model.path)
    except ModelLoadError as e:
        raise JobError(f"model.path: {e}") from None


def key_types(spec: JobSpec, files: list[InputFile]) -> dict[str, pa.DataType | None]:
    """Output types of the id and kept columns: from the first Parquet file that has them, else inferred."""
    names = [spec.input.id_column] + [c for c in spec.output.keep_columns if c != spec.input.id_column]
    types: dict[str, pa.DataType | None] = {n: None for n in names}
    for f in files:
        cols = input_columns(f)
        if cols is None:
            continue
        missing = [c for c in spec.output.keep_columns if c not in cols]
        if missing:
            raise InputError(f"output.keep_columns: {', '.join(missing)} not a column of {f.path} (columns: {', '.join(cols)})")
        import pyarrow.parquet as pq

        schema = pq.ParquetFile(f.path).schema_arrow
        for n in names:
            if types[n] is None:
                types[n] = schema.field(n).type
    return types


def plan_inputs(spec: JobSpec, overwrite: bool = False) -> JobPlan:
    """Stage 1: list files, check ids, open the output folder (recover, fingerprint check)."""
    model_dir = resolve_model(spec)
    out = Path(spec.output.path)
    files = [f for f in list_input_files(spec.input.path, spec.input.format) if not Path(f.path).is_relative_to(out.resolve())]
    if not files:
        raise InputError(f"input.path: no input files outside output.path ({out})")
    ids = check_ids(files, spec.input.id_column, spec.input.duplicates)
    types = key_types(spec, files)
    if spec.structured is not None:
        _check_schema_of_model(spec, model_dir)
    components = fingerprint_components(spec, model_dir)
    fp = mf.fingerprint_of(components)
    hashes = mf.component_hashes(components)
    if out.exists() and not out.is_dir():
        raise JobError(f"output.path: {out} is a file, not a folder")
    out.mkdir(parents=True, exist_ok=True)
    lock = mf.lock_output(out)
    try:
        return _open_output(spec, files, ids, model_dir, types, fp, hashes, overwrite, lock)
    except BaseException:
        lock.close()
        raise


def _open_output(
    spec: JobSpec,
    files: list[InputFile],
    ids: IdCheck,
    model_dir: Path,
    key_types: dict[str, pa.DataType | None],
    fp: str,
    hashes: dict[str, str],
    overwrite: bool,
    lock: Any,
) -> JobPlan:
    """Under the folder lock: clear (--overwrite), clean temps, check the fingerprint, recover parts."""
    out = Path(spec.output.path)
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
    if manifest.parts:
        schema = existing_schema(out, manifest.parts[0].name)
        key_types = {n: schema.field(n).type if n in schema.names else t for n, t in key_types.items()}
    return JobPlan(spec, files, ids, model_dir, manifest, manifest.finished_ids(), key_types, recovered, lock)


# ---- stage 2: pending rows ----------------------------------------------------------------------------


def pending_rows(plan: JobPlan, columns: list[str] | None = None) -> Iterator[Row | Reject]:
    """Stage 2: input rows not yet in the output (and rejects), streamed batch by batch."""
    id_col = plan.spec.input.id_column
    done = plan.finished.implode()
    for batch in iter_rows(plan.files, id_col, plan.spec.input.batch_size, columns, plan.ids.rejected):
        if plan.finished.is_empty():
            yield from batch
            continue
        keys = pl.Series([str(i.values[id_col]) if isinstance(i, Row) else "" for i in batch], dtype=pl.Utf8)
        skip = keys.is_in(done).to_list()
        for item, is_done in zip(batch, skip):
            if not (is_done and isinstance(item, Row)):
                yield item
