"""The model's tokenizer from its own files, without importing transformers.

`FastTokenizer` reads tokenizer.json (the `tokenizers` library, Rust), tokenizer_config.json and
special_tokens_map.json, and the chat template (chat_template.jinja or the config's), and offers the
part of a Hugging Face fast tokenizer that the engine and the job use: `__call__`/`encode` (batched
calls run in Rust with the GIL released), `decode`, `convert_ids_to_tokens`, `apply_chat_template`
(the same Jinja environment as transformers: trim_blocks, lstrip_blocks, loopcontrols, its tojson,
raise_exception and strftime_now), special-token attributes, `len()` and `get_vocab`.

Why: importing transformers pulls in torch.distributed, and, where they are installed, sklearn,
scipy, pandas and sympy; on the H200 host that is ~13 s of Python work before a job's first step,
holding the GIL while the engine starts (BENCHMARKS.md, the whole job). This module needs only
`tokenizers` and `jinja2`.

`unsupported(folder)` says why a folder's tokenizer needs transformers (a tokenizer class whose
Python code changes what tokenizer.json says, BOS/EOS flags that rewrite the post-processor, a
template using transformers' own `{% generation %}` tag, space clean-up on decode); models.loader
then loads it with transformers as before. Tests compare every method with transformers on the
same files.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

# tokenizer classes that are tokenizer.json as it is (no Python-side rewriting of the backend)
PLAIN_CLASSES = frozenset({
    "TokenizersBackend", "PreTrainedTokenizerFast", "GPT2Tokenizer", "GPT2TokenizerFast",
    "Qwen2Tokenizer", "Qwen2TokenizerFast",
})
NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _content(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def _chat_template(folder: Path, config: dict) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def unsupported(folder: Path) -> str | None:
    """Why FastTokenizer cannot stand in for transformers on this folder's tokenizer, or None."""
    folder = Path(folder)
    if not (folder / "tokenizer.json").exists():
        return "no tokenizer.json"
    config = _read_json(folder / "tokenizer_config.json")
    cls = config.get("tokenizer_class")
    if cls is not None and cls not in PLAIN_CLASSES:
        return f"tokenizer_class {cls} has its own Python code"
    for key in ("add_bos_token", "add_eos_token"):
        if key in config:
            return f"{key} rewrites the post-processor"
    if config.get("clean_up_tokenization_spaces"):
        return "clean_up_tokenization_spaces"
    if config.get("split_special_tokens"):
        return "split_special_tokens"
    template = _chat_template(folder, config)
    if template is not None and "generation" in template and "{% generation" in template.replace("{%-", "{%"):
        return "the chat template uses transformers' generation tag"
    return None


class _Added:
    """One added_tokens_decoder entry (what vocab_from_hf reads: .content, .special)."""

    __slots__ = ("content", "special")

    def __init__(self, content: str, special: bool) -> None:
        self.content = content
        self.special = special


class FastTokenizer:
    """A Hugging Face fast tokenizer's used subset, from a model folder (see the module docstring)."""

    is_fast = True  # backed by the Rust tokenizer, as transformers' fast tokenizers are

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer

        self.name_or_path = str(folder)
        folder = Path(folder)
        self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        self.chat_template = _chat_template(folder, config)
        self._named: dict[str, str] = {}
        for attr in NAMED_SPECIALS:
            value = _content(config.get(attr))
            if value is None:
                value = _content(special_map.get(attr))
            if value is not None:
                self._named[attr] = value
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens"))
        if extra is None:
            extra = special_map.get("additional_special_tokens", [])
        if isinstance(extra, dict):  # named extras (multimodal models): their values
            extra = list(extra.values())
        self._extra = [c for c in (_content(t) for t in extra or []) if c is not None]
        self.model_max_length = config.get("model_max_length")
        self._template = None  # compiled on first use (not pickled)

    # -- sizes and vocabulary -------------------------------------------------------------------
    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=False)

    @property
    def backend_tokenizer(self) -> Any:
        return self._tok

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict[int, _Added]:
        return {i: _Added(t.content, t.special) for i, t in self._tok.get_added_tokens_decoder().items()}

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(t) for t in tokens]

    def _token_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        tid = self._tok.token_to_id(token)
        if tid is None and "unk_token" in self._named:
            tid = self._tok.token_to_id(self._named["unk_token"])
        return tid

    # -- special tokens -------------------------------------------------------------------------
    @property
    def special_tokens_map(self) -> dict[str, str]:
        return dict(self._named)

    @property
    def all_special_tokens(self) -> list[str]:
        seen: list[str] = []
        for token in [*self._named.values(), *self._extra]:
            if token not in seen:
                seen.append(token)
        return seen

    @property
    def all_special_ids(self) -> list[int]:
        return [i for i in (self._token_id(t) for t in self.all_special_tokens) if i is not None]

    def __getattr__(self, name: str) -> Any:
        # bos_token / eos_token_id / pad_token ... like transformers: None when the model has none
        base = name[:-3] if name.endswith("_id") else name
        if base in NAMED_SPECIALS:
            token = self.__dict__.get("_named", {}).get(base)
            return token if base == name else self._token_id(token)
        raise AttributeError(name)

    # -- encoding and decoding ------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> dict[str, Any]:
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        encodings = self._tok.encode_batch(list(text), add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encodings]}

    def decode(self, ids: int | list[int], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None) -> str:
        # clean-up is never on here (unsupported() sends such tokenizers to transformers)
        if isinstance(ids, int):
            ids = [ids]
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- chat -----------------------------------------------------------------------------------
    def apply_chat_template(
        self, messages: list[dict], tokenize: bool = True, add_generation_prompt: bool = False, return_dict: bool = True,
        **kwargs: Any,
    ) -> Any:
        """The rendered chat (tokenize=False), its ids, or (return_dict) {input_ids, attention_mask}:
        transformers 5's defaults."""
        if self.chat_template is None:
            raise ValueError(f"{self.name_or_path}: the tokenizer has no chat template")
        if self._template is None:
            self._template = _compile(self.chat_template)
        text = self._template.render(
            messages=messages, tools=kwargs.pop("tools", None), documents=kwargs.pop("documents", None),
            add_generation_prompt=add_generation_prompt, **{**self._named, **kwargs},
        )
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_template"] = None
        return state


def _compile(template: str) -> Any:
    """The template compiled in the Jinja environment transformers renders chat templates in."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


__all__ = ["FastTokenizer", "unsupported"]
