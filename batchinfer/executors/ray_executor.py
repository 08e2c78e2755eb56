"""`batchinfer run JOB.yaml --executor ray`: the same job on a Ray cluster, through Ray Data.

The driver (the `batchinfer run` process) plans as always: it takes the output lock, recovers parts,
and knows the finished ids. Ray Data reads the input files (`read_parquet` / `read_json`), and a pool
of `EngineActor`s (one per GPU, `num_gpus=1`; CPU actors without GPUs) drops rows already finished
(the same anti-join as a local run), renders prompts, runs the engine and commits part files itself
(temp name, fsync, rename). Each batch returns the parts it committed (names, counts, ids, row
records); the driver records them in the manifest. So resume and exactly-once are the local
mechanism: a part committed by an actor that died before its batch returned is recovered on the
next start, and its ids are not done again.

Ray's actor restarts and task retries are turned off for the engine stage: a retried batch would
write its rows again next to a part the first attempt may have committed. A dead actor therefore
fails the run (exit 1), and running it again resumes.

The output folder must be one that every node can write (a shared file system), and the driver must
be able to read the inputs (it checks the ids before the run). Input lines that are not JSON objects
fail the read (locally they are rejected into `_rejects.jsonl`); rows without an id are skipped.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa

from batchinfer.executors.parts import WorkerPartWriter, infer_types
from batchinfer.io import manifest as mf
from batchinfer.job import JobError, JobSpec

log = logging.getLogger(__name__)

PATH_COLUMN = "path"  # Ray Data's include_paths column


def import_ray() -> Any:
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise JobError("--executor ray needs Ray Data: pip install 'batchinfer[ray]' (or 'ray[data]')") from None
    return ray


def ray_runner(spec: JobSpec) -> Callable[..., Any]:
    """The runner of the pending rows on Ray (same arguments as run._run_pending)."""
    import_ray()
    return functools.partial(run_ray)


class EngineActor:
    """One engine on one Ray worker (one GPU): a batch of input rows in, the parts it committed out."""

    def __init__(self, job: dict[str, Any], folder: str, fingerprint: str, columns: dict[str, Any], finished: pa.Array,
                 counter: Any, engine_factory: Callable[..., Any], read_columns: list[str]) -> None:
        from batchinfer.job import load_job
        from batchinfer.requests import RequestBuilder
        from batchinfer.results import ResultConverter

        self.spec = load_job(job)
        self.folder, self.fingerprint, self.columns, self.counter = folder, fingerprint, columns, counter
        self.finished = finished
        self.read_columns = read_columns
        self.engine = engine_factory(self.spec)
        constraint = self.spec.structured.constraint() if self.spec.structured else None
        e = self.engine
        max_len = getattr(e, "max_model_len", None) or self.spec.model.max_model_len or e.model_info.max_position_embeddings
        self.builder = RequestBuilder(self.spec, e.tokenizer, max_len, constraint)
        self.converter = ResultConverter(self.spec, constraint)

    def _pending(self, batch: pa.Table) -> pa.Table:
        import pyarrow.compute as pc

        ids = batch.column(self.spec.input.id_column)
        keep = pc.is_valid(ids)
        if len(self.finished):
            keep = pc.and_(keep, pc.invert(pc.fill_null(pc.is_in(pc.cast(ids, pa.string()), value_set=self.finished), False)))
        return batch.filter(keep)

    def _next_number(self) -> int:
        import ray

        return ray.get(self.counter.next.remote())

    def __call__(self, batch: pa.Table) -> pa.Table:
        from batchinfer.io.readers import Row
        from batchinfer.run import Progress, execute

        batch = self._pending(batch)
        rows = []
        for i, values in enumerate(batch.to_pylist()):
            path = values.pop(PATH_COLUMN, "") if PATH_COLUMN not in self.read_columns else ""
            rows.append(Row(values, path or "input", i + 1))
        parts: list[tuple[mf.PartInfo, list[str]]] = []
        records: list[Any] = []
        writer = WorkerPartWriter(
            Path(self.folder), self.fingerprint, self.spec.input.id_column, self.columns,
            self.spec.output.rows_per_part, self.spec.output.seconds_per_part, self._next_number,
            lambda part, ids: parts.append((part, ids)),
        )
        if rows:
            execute(iter(rows), self.engine, self.builder, self.converter, writer, None, Progress(), on_row=records.append)
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


def _read(ray: Any, files: list[Any], columns: list[str]) -> Any:
    """One Ray dataset over the job's input files (Parquet: only the columns the job reads)."""
    parquet = [f.path for f in files if f.format == "parquet"]
    jsonl = [f.path for f in files if f.format != "parquet"]
    parts = []
    with_paths = PATH_COLUMN not in columns
    if parquet:
        ds = ray.data.read_parquet(parquet, include_paths=with_paths)
        parts.append(ds.select_columns(columns + [PATH_COLUMN] if with_paths else columns))
    if jsonl:
        parts.append(ray.data.read_json(jsonl, lines=True, include_paths=with_paths))
    ds = parts[0]
    return ds.union(*parts[1:]) if len(parts) > 1 else ds


def num_actors(ray: Any, spec: JobSpec) -> tuple[int, int]:
    """(actors, GPUs per actor): engine.data_parallel actors; auto is one per GPU of the cluster (1 without)."""
    gpus = int(ray.cluster_resources().get("GPU", 0)) if spec.engine.device != "cpu" else 0
    want = spec.engine.data_parallel
    n = (gpus or 1) if want == "auto" else int(want)
    if gpus and n > gpus:
        raise JobError(f"engine.data_parallel is {n} but the Ray cluster has {gpus} GPU(s)")
    return n, 1 if gpus else 0


def _engine_stage(ray: Any, plan: Any, needed: list[str], columns: dict[str, Any], engine_factory: Callable[..., Any],
                  actors: int, gpus: int) -> tuple[Any, Any]:
    """(dataset, part counter): read the inputs, then the engine actors (their output: the committed parts)."""
    spec, out = plan.spec, plan.output_dir
    finished = pa.array(plan.finished.to_list(), pa.string())
    counter = _counter_actor(ray, mf.next_part_number(out))
    batch_rows = max(1, min(spec.output.rows_per_part, 8 * spec.engine.max_num_seqs))
    ds = _read(ray, plan.files, needed).map_batches(
        EngineActor,
        fn_constructor_kwargs={
            "job": spec.model_dump(mode="json"), "folder": str(out), "fingerprint": plan.manifest.fingerprint,
            "columns": columns, "finished": finished, "counter": counter, "engine_factory": engine_factory,
            "read_columns": needed,
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


def run_ray(
    plan: Any,
    pending: int,
    t0: float,
    progress: bool,
    engine_factory: Callable[..., Any],
    on_row: Callable[[Any], None] | None,
    on_progress: Callable[[Any], None] | None,
    on_step: Callable[[Any], None] | None,
    on_commit: Callable[[Any], None] | None,
) -> Any:
    """The Ray counterpart of run._run_pending (on_step is not called: steps happen in the actors)."""
    import dataclasses
    import itertools
    import sys

    from batchinfer.executors.data_parallel import template_columns
    from batchinfer.io.readers import Row
    from batchinfer.io.writer import existing_schema, output_schema
    from batchinfer.plan import pending_rows
    from batchinfer.results import RESULT_NAMES, ResultConverter
    from batchinfer.run import Progress, RunError, progress_bar, summarize

    ray = import_ray()
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
    spec = plan.spec
    out = plan.output_dir
    actors, gpus = num_actors(ray, spec)
    log.info("%d of %d rows to do (%d already in %s) on %d Ray engine actor(s)", pending, plan.ids.num_rows,
             plan.ids.num_rows - pending, out, actors)
    constraint = spec.structured.constraint() if spec.structured else None
    converter = ResultConverter(spec, constraint)
    columns = output_schema(plan.key_types, converter.output_type)
    if plan.manifest.parts:  # resume output written before a column existed: keep the parts' schema
        names = set(existing_schema(out, plan.manifest.parts[0].name).names)
        columns = {k: v for k, v in columns.items() if k in names or k not in RESULT_NAMES}
    needed = sorted(set([spec.input.id_column, *spec.output.keep_columns]) | set(template_columns(spec, plan.model_dir)))
    head = [r.values for r in itertools.islice((r for r in pending_rows(plan, needed) if isinstance(r, Row)), 256)]
    columns = infer_types(columns, head)  # every actor writes the same schema
    with warnings.catch_warnings():  # the max_restarts/max_task_retries remote args below, on purpose
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*")
        ds, counter = _engine_stage(ray, plan, needed, columns, engine_factory, actors, gpus)
    stats = Progress()
    bar = progress_bar(pending, progress and sys.stderr.isatty())
    known = {p.name for p in plan.manifest.parts}
    committed = errors = 0
    started = time.perf_counter()
    try:
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            for name, rows, errs, blob in zip(*(batch.column(c).to_pylist() for c in ("part", "rows", "errors", "records"))):
                for rec in pickle.loads(blob) if blob else ():
                    stats.rows += 1
                    stats.errors += rec.error is not None
                    stats.prompt_tokens += rec.prompt_tokens
                    stats.completion_tokens += rec.completion_tokens
                    if on_row is not None:
                        on_row(rec)
                    if on_progress is not None:
                        on_progress(stats)
                if name in known:
                    continue
                part = mf.PartInfo(name, rows, errs)
                known.add(name)
                plan.manifest.add_part(part)
                committed, errors = committed + rows, errors + errs
                bar.update(rows)
                if on_commit is not None:
                    on_commit(part)
    except Exception as e:
        raise RunError(f"the Ray run failed ({type(e).__name__}: {e}); run again to resume") from e
    finally:
        bar.close()
        ray.kill(counter)
    stats.rows, stats.errors = committed, errors
    s = summarize(plan, 0, stats, time.perf_counter() - started)
    return dataclasses.replace(s, load_seconds=started - t0)
