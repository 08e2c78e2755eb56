"""The job file: a typed, frozen spec of one batch job, loaded from YAML (or a dict).

Why pydantic: one model gives validation with messages that name the field, the defaults, and the
JSON Schema that editors use (exported to schemas/job.schema.json; a test keeps it up to date).
Relative paths resolve against the job file's folder, so a job file can travel with its data.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, create_model, field_validator, model_validator

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.request import SamplingParams

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "schemas" / "job.schema.json"

log = logging.getLogger(__name__)


class JobError(ValueError):
    """A job the user got wrong (bad key, bad value, missing file). The message says what and where."""


_STRICT = ConfigDict(extra="forbid", frozen=True)


def _resolve(value: str, info: ValidationInfo) -> str:
    """A relative local path against the job file's folder; absolute paths and URIs (s3://...) as they are."""
    from batchinfer.io.store import is_uri

    base = (info.context or {}).get("base_dir")
    if base is None or Path(value).is_absolute() or is_uri(value):
        return value
    return str((Path(base) / value).resolve()) if value else value


class ModelSpec(BaseModel):
    """The model: a Hugging Face folder (relative to the job file) or a hub id in the local cache."""

    model_config = _STRICT
    path: str = Field(description="HF model folder (relative to the job file) or a hub id already in the local HF cache")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    quantization: Literal["none", "fp8"] = Field(
        "none", description="fp8: the decoder layers' projections quantised to FP8 at load (per-channel weight scales, "
        "per-token activation scales); an FP8 checkpoint (quantization_config) runs as stored either way",
    )
    fp8_keep: tuple[str, ...] = Field(
        (), description="with quantization fp8: projections left in 16-bit (weights and inputs), by checkpoint module "
        "name or pattern: o_proj (every layer's), layers.0 (all of layer 0), model.layers.29.mlp.down_proj, re:REGEX; "
        "q/k/v and gate/up are fused: all or none. A checkpoint's own ignore list is kept too",
    )
    max_model_len: int | None = Field(None, ge=1, description="longest prompt + output; default: the model's")

    @field_validator("path")
    @classmethod
    def _path(cls, v: str, info: ValidationInfo) -> str:
        base = (info.context or {}).get("base_dir")
        if base is not None and not Path(v).is_absolute() and (v.startswith(".") or (Path(base) / v).exists()):
            return str((Path(base) / v).resolve())
        return v  # a hub id (`org/name`)


OPENAI_ID = "custom_id"  # the id of a line of an OpenAI Batch file
OPENAI_MESSAGES = "body.messages"  # where its chat is


class InputSpec(BaseModel):
    """Where the rows come from."""

    model_config = _STRICT
    path: str = Field(description="a file, folder or glob of .parquet / .jsonl / .jsonl.gz files; local or a URI (s3://, gs://, hf://, ...)")
    id_column: str | None = Field(None, description="unique key of a row (required; custom_id for format openai)")
    format: Literal["auto", "parquet", "jsonl", "openai"] = Field(
        "auto", description="auto: from each file's extension; openai: OpenAI Batch JSONL (custom_id, method, url, body)"
    )
    batch_size: int = Field(1024, ge=1, description="rows per read batch")
    check_content: bool = Field(
        False,
        description="store a hash of each input row (column input_hash); on resume, rows whose input changed "
        "since they were answered are done again (default: a finished id keeps its answer)",
    )

    _resolve_path = field_validator("path")(_resolve)

    @model_validator(mode="before")
    @classmethod
    def _openai_id(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("format") == "openai":
            if data.get("id_column") not in (None, OPENAI_ID):
                raise ValueError(f"input.id_column: the id of an OpenAI Batch line is {OPENAI_ID} (got {data['id_column']!r})")
            data = {**data, "id_column": OPENAI_ID}
        return data

    @model_validator(mode="after")
    def _id_column(self) -> "InputSpec":
        if self.id_column is None:
            raise ValueError("missing required key 'input.id_column'")
        return self

    @property
    def duplicates(self) -> Literal["stop", "reject"]:
        """A duplicate id stops the job (resume could not tell the rows apart); in an OpenAI Batch
        file the repeats of a custom_id are bad lines (rejected), the first one is answered."""
        return "reject" if self.format == "openai" else "stop"


class OutputSpec(BaseModel):
    """Where the answers go: a folder of Parquet part files plus a manifest."""

    model_config = _STRICT
    path: str = Field(description="output folder (local or a URI: s3://bucket/prefix/out); its run records go in _<name>.batchinfer beside it")
    keep_columns: tuple[str, ...] = Field((), description="input columns copied through (the id column always is)")
    rows_per_part: int = Field(5000, ge=1, description="a part file is committed after this many rows")
    seconds_per_part: float = Field(60.0, gt=0, description="... or after this many seconds")
    format: Literal["parquet", "openai"] = Field(
        "parquet", description="openai: also write results.jsonl and errors.jsonl in the OpenAI Batch output shape"
    )

    _resolve_path = field_validator("path")(_resolve)


class PromptSpec(BaseModel):
    """How a row becomes a prompt: a sandboxed Jinja template over the row's columns, or a column of chat messages."""

    model_config = _STRICT
    template: str | None = Field(None, description="Jinja over the row's columns, e.g. 'Summarise: {{ text }}'")
    messages: str | None = Field(
        None, description="instead of template: a column holding a list of {role, content} chat messages (a.b: a nested field)"
    )
    system: str | None = Field(None, description="system message (chat) or a prefix line (no chat)")
    chat: bool | None = Field(None, description="apply the model's chat template; default: when it has one")

    @model_validator(mode="after")
    def _one(self) -> "PromptSpec":
        if self.template is not None and self.messages is not None:
            raise ValueError("prompt: give template or messages, not both")
        if self.messages is not None and self.chat is False:
            raise ValueError("prompt.messages is rendered with the model's chat template: it cannot have chat: false")
        return self


class SamplingSpec(BaseModel):
    """Sampling for every row (see batchinfer.engine.request.SamplingParams)."""

    model_config = _STRICT
    max_tokens: int = 256
    min_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = Field(1, ge=1, le=128, description="answers per row (each its own request, seed + i); n > 1: the `answers` column")
    logprobs: int | None = Field(
        None, ge=0, le=20, description="the chosen tokens' logprobs and the top-K alternatives (K = this) as output columns"
    )

    @model_validator(mode="after")
    def _check(self) -> "SamplingSpec":
        self.to_params()
        return self

    def to_params(self) -> SamplingParams:
        """The engine's SamplingParams of one answer (n is the job's: that many requests per row)."""
        return SamplingParams(**self.model_dump(exclude={"n"}))


class StructuredSpec(BaseModel):
    """What every answer must match: exactly one of json_schema, regex, choice."""

    model_config = _STRICT
    json_schema: str | dict[str, Any] | None = Field(None, description="a path to a JSON Schema file, or the schema inline")
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    backend: Literal["auto", "xgrammar", "llguidance", "outlines"] = Field(
        "auto", description="the grammar backend that compiles and enforces the constraint (validate, plan and the engine)"
    )
    whitespace: Literal["compact", "flexible"] = Field(
        "compact", description="compact: no whitespace between JSON tokens; flexible: at most 20 characters per gap"
    )
    max_string_length: int | None = Field(
        None, ge=1,
        description="json_schema only: the grammar ends every string at this many characters unless the schema "
        "sets a smaller maxLength (an answer can then always finish; default: strings bounded only by the schema)",
    )

    @field_validator("json_schema")
    @classmethod
    def _schema_path(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, str) and not v.lstrip().startswith("{"):
            return _resolve(v, info)
        return v

    @model_validator(mode="after")
    def _one(self) -> "StructuredSpec":
        given = [k for k in ("json_schema", "regex", "choice") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json_schema, regex, choice (got {', '.join(given) or 'none'})")
        if self.choice is not None and not self.choice:
            raise ValueError("choice needs at least one option")
        if self.max_string_length is not None and self.json_schema is None:
            raise ValueError("max_string_length applies to json_schema only")
        return self

    def schema_dict(self) -> dict[str, Any] | None:
        """The JSON schema as a dict (read from its file if a path); None for regex/choice."""
        v = self.json_schema
        if v is None or isinstance(v, dict):
            return v
        if v.lstrip().startswith("{"):
            try:
                return json.loads(v)
            except json.JSONDecodeError as e:
                raise JobError(f"structured.json_schema: inline schema is not valid JSON: {e}") from None
        p = Path(v)
        if not p.is_file():
            raise JobError(f"structured.json_schema: file not found: {p}")
        try:
            return json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise JobError(f"structured.json_schema: cannot read {p}: {e}") from None

    def constraint(self):
        """The engine's Constraint for this spec."""
        from batchinfer.structured.base import Constraint

        if self.regex is not None:
            return Constraint.regex(self.regex)
        if self.choice is not None:
            return Constraint.choice(list(self.choice))
        return Constraint.json_schema(self.schema_dict(), whitespace=self.whitespace, max_string_length=self.max_string_length)


# EngineConfig fields a job sets elsewhere: model.path, model.dtype, model.quantization, model.fp8_keep, model.max_model_len,
# structured.backend.
ENGINE_FIELDS_ELSEWHERE = {"model": "model.path", "dtype": "model.dtype", "quantization": "model.quantization",
                           "fp8_keep": "model.fp8_keep",
                           "max_model_len": "model.max_model_len", "grammar_backend": "structured.backend"}


def _engine_spec_model() -> type[BaseModel]:
    """EngineSpec mirrors every EngineConfig field except those set elsewhere in the job (ENGINE_FIELDS_ELSEWHERE)."""
    hints = typing.get_type_hints(EngineConfig)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(EngineConfig):
        if f.name in ENGINE_FIELDS_ELSEWHERE:
            continue
        fields[f.name] = (hints[f.name], f.default)
    # Not an EngineConfig field (that is one engine): how many engines run the job, one per GPU.
    fields["data_parallel"] = (
        typing.Annotated[int, Field(ge=1)] | Literal["auto"],
        Field(1, description="engine processes, one per GPU of the host; auto: one per visible GPU (1 on CPU)"),
    )
    model = create_model("EngineSpec", __config__=_STRICT, __doc__="Engine settings (EngineConfig fields).", **fields)
    return model


EngineSpec = _engine_spec_model()


class JobSpec(BaseModel):
    """One batch job. See README.md, "Job reference"."""

    model_config = ConfigDict(extra="forbid", frozen=True, title="batchinfer job")
    model: ModelSpec
    input: InputSpec
    output: OutputSpec
    prompt: PromptSpec = PromptSpec()
    sampling: SamplingSpec = SamplingSpec()
    structured: StructuredSpec | None = None
    engine: EngineSpec = EngineSpec()  # type: ignore[valid-type]

    @field_validator("model", mode="before")
    @classmethod
    def _model_shorthand(cls, v: Any) -> Any:
        return {"path": v} if isinstance(v, str) else v

    @model_validator(mode="before")
    @classmethod
    def _grammar_backend_alias(cls, data: Any) -> Any:
        """engine.grammar_backend (deprecated) is structured.backend: moved there; both given and different is an error."""
        if not isinstance(data, dict) or not isinstance(data.get("engine"), dict) or "grammar_backend" not in data["engine"]:
            return data
        data = dict(data)
        engine = dict(data["engine"])
        value = engine.pop("grammar_backend")
        data["engine"] = engine
        backends = typing.get_args(StructuredSpec.model_fields["backend"].annotation)
        if value is not None and value not in backends:
            raise ValueError(f"engine.grammar_backend (deprecated: use structured.backend) must be one of "
                             f"{', '.join(backends)}, not {value!r}")
        structured = data.get("structured")
        if not isinstance(structured, dict):
            if value not in (None, "auto"):
                log.warning("engine.grammar_backend is deprecated and ignored here: the job has no `structured` section")
            return data
        given = structured.get("backend", "auto")
        if value in (None, "auto") or value == given:
            log.warning("engine.grammar_backend is deprecated: use structured.backend")
            return data
        if given != "auto":
            raise ValueError(
                f"engine.grammar_backend (deprecated) is {value!r} but structured.backend is {given!r}; "
                "set only structured.backend"
            )
        log.warning("engine.grammar_backend is deprecated: use structured.backend (taken as structured.backend: %s)", value)
        data["structured"] = {**structured, "backend": value}
        return data

    @model_validator(mode="before")
    @classmethod
    def _openai_messages(cls, data: Any) -> Any:
        """An OpenAI Batch input's chat is each line's body.messages: that is its prompt.messages."""
        if isinstance(data, dict) and isinstance(data.get("input"), dict) and data["input"].get("format") == "openai":
            prompt = data.get("prompt") or {}
            if isinstance(prompt, dict):
                if prompt.get("template") is not None:
                    raise ValueError(f"prompt.template: with input.format openai the prompt is each line's {OPENAI_MESSAGES}")
                if prompt.get("messages") not in (None, OPENAI_MESSAGES):
                    raise ValueError(f"prompt.messages: with input.format openai it is {OPENAI_MESSAGES}")
                data = {**data, "prompt": {**prompt, "messages": OPENAI_MESSAGES}}
        return data

    @model_validator(mode="after")
    def _engine_ok(self) -> "JobSpec":
        if self.prompt.template is None and self.prompt.messages is None:
            raise ValueError("missing required key 'prompt.template' (or prompt.messages: a column of chat messages)")
        self.engine_config()
        return self

    @property
    def grammar_backend(self) -> str:
        """The one grammar backend setting (structured.backend): what validate, plan and the engine use."""
        return self.structured.backend if self.structured is not None else "auto"

    def engine_config(self) -> EngineConfig:
        """The engine's config: the `engine` section, with model.* and structured.backend filled in."""
        fields = self.engine.model_dump(exclude={"data_parallel"})
        return EngineConfig(
            model=self.model.path, dtype=self.model.dtype, quantization=self.model.quantization,
            fp8_keep=self.model.fp8_keep, max_model_len=self.model.max_model_len, grammar_backend=self.grammar_backend, **fields,
        )


def job_json_schema() -> dict[str, Any]:
    """The JSON Schema of the job file (what schemas/job.schema.json holds)."""
    schema = JobSpec.model_json_schema()
    # The shorthand `model: path/to/dir` is accepted too.
    props = schema["properties"]
    props["model"] = {"anyOf": [{"type": "string"}, props["model"]], "description": "model folder, or {path, dtype, quantization, fp8_keep, max_model_len}"}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


def write_json_schema(path: Path = SCHEMA_PATH) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(job_json_schema(), indent=2, sort_keys=True) + "\n")


# ---- loading -------------------------------------------------------------------------------------


def parse_set(assignments: list[str] | tuple[str, ...]) -> list[tuple[list[str], Any]]:
    """Parse `key.path=value` overrides; values are YAML (`8` is an int, `[a, b]` a list); text that is
    not valid YAML, or starts like a Jinja template, is taken as a string."""
    out = []
    for a in assignments:
        key, sep, raw = a.partition("=")
        if not sep or not key.strip():
            raise JobError(f"--set {a!r}: expected key.path=value")
        if raw.lstrip().startswith(("{{", "{%")):  # a Jinja template, not a YAML mapping
            value: Any = raw
        else:
            try:
                value = yaml.safe_load(raw) if raw.strip() else ""
            except yaml.YAMLError:
                value = raw  # not YAML: take the text as it is
        out.append(([p for p in key.strip().split(".")], value))
    return out


def apply_set(data: dict[str, Any], assignments: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Return a copy of `data` with the overrides applied (intermediate mappings are created)."""
    data = json.loads(json.dumps(data, default=str))
    for keys, value in parse_set(assignments):
        node = data
        for i, k in enumerate(keys[:-1]):
            child = node.get(k)
            if child is None:
                child = node[k] = {}
            elif isinstance(child, str) and k == "model" and i == 0:
                child = node[k] = {"path": child}
            elif not isinstance(child, dict):
                raise JobError(f"--set {'.'.join(keys)}: {'.'.join(keys[: i + 1])} is not a mapping")
            node = child
        node[keys[-1]] = value
    return data


def _model_at(loc: tuple) -> type[BaseModel] | None:
    model: Any = JobSpec
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        ann = model.model_fields[part].annotation
        nxt = None
        for cand in typing.get_args(ann) or (ann,):
            if isinstance(cand, type) and issubclass(cand, BaseModel):
                nxt = cand
        model = nxt
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def format_validation_error(err: ValidationError, source: str) -> str:
    """One readable line per problem, each naming the key (and, for unknown keys, the allowed ones)."""
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        # drop pydantic's union branch tags like 'str' / 'ModelSpec'
        loc = tuple(p for p in loc if p not in ("str", "dict[str,any]", "ModelSpec", "StructuredSpec", "tuple[str, ...]"))
        where = ".".join(str(p) for p in loc) or "(top level)"
        if e["type"] == "extra_forbidden":
            parent = _model_at(loc[:-1])
            allowed = ", ".join(parent.model_fields) if parent else "?"
            lines.append(f"unknown key '{where}'; allowed keys here: {allowed}")
        elif e["type"] == "missing":
            lines.append(f"missing required key '{where}'")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            if e["type"] != "value_error":
                lines.append(f"{where}: {msg} (got {e.get('input')!r})")
            elif not loc or msg.startswith(("missing required key", f"{where}.", f"{where}:")):
                lines.append(msg)  # the message names its key itself
            else:
                lines.append(f"{where}: {msg}")
    seen = list(dict.fromkeys(lines))
    return f"invalid job {source}:\n  " + "\n  ".join(seen)


def yaml_error(path: Path, e: "yaml.YAMLError") -> str:
    """One line for a YAML syntax error: file:line:column and what the parser found (not its dump)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    context = getattr(e, "context", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    what = f"{problem} ({context})" if context else problem
    return f"{where}: not valid YAML: {what}"


def load_job(
    job: "str | Path | dict[str, Any] | JobSpec",
    overrides: list[str] | tuple[str, ...] = (),
    base_dir: str | Path | None = None,
) -> JobSpec:
    """Load and validate a job from a YAML path, a dict or a JobSpec; apply `--set` overrides.

    Relative paths resolve against the job file's folder (for a dict: `base_dir`, default the cwd).
    Raises JobError with a message that names the key or file.
    """
    if isinstance(job, JobSpec):
        if not overrides:
            return job
        job = job.model_dump(mode="json")
    source = "(dict)"
    if isinstance(job, (str, Path)):
        path = Path(job)
        source = str(path)
        if not path.is_file():
            raise JobError(f"job file not found: {path}")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            raise JobError(yaml_error(path, e)) from None
        except (OSError, UnicodeDecodeError) as e:
            raise JobError(f"cannot read the job file {path}: {e}") from None
        if not isinstance(data, dict):
            raise JobError(f"{path}: a job file must be a YAML mapping (model, input, output, prompt, ...)")
        base_dir = path.resolve().parent
    else:
        data = dict(job)
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    data = apply_set(data, overrides)
    try:
        return JobSpec.model_validate(data, context={"base_dir": str(base)})
    except ValidationError as e:
        raise JobError(format_validation_error(e, source)) from None
    except ValueError as e:  # EngineConfig / SamplingParams checks raised outside a field
        raise JobError(f"invalid job {source}: {e}") from None


if __name__ == "__main__":  # python -m batchinfer.job.spec: refresh schemas/job.schema.json
    write_json_schema()
