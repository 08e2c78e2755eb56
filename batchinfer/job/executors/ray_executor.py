"""The Ray executor (`--executor ray`): the same job on a Ray cluster, through Ray Data.

The driver (the `batchinfer run` process) plans as always: it takes the output lock, recovers parts,
and knows the finished ids. Ray Data reads the input files (`read_parquet` / `read_json`), and a pool
of `EngineActor`s (one per GPU, `num_gpus=1`; CPU actors without GPUs) drops rows already finished
(the same anti-join as a local run), renders prompts, runs the engine and commits part files itself
(whole under the final name: io/writer.py). Each batch returns the parts it committed (names, counts, ids, row
records); the driver records them in the manifest. So resume and exactly-once are the local
mechanism: a part committed by an actor that died before its batch returned is recovered on the
next start, and its ids are not done again.

Ray's actor restarts and task retries are turned off for the engine stage: a retried batch would
write its rows again next to a part the first attempt may have committed. A dead actor therefore
fails the run (exit 1), and running it again resumes.

Bad input rows are handled as in a local run ("one bad row never kills a job"). Parquet goes through
`ray.data.read_parquet`; JSONL(.gz) files are read one file per Ray task with the local reader
(`readers.iter_jsonl`), so a line that is not a JSON object, or has no usable id, becomes the same
`Reject` (file, line, start of the line, reason). Each reader task writes its file's rejects, in line
order, to a temp file in the output's records folder (io/layout.py); after the run the driver joins them (and the Parquet rows
with a null id, found from the id column) in input-file order into `rejects.jsonl`, exactly what the
local executor writes, and counts them in the summary (so they count as errors for the exit code).
Good JSONL rows travel to the engine actors pickled (the parsed dict, only the columns the job reads),
so JSON values of any type reach the prompt template exactly as they do locally.

The output folder must be one that every node can write (a shared file system, or an object store
URI such as s3://, which every node reaches with its own credentials), and the driver must be able to
read the inputs (it checks the ids before the run). Hive partition columns (`year=2024/` folders) are
added to each row by the actors from the row's file path, typed as in a local run.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import time
import warnings
from typing import Any, Callable, ClassVar, Iterator

import pyarrow as pa

from batchinfer.io import layout
from batchinfer.io import manifest as mf
from batchinfer.io.readers import InputError, InputFile, Reject, Row, iter_jsonl, iter_parquet
from batchinfer.job.executors.base import RunHooks
from batchinfer.job.executors.parts import WorkerPartWriter, infer_types
from batchinfer.job.plan import JobPlan, pending_rows
from batchinfer.job.spec import JobError, JobSpec, load_job
from batchinfer.job.stage import RunError, execute, output_columns, read_columns, reject_line, row_stages, template_columns
from batchinfer.job.progress import ProgressDisplay
from batchinfer.job.summary import Progress, RunSummary, summarize

log = logging.getLogger(__name__)

PATH_COLUMN = "path"  # Ray Data's include_paths column
# A JSONL row in the dataset: the parsed dict (pickled), its file and 1-based line.
ROW_COLUMN, FILE_COLUMN, LINE_COLUMN = "__batchinfer_row", "__batchinfer_file", "__batchinfer_line"
JSONL_COLUMNS = (ROW_COLUMN, FILE_COLUMN, LINE_COLUMN)


def import_ray() -> Any:
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise JobError("--executor ray needs Ray Data: pip install 'batchinfer[ray]' (or 'ray[data]')") from None
    return ray


class EngineActor:
    """One engine on one Ray worker (one GPU): a batch of input rows in, the parts it committed out."""

    def __init__(self, job: dict[str, Any], folder: str, fingerprint: str, columns: dict[str, Any], finished: pa.Array,
                 counter: Any, engine_factory: Callable[..., Any], read_columns: list[str],
                 partitions: dict[str, list[tuple[str, Any]]] | None = None) -> None:
        self.spec = load_job(job)
        self.folder, self.fingerprint, self.columns, self.counter = folder, fingerprint, columns, counter
        self.finished = finished
        self.read_columns = read_columns
        self.partitions = partitions or {}  # input file path -> its hive partition values
        self.engine = engine_factory(self.spec)
        self.stages = row_stages(self.spec, self.engine)

    def _pending(self, batch: pa.Table) -> pa.Table:
        """The Parquet rows of a batch that have an id and are not finished (null ids are rejects: see _write_rejects)."""
        import pyarrow.compute as pc

        from batchinfer.io.id_key import array_keys

        keys = array_keys(batch.column(self.spec.input.id_column))  # canonical keys; null: no usable id
        keep = pc.is_valid(keys)
        if len(self.finished):
            keep = pc.and_(keep, pc.invert(pc.fill_null(pc.is_in(keys, value_set=self.finished), False)))
        return batch.filter(keep)

    def _rows(self, batch: pa.Table) -> list[Any]:
        """The pending rows of a batch: its JSONL rows (pickled dicts), then its Parquet rows (columns)."""
        import pyarrow.compute as pc

        rows: list[Any] = []
        if ROW_COLUMN in batch.column_names:  # a JSONL block, or one concatenated with a Parquet block
            is_jsonl = pc.is_valid(batch.column(ROW_COLUMN))
            jsonl = batch.filter(is_jsonl)
            id_col = self.spec.input.id_column
            for blob, file, line in zip(*(jsonl.column(c).to_pylist() for c in JSONL_COLUMNS)):
                rows.append(Row(pickle.loads(blob), file, line))
            if rows and len(self.finished):  # the same anti-join as plan.pending_rows (canonical keys)
                keys = pa.array([r.id_key(id_col) for r in rows], pa.string())
                done = pc.is_in(keys, value_set=self.finished).to_pylist()
                rows = [r for r, d in zip(rows, done) if not d]
            batch = batch.filter(pc.invert(is_jsonl)).drop_columns(list(JSONL_COLUMNS))
        if batch.num_rows and self.spec.input.id_column in batch.column_names:
            batch = self._pending(batch)
            for i, values in enumerate(batch.to_pylist()):
                path = values.pop(PATH_COLUMN, "") if PATH_COLUMN not in self.read_columns else ""
                if self.partitions:
                    values = {**{k: v for k, v in self.partitions.get(path, ()) if k not in values}, **values}
                rows.append(Row(values, path or "input", i + 1))
        return rows

    def _next_number(self) -> int:
        import ray

        return ray.get(self.counter.next.remote())

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = self._rows(batch)
        parts: list[tuple[mf.PartInfo, list[str]]] = []
        records: list[Any] = []
        writer = WorkerPartWriter(
            self.folder, self.fingerprint, self.spec.input.id_column, self.columns,
            self.spec.output.rows_per_part, self.spec.output.seconds_per_part, self._next_number,
            lambda part, ids: parts.append((part, ids)),
        )
        if rows:
            execute(iter(rows), self.engine, self.stages, writer, None, Progress(), on_row=records.append)
            writer.close()
        return pa.table({
            "part": pa.array([p.name for p, _ in parts], pa.string()),
            "rows": pa.array([p.rows for p, _ in parts], pa.int64()),
            "errors": pa.array([p.errors for p, _ in parts], pa.int64()),
            "ids": pa.array([ids for _, ids in parts], pa.list_(pa.string())),
            # the batch's row records (for on_row hooks and the run report), with its first part
            "records": pa.array([pickle.dumps(records) if i == 0 else b"" for i in range(len(parts))], pa.binary()),
        })


def _counter_actor(ray: Any, start: int) -> Any:
    @ray.remote(num_cpus=0)
    class PartCounter:
        """Hands out part numbers: no two actors commit the same part name."""

        def __init__(self, n: int) -> None:
            self.n = n

        def next(self) -> int:
            self.n += 1
            return self.n - 1

    return PartCounter.remote(start)


def file_rejects_path(out: Any, index: int) -> Any:
    """Where the reader of input file number `index` leaves its rejects (in the records' tmp/: removed on the next start)."""
    return layout.tmp_dir(out) / f"rejects.{index:06d}.jsonl"


def read_jsonl_files(batch: pa.Table, id_column: str, columns: list[str], batch_size: int, out: str,
                     rejected: dict[str, dict[int, str]] | None = None) -> Iterator[pa.Table]:
    """A Ray Data UDF: read the listed JSONL files with the local reader, yield their rows (bounded blocks).

    Each file's rejects go to file_rejects_path(out, index), which appears (whole) only when the file is
    done, so the driver only ever joins complete reject lists (a retried task rewrites its file).
    rejected: path -> {line: reason} of lines rejected although they have an id (io/ids.py, OpenAI files).
    """
    import json

    keep = set(columns)
    cols = [batch.column(c).to_pylist() for c in ("file", "index", "partitions")]
    for path, index, parts in zip(*cols):
        final = file_rejects_path(out, index)
        file = InputFile(path, "jsonl", tuple((k, v) for k, v in json.loads(parts)))
        with final.open_atomic_text() as rf:
            for items in iter_jsonl(file, id_column, batch_size, (rejected or {}).get(path)):
                blobs, lines = [], []
                for item in items:
                    if isinstance(item, Reject):
                        rf.write(reject_line(item) + "\n")
                    else:
                        blobs.append(pickle.dumps({k: v for k, v in item.values.items() if k in keep}))
                        lines.append(item.line)
                if blobs:
                    yield pa.table({
                        ROW_COLUMN: pa.array(blobs, pa.binary()),
                        FILE_COLUMN: pa.array([path] * len(blobs), pa.string()),
                        LINE_COLUMN: pa.array(lines, pa.int64()),
                    })


def _read(ray: Any, files: list[Any], columns: list[str], id_column: str, batch_size: int, out: Any,
          rejected: dict[tuple[str, int], str] | None = None) -> Any:
    """One Ray dataset over the job's input files (Parquet: only the columns the job reads; JSONL: see read_jsonl_files)."""
    import json

    from batchinfer.io.readers import lines_of

    parquet = [f for f in files if f.format == "parquet"]
    jsonl = [{"file": f.path, "index": i, "partitions": json.dumps(list(f.partitions))} for i, f in enumerate(files) if f.format != "parquet"]
    parts = []
    with_paths = PATH_COLUMN not in columns
    if parquet:
        hive = {k for f in parquet for k, _ in f.partitions}
        in_files = [c for c in columns if c not in hive]  # partition columns are added by the actors
        ds = ray.data.read_parquet([f.path for f in parquet], include_paths=with_paths, partitioning=None)
        parts.append(ds.select_columns(in_files + [PATH_COLUMN] if with_paths else in_files))
    if jsonl:
        listing = ray.data.from_items(jsonl, override_num_blocks=len(jsonl))
        parts.append(listing.map_batches(
            read_jsonl_files, batch_size=1, batch_format="pyarrow",
            fn_kwargs={"id_column": id_column, "columns": columns, "batch_size": batch_size, "out": str(out),
                       "rejected": {f["file"]: lines_of(rejected, f["file"]) for f in jsonl if lines_of(rejected, f["file"])}},
        ))
    ds = parts[0]
    return ds.union(*parts[1:]) if len(parts) > 1 else ds


def parquet_rejects(file: Any, id_column: str, batch_size: int, columns: list[str]) -> Iterator[Any]:
    """The Rejects of one Parquet file (rows with a null id), as the local reader makes them.

    Only the id column is read, unless it has nulls (rare): then the file is read like a local run does.
    """
    import pyarrow.parquet as pq

    try:
        with file.open_file() as fh:
            if pq.ParquetFile(fh).read(columns=[id_column]).column(id_column).null_count == 0:
                return
    except (OSError, KeyError) as e:
        raise InputError(f"cannot read {file.path}: {e}") from None
    for items in iter_parquet(file, id_column, batch_size, columns):
        yield from (r for r in items if isinstance(r, Reject))


def _write_rejects(plan: JobPlan, columns: list[str]) -> int:
    """Join every input file's rejects, in input order, into `rejects.jsonl` (as a local run writes it); their count."""
    out, spec = plan.output_dir, plan.spec
    n = 0
    with layout.rejects_path(out).open_atomic_text(tmp_dir=layout.tmp_dir(out)) as rf:
        for i, f in enumerate(plan.files):
            if f.format == "parquet":
                for r in parquet_rejects(f, spec.input.id_column, spec.input.batch_size, columns):
                    rf.write(reject_line(r) + "\n")
                    n += 1
                continue
            part = file_rejects_path(out, i)
            if not part.exists():
                raise RunError(f"the Ray reader of {f.path} left no rejects list ({part.name}); run again to resume")
            for line in part.read_text().splitlines(keepends=True):
                rf.write(line)
                n += 1
    for i, f in enumerate(plan.files):
        file_rejects_path(out, i).delete()
    return n


def _partitions_by_path(files: list[Any]) -> dict[str, list[tuple[str, Any]]]:
    """Input file path (as Ray Data's path column gives it: no scheme for a URI) -> its partition values."""
    out: dict[str, list[tuple[str, Any]]] = {}
    for f in files:
        if f.partitions:
            out[f.path] = out[f.location.path] = list(f.partitions)
    return out


def num_actors(ray: Any, spec: JobSpec) -> tuple[int, int]:
    """(actors, GPUs per actor): engine.data_parallel actors; auto is one per GPU of the cluster (1 without)."""
    gpus = int(ray.cluster_resources().get("GPU", 0)) if spec.engine.device != "cpu" else 0
    want = spec.engine.data_parallel
    n = (gpus or 1) if want == "auto" else int(want)
    if gpus and n > gpus:
        raise JobError(f"engine.data_parallel is {n} but the Ray cluster has {gpus} GPU(s)")
    return n, 1 if gpus else 0


def _engine_stage(ray: Any, plan: JobPlan, needed: list[str], columns: dict[str, Any], engine_factory: Callable[..., Any],
                  actors: int, gpus: int) -> tuple[Any, Any]:
    """(dataset, part counter): read the inputs, then the engine actors (their output: the committed parts)."""
    spec, out = plan.spec, plan.output_dir
    finished = pa.array(plan.finished.to_list(), pa.string())
    counter = _counter_actor(ray, mf.next_part_number(out))
    batch_rows = max(1, min(spec.output.rows_per_part, 8 * spec.engine.max_num_seqs))
    ds = _read(ray, plan.files, needed, spec.input.id_column, spec.input.batch_size, out, plan.ids.rejected).map_batches(
        EngineActor,
        fn_constructor_kwargs={
            "job": spec.model_dump(mode="json"), "folder": str(out), "fingerprint": plan.manifest.fingerprint,
            "columns": columns, "finished": finished, "counter": counter, "engine_factory": engine_factory,
            "read_columns": needed, "partitions": _partitions_by_path(plan.files),
        },
        batch_size=batch_rows,
        batch_format="pyarrow",
        concurrency=actors,
        num_gpus=gpus,
        # See the module docstring: a retried batch could write its rows twice. (Ray 2.60 takes these only as
        # extra remote args, deprecated for 2.64: hence the `ray` extra's upper bound.)
        max_restarts=0,
        max_task_retries=0,
    )
    return ds, counter


class RayExecutor:
    """The Ray executor: engine.data_parallel EngineActors on a Ray cluster (see the module docstring).

    hooks.on_step is not called: engine steps happen in the actors.
    """

    name: ClassVar[str] = "ray"

    @classmethod
    def for_job(cls, spec: JobSpec) -> "RayExecutor":
        import_ray()  # a missing Ray is the user's error, before anything is planned
        return cls()

    def prepare(self, plan: JobPlan, hooks: RunHooks) -> None:
        """Nothing: the engines start in the Ray actors, in run()."""

    def run(self, plan: JobPlan, hooks: RunHooks) -> RunSummary:
        ray = import_ray()
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
        spec = plan.spec
        actors, gpus = num_actors(ray, spec)
        log.info("%d Ray engine actor(s)", actors)
        columns = output_columns(plan)
        needed = read_columns(spec, template_columns(plan))
        head = [r.values for r in itertools.islice((r for r in pending_rows(plan, needed) if isinstance(r, Row)), 256)]
        columns = infer_types(columns, head)  # every actor writes the same schema
        with warnings.catch_warnings():  # the max_restarts/max_task_retries remote args below, on purpose
            warnings.filterwarnings("ignore", message=".*ray_remote_args.*")
            ds, counter = _engine_stage(ray, plan, needed, columns, hooks.engine_factory, actors, gpus)
        stats = Progress()
        bar = ProgressDisplay(plan.pending_count, stats, hooks.progress)
        known = {p.name for p in plan.manifest.parts}
        committed = errors = 0
        started = time.perf_counter()
        try:
            for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
                for name, rows, errs, blob in zip(*(batch.column(c).to_pylist() for c in ("part", "rows", "errors", "records"))):
                    for rec in pickle.loads(blob) if blob else ():
                        stats.add(rec)
                        bar.update()  # per row, as the records arrive
                        if hooks.on_row is not None:
                            hooks.on_row(rec)
                        if hooks.on_progress is not None:
                            hooks.on_progress(stats)
                    if name in known:
                        continue
                    part = mf.PartInfo(name, rows, errs)
                    known.add(name)
                    plan.manifest.add_part(part)
                    committed, errors = committed + rows, errors + errs
                    if hooks.on_commit is not None:
                        hooks.on_commit(part)
        except Exception as e:
            raise RunError(f"the Ray run failed ({type(e).__name__}: {e}); run again to resume") from e
        finally:
            bar.close()
            ray.kill(counter)
        stats.rows, stats.errors = committed, errors
        stats.rejects = _write_rejects(plan, needed)
        return summarize(plan, stats.rejects, stats, time.perf_counter() - started, load_seconds=started - hooks.started)
