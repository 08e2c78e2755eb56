"""The observer on a real tiny engine: the report's totals equal what the engine returned and the
output holds; the metrics port moves while it runs; the token-id sidecar decodes back to the prompts.

Skips when the engine cannot be imported (it is built in parallel with this package).
"""

from __future__ import annotations

import json
import urllib.request

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.request import Request, SamplingParams
from batchinfer.io.manifest import Manifest, PartInfo
from batchinfer.observe import ObserveOptions, Observer, read_token_ids
from batchinfer.io import layout

engine_mod = pytest.importorskip("batchinfer.engine.engine")


def _rows_total(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "batchinfer_rows_total")


def test_real_engine_run(tiny_model, tmp_path):
    out = tmp_path / "out"
    obs = Observer(ObserveOptions(out_dir=out, metrics_port=0, log_token_ids=True))
    engine = engine_mod.Engine(
        EngineConfig(model=str(tiny_model), device="cpu", dtype="float32", max_num_seqs=4, num_kv_blocks=64,
                     block_size=8, cuda_graphs=False),
        on_step=obs.on_step,
    )
    tok = engine.tokenizer
    docs = [f"invoice {i} total {i * 7} café" for i in range(10)]
    prompts = {str(i): tok.apply_chat_template([{"role": "user", "content": d}], tokenize=False,
                                                add_generation_prompt=True) for i, d in enumerate(docs)}
    requests = [
        Request(i, tok(p, add_special_tokens=False)["input_ids"],
                SamplingParams(max_tokens=3 + int(i) % 5, temperature=0.0, ignore_eos=True))
        for i, p in prompts.items()
    ]
    requests.append(Request("too-long", [1] * 5000, SamplingParams(max_tokens=4)))
    results, scraped = [], []
    for res in engine.generate(requests):
        obs.on_result(res.request_id, res)
        results.append(res)
        scraped.append(_rows_total(obs.metrics_port))  # type: ignore[arg-type]
    assert scraped == sorted(scraped) and scraped[-1] == len(results) == 11 and scraped[0] < scraped[-1]
    out_table = pa.table({"id": [r.request_id for r in results], "error": [r.error for r in results]})
    pq.write_table(out_table, str(out / "part-000000.parquet"))
    Manifest(out, "fp", id_column="id", parts=[PartInfo("part-000000.parquet", 11, 1)]).save()
    obs.close({"config": {"model": str(tiny_model)}})

    report = json.loads(layout.report_json_path(out).read_text())
    t = report["totals"]
    assert t["rows"] == 11 and t["errors"] == 1 and report["output"]["matches_records"]
    assert t["completion_tokens"] == sum(r.completion_tokens for r in results) == sum(3 + i % 5 for i in range(10))
    assert t["prompt_tokens"] == sum(r.prompt_tokens for r in results)
    assert t["decode_tokens_processed"] + t["prefill_tokens_processed"] >= t["completion_tokens"]
    assert report["kv"]["total_blocks"] == 64
    assert report["latency_s"]["ttft"]["count"] == 10
    ids = read_token_ids(out)
    assert ids.height == 11
    for row in ids.filter(ids["id"] != "too-long").iter_rows(named=True):
        assert tok.decode(row["prompt_token_ids"], skip_special_tokens=False) == prompts[row["id"]]
        assert len(row["output_token_ids"]) == 3 + int(row["id"]) % 5
