"""The tokenizer a GGUF file describes, as Hugging Face tokenizer files.

A GGUF carries no tokenizer.json: it stores llama.cpp's description of one in its metadata
(`tokenizer.ggml.*`: the model kind, the pre-tokenizer name, tokens, token types, merges, special
token ids, whether to add BOS, and `tokenizer.chat_template`).

Byte-level BPE (`tokenizer.ggml.model` = gpt2: SmolLM, Llama 3, Qwen 2/2.5/3) is built here with the
`tokenizers` library: a BPE model over the file's vocabulary and merges, the split regex its
pre-tokenizer name stands for, ByteLevel bytes, the control tokens as special added tokens, BOS
X
(tests/test_convert.py checks it on small files; on SmolLM2's file both agree too) in a fraction of a
second instead of the ~10 s that loader takes. Other
kinds (sentencepiece `llama`: Llama 2, Mistral v0.1) are handed to transformers' loader.
"""

from __future__ import annotations

from pathlib import Path

from batchinfer.convert.gguf_file import GGUFFile, GGUFError

# Split regexes of the byte-level pre-tokenizers llama.cpp names (facts of each tokenizer).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLITS = {"llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT, "llama-bpe": LLAMA3_SPLIT, "smaug-bpe": LLAMA3_SPLIT,
          "qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT}
# Pre-tokenizers that split like GPT-2. (smollm / starcoder also split digits one by one first;
# their vocabularies have no merge with a digit in it, so GPT-2's split gives the same tokens.)
GPT2_LIKE = ("default", "gpt2", "gpt-2", "smollm", "starcoder", "refact")

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types


def _byte_alphabet() -> dict[int, str]:
    from batchinfer.real_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


def build_byte_level(gguf: GGUFFile) -> tuple[object, list[str]]:
    """(tokenizers.Tokenizer, notes) for a gpt2-kind GGUF vocabulary."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens: list[str] = gguf.get("tokenizer.ggml.tokens") or []
    merges_raw: list[str] = gguf.get("tokenizer.ggml.merges") or []
    if not tokens:
        raise GGUFError(f"{gguf.path}: no tokenizer.ggml.tokens in the file")
    types = list(gguf.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {}
    for i, tok in enumerate(tokens):
        key = tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))
        vocab.setdefault(key, i)
    merges = []
    for m in merges_raw:
        a, sep, b = m.partition(" ")
        if not sep:
            raise GGUFError(f"{gguf.path}: merge {m!r} is not two tokens separated by a space")
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    notes = []
    pre = gguf.get("tokenizer.ggml.pre", "default")
    if pre in SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    else:
        if pre not in GPT2_LIKE:
            notes.append(f"pre-tokenizer {pre!r} is not known here: text is split as GPT-2 does")
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
               if ty == CONTROL and set(t) <= alphabet]
    tok.add_special_tokens(special)
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    if user:
        tok.add_tokens(user)
    bos_id = gguf.get("tokenizer.ggml.bos_token_id")
    eos_id = gguf.get("tokenizer.ggml.eos_token_id")
    add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", False)) and bos_id is not None
    add_eos = bool(gguf.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    if add_bos or add_eos:
        single = ([tokens[bos_id]] if add_bos else []) + ["$A"] + ([tokens[eos_id]] if add_eos else [])
        pair = single + ["$B:1"]
        ids = {i for i, on in ((bos_id, add_bos), (eos_id, add_eos)) if on}
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=[(tokens[i], i) for i in sorted(ids)]
        )
    return tok, notes


def _special(gguf: GGUFFile, key: str) -> str | None:
    tokens = gguf.get("tokenizer.ggml.tokens") or []
    i = gguf.get(f"tokenizer.ggml.{key}")
    return tokens[i] if i is not None and 0 <= i < len(tokens) else None


def write_tokenizer(gguf: GGUFFile, out: Path, max_length: int) -> list[str]:
    """Write tokenizer.json, tokenizer_config.json (and the chat template) to `out`; returns notes."""
    kind = gguf.get("tokenizer.ggml.model")
    template = gguf.get("tokenizer.chat_template")
    notes: list[str] = []
    if kind == "gpt2":
        from transformers import PreTrainedTokenizerFast

        backend, notes = build_byte_level(gguf)
        fast = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            bos_token=_special(gguf, "bos_token_id"),
            eos_token=_special(gguf, "eos_token_id"),
            unk_token=_special(gguf, "unknown_token_id"),
            pad_token=_special(gguf, "padding_token_id"),
            model_max_length=max_length,
            clean_up_tokenization_spaces=False,
        )
    elif kind is None:
        raise GGUFError(f"{gguf.path}: the file has no tokenizer (tokenizer.ggml.model)")
    else:
        from transformers import AutoTokenizer

        try:
            fast = AutoTokenizer.from_pretrained(str(gguf.path.parent), gguf_file=gguf.path.name)
        except Exception as exc:  # transformers raises several types for an unsupported tokenizer
            raise GGUFError(f"{gguf.path}: cannot build its {kind!r} tokenizer: {type(exc).__name__}: {exc}") from None
        fast.model_max_length = max_length
    if template:
        fast.chat_template = template
    else:
        notes.append("the file has no chat template (prompt.chat will be off for this model)")
    fast.save_pretrained(str(out))
    return notes
