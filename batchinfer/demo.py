"""Small random models in Hugging Face format, built locally (no download).

Tests and the quickstart use them: the weights are random (the text they write is gibberish),
but the files are exactly what a real checkpoint has (config.json, safetensors, tokenizer,
generation_config.json), so the real loading code is exercised.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_WORDS = (
    "the of and to in is invoice total amount date customer name address number price item quantity "
    "document summary answer question field value true false null yes no company order payment due "
    "extract json schema title author year city country email phone street report page section "
    "alpha beta gamma delta zero one two three four five six seven eight nine ten hundred thousand"
).split()
_UNICODE = ["café", "naïve", "Größe", "日本語", "中文字符", "😀", "🚀", "€", "—", "ñandú", "Ελληνικά", "привет"]
_JSON = ['{"name": "', '", "total": ', ', "items": [', "]}", '{"a": 1, "b": [true, false, null]}', "\\n", '\\"']


def _corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        parts = []
        for _ in range(rng.randint(4, 24)):
            r = rng.random()
            if r < 0.70:
                parts.append(rng.choice(_WORDS))
            elif r < 0.80:
                parts.append(str(rng.randint(0, 100000)))
            elif r < 0.90:
                parts.append(rng.choice(_JSON))
            else:
                parts.append(rng.choice(_UNICODE))
        lines.append(" ".join(parts) + rng.choice([".", "?", "!", ":", ",", ""]))
    return lines


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512, seed: int = 0):
    """Train a byte-level BPE tokenizer with a ChatML template and save it in HF format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed=seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def _config(family: str, vocab_size: int, eos_id: int, pad_id: int, **overrides):
    import transformers as tf

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    if family == "llama":
        common.update(rope_theta=10000.0)
        common.update(overrides)
        return tf.LlamaConfig(**common)
    if family == "mistral":
        common.update(rope_theta=10000.0, sliding_window=None)
        common.update(overrides)
        return tf.MistralConfig(**common)
    if family == "qwen2":
        common.update(rope_theta=1000000.0, use_sliding_window=False, tie_word_embeddings=True)
        common.update(overrides)
        return tf.Qwen2Config(**common)
    if family == "qwen3":
        common.update(rope_theta=1000000.0, head_dim=32, use_sliding_window=False, tie_word_embeddings=True)
        common.update(overrides)
        return tf.Qwen3Config(**common)
    raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")


def build_model(
    out_dir: str | Path,
    family: str = "qwen3",
    vocab_size: int = 512,
    seed: int = 0,
    torch_dtype: str = "float32",
    max_shard_size: str | None = None,
    **config_overrides,
) -> Path:
    """Write a random model of `family` with a trained tokenizer to `out_dir`; return the folder.

    config_overrides go to the transformers config (e.g. rope_scaling, num_hidden_layers).
    max_shard_size (e.g. "200KB") writes a sharded checkpoint with model.safetensors.index.json.
    """
    import torch
    import transformers as tf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, vocab_size=vocab_size, seed=seed)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = _config(family, len(tokenizer), eos_id, pad_id, **config_overrides)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config)
    model = model.to(getattr(torch, torch_dtype))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), safe_serialization=True, **kwargs)
    gen = {"eos_token_id": [eos_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")], "pad_token_id": pad_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out
