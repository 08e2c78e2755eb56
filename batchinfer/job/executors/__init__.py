"""Executors: other ways to run the `execute` stage of batchinfer/run.py.

- `data_parallel.py`: one engine process per GPU of this host (`engine.data_parallel`), fed with work
  units by the driver, which stays the manifest's single writer;
- `ray_executor.py`: the same job on a Ray cluster through Ray Data (`--executor ray`).

Both commit part files in the workers (temp name, fsync, rename: `parts.py`) and report them to the
driver, which records them in the manifest; a part committed but never reported is found by the
manifest's recovery. So resume and exactly-once are the same mechanism as a single-engine run.
"""
