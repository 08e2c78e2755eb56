"""The facts of the report's headline: which model on which device, when the job ran and for how long,
and how close it came to its roofline floor.

Everything here is read from what the run left (the resolved job in `config`, the package versions
recorded at run time, the records) plus the model folder's config files; nothing is measured now, so
`batchinfer report` on another machine tells the same story. A fact that cannot be known is given
with a `note` saying why, never guessed.
"""

from __future__ import annotations

import calendar
import time
from pathlib import Path
from typing import Any

import polars as pl

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def section(config: Any, key: str) -> dict[str, Any]:
    """config[key] when both are dicts, else {} (a report never fails on an odd config)."""
    value = config.get(key) if isinstance(config, dict) else None
    return value if isinstance(value, dict) else {}


def run_start_epoch(run_id: str) -> float | None:
    """The UTC start time a run id carries (records.new_run_id: `YYYYmmddTHHMMSS.micros-pid-tag`)."""
    try:
        stamp, micros = run_id.split("-", 1)[0].split(".")
        return calendar.timegm(time.strptime(stamp, "%Y%m%dT%H%M%S")) + int(micros) / 1e6
    except (ValueError, AttributeError):
        return None


def run_times(steps: pl.DataFrame, rows: pl.DataFrame, run: dict[str, Any] | None = None) -> dict[str, Any]:
    """Start, end and wall time of the job over all its runs (a first run and its resumes).

    A run's wall time is from its Observer's start (before the model loads) to its last record, or
    to the close of the observer for the run that wrote this report (`run`: its run_id, elapsed_s).
    The job's wall time is the sum over runs; time between runs is not counted.
    """
    spans = pl.concat([
        steps.select("run_id", pl.col("t").alias("t")),
        rows.select("run_id", pl.col("finished_t").alias("t")),
    ]).group_by("run_id").agg(pl.col("t").max()).sort("run_id")
    per_run = []
    run = run or {}
    for run_id, last in spans.iter_rows():
        wall = float(last or 0.0)
        if run.get("run_id") == run_id and run.get("elapsed_s") is not None:
            wall = max(wall, float(run["elapsed_s"]))
        start = run_start_epoch(run_id)
        per_run.append({"run_id": run_id, "start": start, "end": None if start is None else start + wall, "wall_s": wall})
    starts = [r["start"] for r in per_run if r["start"] is not None]
    ends = [r["end"] for r in per_run if r["end"] is not None]
    return {
        "start": min(starts) if starts else None,
        "end": max(ends) if ends else None,
        "wall_s": sum(r["wall_s"] for r in per_run),
        "runs": per_run,
    }


def device_facts(config: dict[str, Any] | None, versions: dict[str, Any] | None) -> dict[str, Any]:
    """The device the job ran on: kind (cuda | cpu), name (the GPU's, from the run's versions), count."""
    engine = section(config, "engine")
    versions = versions if isinstance(versions, dict) else {}
    want = engine.get("device", "auto")
    gpu = versions.get("gpu")
    kind = "cuda" if (want == "auto" and gpu) or str(want).startswith("cuda") else "cpu"
    count = engine.get("data_parallel", 1)
    count = int(count) if isinstance(count, int) else 1
    if kind == "cpu":
        return {"kind": "cpu", "name": "CPU", "count": 1, "platform": versions.get("platform")}
    return {"kind": "cuda", "name": gpu or "a CUDA GPU (name not recorded)", "count": count}


def model_facts(config: dict[str, Any] | None, device: dict[str, Any]) -> dict[str, Any]:
    """Name, family, dtype, quantization and size of the job's model, from its folder's config files."""
    model = section(config, "model")
    path = model.get("path")
    facts: dict[str, Any] = {"name": model_name(path) if path else None, "path": path, "dtype": model.get("dtype")}
    quant = _quantization(config)
    if path is None:
        return {**facts, "note": "the job's model is not recorded"}
    try:
        from batchinfer.io.model_files import read_config
        from batchinfer.models.loader import load_model_info, resolve_model_dir

        model_dir = resolve_model_dir(path)
        hf = read_config(model_dir)
        info = load_model_info(path, model.get("dtype") or "auto", "cuda" if device["kind"] == "cuda" else "cpu",
                               model.get("quantization") or "none")
    except Exception as e:  # the folder moved, or is not one we can read: say so, keep what the job says
        return {**facts, "quantization": quant, "note": f"model folder not readable now: {type(e).__name__}: {e}"}
    if quant is None and isinstance(hf.get("quantization_config"), dict):
        quant = str(hf["quantization_config"].get("quant_method") or "yes")
    return {
        **facts,
        "family": hf.get("model_type"),
        "architecture": info.architecture,
        "dtype": str(info.dtype).removeprefix("torch."),
        "quantization": quant or "none",
        "params": info.num_params,
        "weight_bytes": info.weight_bytes,
        "kv_cache_dtype": section(config, "engine").get("kv_cache_dtype") or "auto",
        "layer_params": info.num_layer_params,
        "num_layers": info.num_layers,
        "hidden_size": info.hidden_size,
        "num_heads": info.num_heads,
        "num_kv_heads": info.num_kv_heads,
        "head_dim": info.head_dim,
        "vocab_size": info.vocab_size,
    }


def model_name(path: str) -> str:
    """What a person calls the model: a hub id as given, the org/name of a hub-cache snapshot folder,
    else the folder's name."""
    p = Path(path).expanduser()
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        return p.parent.parent.name.removeprefix("models--").replace("--", "/")
    if not p.exists() and not path.startswith((".", "/", "~")) and path.count("/") <= 1:
        return path  # a hub id
    return p.name or path


def _quantization(config: Any) -> str | None:
    """A quantization the job asks for (model.quantization or engine.quantization, when the spec has one)."""
    for key in ("model", "engine"):
        q = section(config, key).get("quantization")
        if q not in (None, "", "none"):
            return str(q)
    return None


def roofline_facts(
    rows: pl.DataFrame, model: dict[str, Any], device: dict[str, Any], engine_s: float,
    kv_total_blocks: int | None, block_size: int,
) -> dict[str, Any]:
    """How close the generation came to its roofline floor on the device's datasheet ceilings.

    fraction = floor / engine time (1.0 would be the floor itself). Omitted, with a note, where the
    device or dtype has no datasheet entry, the model's shape is unknown or no step was recorded.
    """
    from batchinfer.bench.devices import datasheet_ceilings
    from batchinfer.bench.roofline import Ceilings, workload_floor

    if device["kind"] != "cuda":
        return {"note": "no roofline on a CPU (bench/devices.py has GPU datasheet ceilings only)"}
    ceil = datasheet_ceilings(device.get("name"), str(model.get("dtype")))
    if ceil is None:
        return {"note": f"no datasheet ceilings for {device.get('name')} in {model.get('dtype')} (bench/devices.py)"}
    if "num_layers" not in model:
        return {"note": "the model's shape is unknown (its folder is not readable)"}
    if engine_s <= 0 or not kv_total_blocks:
        return {"note": "no engine steps recorded (data-parallel workers do not record steps)"}
    ran = rows.filter(pl.col("finish_reason") != "error")
    prompt_lens = ran.get_column("prompt_tokens").cast(pl.Int64).to_list()
    output_lens = [max(int(x), 1) for x in ran.get_column("completion_tokens").to_list()]
    if not prompt_lens:
        return {"note": "no row reached the engine"}
    n = max(int(device.get("count") or 1), 1)
    scaled = Ceilings(ceil.device, ceil.copy_bytes_per_s * n, ceil.matmul_flops_per_s * n)
    dtype_bytes = DTYPE_BYTES[str(model["dtype"])]
    floor = workload_floor(
        prompt_lens, output_lens, num_layers=model["num_layers"], hidden_size=model["hidden_size"],
        num_heads=model["num_heads"], num_kv_heads=model["num_kv_heads"], head_dim=model["head_dim"],
        vocab_size=model["vocab_size"], layer_params=model["layer_params"],
        weight_bytes=model.get("weight_bytes") or model["params"] * dtype_bytes,
        dtype_bytes=1 if model.get("kv_cache_dtype") == "fp8_e4m3" else dtype_bytes,
        kv_capacity_tokens=kv_total_blocks * block_size * n, ceilings=scaled,
    )
    return {
        "fraction": floor.floor_s / engine_s,
        "floor_s": floor.floor_s,
        "bound": floor.bound,
        "basis": "datasheet peaks" + (f" of {n} devices" if n > 1 else ""),
        "bytes_per_s": scaled.copy_bytes_per_s,
        "flops_per_s": scaled.matmul_flops_per_s,
    }
