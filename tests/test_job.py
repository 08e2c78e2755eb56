"""The job spec: validation messages, relative paths, --set overrides, the exported JSON Schema."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from batchinfer.job.spec import SCHEMA_PATH, JobError, JobSpec, apply_set, job_json_schema, load_job

BASE = {
    "model": "models/tiny",
    "input": {"path": "data/*.jsonl", "id_column": "doc_id"},
    "output": {"path": "out/"},
    "prompt": {"template": "Summarise: {{ text }}"},
}


def write_job(tmp_path: Path, data: dict) -> Path:
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_minimal_job_resolves_paths_against_its_folder(tmp_path):
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    spec = load_job(write_job(tmp_path, BASE))
    assert spec.model.path == str((tmp_path / "models" / "tiny").resolve())
    assert spec.input.path == str((tmp_path / "data" / "*.jsonl").resolve())
    assert spec.output.path == str((tmp_path / "out").resolve())
    assert spec.sampling.temperature == 0.0 and spec.structured is None
    assert spec.engine_config().model == spec.model.path


def test_hub_id_is_kept_when_no_such_folder(tmp_path):
    spec = load_job(write_job(tmp_path, {**BASE, "model": "Qwen/Qwen3-0.6B"}))
    assert spec.model.path == "Qwen/Qwen3-0.6B"


def test_unknown_key_names_it_and_the_allowed_ones(tmp_path):
    bad = {**BASE, "output": {"path": "o", "keep_column": ["a"]}, "sampler": {}}
    with pytest.raises(JobError) as e:
        load_job(write_job(tmp_path, bad))
    msg = str(e.value)
    assert "unknown key 'output.keep_column'" in msg and "keep_columns" in msg
    assert "unknown key 'sampler'" in msg and "sampling" in msg


def test_missing_id_column_and_bad_values(tmp_path):
    bad = {**BASE, "input": {"path": "x.jsonl"}, "sampling": {"top_p": 0}}
    with pytest.raises(JobError) as e:
        load_job(write_job(tmp_path, bad))
    assert "missing required key 'input.id_column'" in str(e.value)
    assert "top_p" in str(e.value)


def test_engine_fields_are_checked(tmp_path):
    with pytest.raises(JobError, match="max_num_seqs"):
        load_job(write_job(tmp_path, {**BASE, "engine": {"max_num_seqs": 0}}))
    with pytest.raises(JobError, match="unknown key 'engine.model'"):
        load_job(write_job(tmp_path, {**BASE, "engine": {"model": "x"}}))


def test_set_overrides_parse_yaml_scalars(tmp_path):
    spec = load_job(
        write_job(tmp_path, BASE),
        ["output.path=/data/out/2024-01-02", "engine.max_num_seqs=8", "sampling.stop=[END, STOP]", "model.dtype=float32",
         "prompt.template={{ text }}: go", "prompt.system=a: b: c"],
    )
    assert spec.prompt.template == "{{ text }}: go" and spec.prompt.system == "a: b: c"
    assert spec.output.path == "/data/out/2024-01-02"
    assert spec.engine.max_num_seqs == 8
    assert spec.sampling.stop == ("END", "STOP")
    assert spec.model.dtype == "float32"


def test_set_errors_are_clear(tmp_path):
    with pytest.raises(JobError, match="key.path=value"):
        load_job(write_job(tmp_path, BASE), ["output.path"])
    with pytest.raises(JobError, match="unknown key 'prompt.tmpl'"):
        load_job(write_job(tmp_path, BASE), ["prompt.tmpl=x"])
    with pytest.raises(JobError, match="is not a mapping"):
        apply_set({"a": 1}, ["a.b=2"])


def test_structured_needs_exactly_one_kind(tmp_path):
    with pytest.raises(JobError, match="exactly one of json_schema, regex, choice"):
        load_job(write_job(tmp_path, {**BASE, "structured": {"regex": "a+", "choice": ["x"]}}))
    with pytest.raises(JobError, match="exactly one"):
        load_job(write_job(tmp_path, {**BASE, "structured": {}}))


def test_json_schema_from_file_inline_or_missing(tmp_path):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    spec = load_job(write_job(tmp_path, {**BASE, "structured": {"json_schema": "s.json"}}))
    assert spec.structured.schema_dict() == schema
    assert spec.structured.constraint().kind == "json_schema"
    inline = load_job(write_job(tmp_path, {**BASE, "structured": {"json_schema": schema}}))
    assert inline.structured.schema_dict() == schema
    missing = load_job(write_job(tmp_path, {**BASE, "structured": {"json_schema": "nope.json"}}))
    with pytest.raises(JobError, match="nope.json"):
        missing.structured.schema_dict()


def test_bad_yaml_and_missing_file(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("model: [unclosed")
    with pytest.raises(JobError, match="not valid YAML"):
        load_job(p)
    with pytest.raises(JobError, match="not found"):
        load_job(tmp_path / "nope.yaml")


def test_spec_is_frozen_and_dict_jobs_work(tmp_path):
    spec = load_job(BASE, base_dir=tmp_path)
    with pytest.raises(Exception):
        spec.model = None  # type: ignore[misc]
    assert load_job(spec) is spec


def test_exported_schema_is_up_to_date():
    assert SCHEMA_PATH.exists(), "run `python -m batchinfer.job.spec` to write schemas/job.schema.json"
    assert json.loads(SCHEMA_PATH.read_text()) == job_json_schema(), "run `python -m batchinfer.job.spec` to refresh it"
    assert set(job_json_schema()["properties"]) == set(JobSpec.model_fields)


def test_engine_section_mirrors_every_engine_config_field_set_nowhere_else():
    import dataclasses

    from batchinfer.engine.config import EngineConfig
    from batchinfer.job.spec import ENGINE_FIELDS_ELSEWHERE, EngineSpec

    config = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(EngineSpec.model_fields) == (config - set(ENGINE_FIELDS_ELSEWHERE)) | {"data_parallel"}
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    engine_block = readme[readme.index("engine:                              #"):readme.index("```", readme.index("engine:  "))]
    keys = "\n".join(line.split("#")[0] for line in engine_block.splitlines())
    listed = set(re.findall(r"(\w+):", keys)) - {"engine"}
    assert listed == set(EngineSpec.model_fields), "README's engine keys differ from the job's engine section"


def test_one_grammar_backend_setting(tmp_path, caplog):
    regex = {"regex": "[a-z]+"}
    spec = load_job({**BASE, "structured": {**regex, "backend": "outlines"}})
    assert spec.grammar_backend == "outlines" and spec.engine_config().grammar_backend == "outlines"
    assert load_job({**BASE, "structured": regex}).engine_config().grammar_backend == "auto"
    # the deprecated alias engine.grammar_backend becomes structured.backend (what validate, plan and the engine use)
    with caplog.at_level("WARNING"):
        old = load_job({**BASE, "structured": regex, "engine": {"grammar_backend": "llguidance"}})
    assert old.structured.backend == "llguidance" and old.engine_config().grammar_backend == "llguidance"
    assert "grammar_backend" not in old.engine.model_dump() and "deprecated" in caplog.text
    assert load_job(BASE, ["structured.regex=a", "engine.grammar_backend=xgrammar"]).grammar_backend == "xgrammar"
    with pytest.raises(JobError, match=r"engine.grammar_backend \(deprecated\) is 'outlines' but structured.backend is 'xgrammar'"):
        load_job({**BASE, "structured": {**regex, "backend": "xgrammar"}, "engine": {"grammar_backend": "outlines"}})
    with pytest.raises(JobError, match="engine.grammar_backend .* not 'nope'"):
        load_job({**BASE, "structured": regex, "engine": {"grammar_backend": "nope"}})
    assert "grammar_backend" not in job_json_schema()["$defs"]["EngineSpec"]["properties"]
