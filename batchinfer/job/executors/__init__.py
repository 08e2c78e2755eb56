"""Executors, chosen by name: who runs a job's pending rows (`Executor.run(plan, hooks)`, base.py).

- `local` (local.py): one engine in this process;
- `data_parallel` (data_parallel.py, dp_worker.py): one engine process per GPU of this host, fed with
  work units by a coordinator in this process, which stays the manifest's single writer;
- `ray` (ray_executor.py): the same job on a Ray cluster through Ray Data.

The data-parallel and Ray workers commit part files themselves (temp name, fsync, rename: parts.py)
and report them, and this process records them in the manifest; a part committed but never reported
is found by the manifest's recovery. So resume and exactly-once are the same mechanism as a local run.
Executors import the stages (plan, requests, results, stage, summary), never the driver.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from batchinfer.job.spec import JobError, JobSpec

if TYPE_CHECKING:
    from batchinfer.job.executors.base import Executor


def _one_engine_here(spec: JobSpec) -> bool:
    """Whether `local` runs the job's one engine in this process (engine.data_parallel: 1), without
    planning anything: the rule _this_host and start_ahead share."""
    return spec.engine.data_parallel == 1


def _this_host(spec: JobSpec) -> "Executor":
    """`local` as a user means this host: engine.data_parallel engines (one: in this process)."""
    from batchinfer.job.executors.data_parallel import DataParallelExecutor, plan_data_parallel
    from batchinfer.job.executors.local import LocalExecutor

    if _one_engine_here(spec):
        return LocalExecutor()
    dp = plan_data_parallel(spec)
    if dp.workers == 1 and dp.gpus is None:  # `auto` on a host without GPUs: one engine, no worker process
        return LocalExecutor()
    return DataParallelExecutor(dp)


def _data_parallel(spec: JobSpec) -> "Executor":
    from batchinfer.job.executors.data_parallel import DataParallelExecutor

    return DataParallelExecutor.for_job(spec)


def _ray(spec: JobSpec) -> "Executor":
    from batchinfer.job.executors.ray_executor import RayExecutor

    return RayExecutor.for_job(spec)


EXECUTORS: dict[str, Callable[[JobSpec], "Executor"]] = {"local": _this_host, "data_parallel": _data_parallel, "ray": _ray}


def start_ahead(name: str, spec: JobSpec) -> None:
    """Start, on threads, what the executor called `name` will need first, before the caller imports
    the rest of the run (the job layer's ~0.5 s of imports then run beside it). For `local` with one
    engine in this process: its GPU's runtime (engine/device_runtime.py: the CUDA context, cuBLAS,
    Triton's cache key), which its `prepare` would otherwise start only after those imports. Cheap
    (it imports nothing of the job layer) and harmless where it does not apply: it starts nothing."""
    if name == "local" and _one_engine_here(spec):
        from batchinfer.engine.device_runtime import start_device_runtime

        start_device_runtime(spec.engine.device)


def executor_for(name: str, spec: JobSpec) -> "Executor":
    """The executor called `name` (`--executor`) for a job; JobError for an unknown name or one that cannot run here.

    local: this host: one engine in this process, or, when engine.data_parallel asks for more than one
    (N, or auto with GPUs visible), the data-parallel executor; data_parallel: engine worker processes
    even for one; ray: engine.data_parallel actors on a Ray cluster.
    """
    make = EXECUTORS.get(name)
    if make is None:
        raise JobError(f"--executor {name!r}: use one of {', '.join(EXECUTORS)}")
    return make(spec)
