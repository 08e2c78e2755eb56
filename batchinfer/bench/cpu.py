"""`batchinfer bench cpu`: our engine against transformers `generate` on the same real-text prompts, on a CPU.

The workload is chat prompts about real-looking business documents (examples/data/invoices.jsonl by
default: questions like "What is the total amount?" or "Summarize this document"), greedy, float32,
at most `max_tokens` new tokens, stopping at EOS. Both sides get the same token ids: the engine
through continuous batching, transformers as one static batch (left-padded, `generate` with
`do_sample=False`). Output tokens are counted the same way on both sides: every generated token up
to and including the first EOS (transformers' padding after EOS is not counted, but it is computed:
a static batch runs until its longest row ends, which is what continuous batching avoids).
`--ignore-eos` makes every row write exactly `max_tokens` (equal work on both sides).

Both run in one process, one after the other, `repeats` times with their order alternating, so
that load from other processes on the machine falls on both alike; the report gives every run, the
medians and the ratio of the medians, and how many rows gave identical tokens on both sides. CPU time
(all threads of the process) is reported beside the wall time: on a busy machine it is the steadier
measure of the work each side does (with more than one thread it includes OpenMP's spin-waiting).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_DOCS = Path(__file__).resolve().parents[2] / "examples" / "data" / "invoices.jsonl"
SYSTEM = "You are an assistant that answers questions about business documents. Answer briefly."
QUESTIONS = (
    "Who issued this document?",
    "What is the total amount, with its currency?",
    "Summarize this document in one sentence.",
    "What is the date of this document?",
    "What is the invoice or receipt number?",
    "List the items or services that were charged.",
)


@dataclass(frozen=True)
class CpuPrompts:
    texts: list[str]
    token_ids: list[list[int]]

    @property
    def mean_len(self) -> float:
        return sum(map(len, self.token_ids)) / len(self.token_ids)


def make_prompts(tokenizer, docs_path: Path = DEFAULT_DOCS, n: int = 40) -> CpuPrompts:
    """n chat prompts: document i mod len(docs) with question (i + i // len(docs)) mod len(QUESTIONS)
    (no two prompts alike while n <= len(docs) x len(QUESTIONS))."""
    path = Path(docs_path)
    if not path.is_file():
        raise FileNotFoundError(f"--docs {path} does not exist (a JSONL file of objects with a 'text' field)")
    docs = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
    if not docs:
        raise ValueError(f"{path} has no documents")
    texts = []
    for i in range(n):
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"{docs[i % len(docs)]}\n\n{QUESTIONS[(i + i // len(docs)) % len(QUESTIONS)]}"}]
        texts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    ids = [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    return CpuPrompts(texts, ids)


def _until_eos(row: list[int], eos: set[int], max_tokens: int) -> list[int]:
    for i, t in enumerate(row[:max_tokens]):
        if t in eos:
            return row[: i + 1]
    return row[:max_tokens]


class EngineSide:
    def __init__(self, model_dir: str, max_num_seqs: int, attention_backend: str = "auto") -> None:
        from batchinfer.engine.config import EngineConfig
        from batchinfer.engine.engine import Engine

        self.engine = Engine(EngineConfig(model=model_dir, dtype="float32", device="cpu", max_num_seqs=max_num_seqs,
                                          attention_backend=attention_backend))
        self.eos = set(self.engine.model_info.eos_token_ids)

    def run(self, prompts: CpuPrompts, max_tokens: int, ignore_eos: bool) -> tuple[list[list[int]], float]:
        from batchinfer.engine.request import Request, SamplingParams

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
        reqs = [Request(str(i), ids, sp) for i, ids in enumerate(prompts.token_ids)]
        t0 = time.perf_counter()
        results = list(self.engine.generate(reqs))
        seconds = time.perf_counter() - t0
        by_id = {r.request_id: list(r.output_token_ids) for r in results}
        return [by_id[str(i)] for i in range(len(reqs))], seconds


class TransformersSide:
    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        from batchinfer.models.loader import load_tokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = load_tokenizer(Path(model_dir))
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.model.config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos])
        pad = self.tokenizer.pad_token_id
        self.pad = pad if pad is not None else min(self.eos)

    @torch.inference_mode()
    def run(self, prompts: CpuPrompts, max_tokens: int, ignore_eos: bool) -> tuple[list[list[int]], float]:
        width = max(map(len, prompts.token_ids))
        ids = torch.full((len(prompts.token_ids), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(prompts.token_ids):  # left padding
            ids[i, width - len(row):] = torch.tensor(row)
            mask[i, width - len(row):] = 1
        extra = {"min_new_tokens": max_tokens} if ignore_eos else {}
        t0 = time.perf_counter()
        out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                                  pad_token_id=self.pad, **extra)
        seconds = time.perf_counter() - t0
        rows = out[:, width:].tolist()
        return [row[:max_tokens] if ignore_eos else _until_eos(row, self.eos, max_tokens) for row in rows], seconds


def run_cpu_bench(
    model_dir: str,
    docs: Path = DEFAULT_DOCS,
    num_prompts: int = 40,
    max_tokens: int = 96,
    threads: int = 2,
    repeats: int = 3,
    ignore_eos: bool = False,
    max_num_seqs: int = 256,
    log=print,
) -> dict:
    """Run both sides `repeats` times (order alternating); return every run, medians and the ratio."""
    torch.set_num_threads(threads)
    engine = EngineSide(model_dir, max_num_seqs)
    hf = TransformersSide(model_dir)
    prompts = make_prompts(hf.tokenizer, docs, num_prompts)
    # warm-up: one short pass of each (first calls allocate and pick kernels)
    warm = CpuPrompts(prompts.texts[:4], prompts.token_ids[:4])
    engine.run(warm, 4, True)
    hf.run(warm, 4, True)
    runs = {"batchinfer": [], "transformers": []}
    outputs = {}
    for rep in range(repeats):
        order = (("batchinfer", engine), ("transformers", hf)) if rep % 2 == 0 else (("transformers", hf), ("batchinfer", engine))
        for name, side in order:
            cpu0 = time.process_time()
            tokens, seconds = side.run(prompts, max_tokens, ignore_eos)
            cpu = time.process_time() - cpu0
            n = sum(map(len, tokens))
            runs[name].append({"seconds": seconds, "cpu_seconds": cpu, "output_tokens": n, "tokens_per_s": n / seconds})
            outputs[name] = tokens
            log(f"  run {rep + 1}/{repeats} {name:>12}: {n} output tokens in {seconds:.1f} s = {n / seconds:.1f} tok/s "
                f"({cpu:.1f} CPU s)")
    med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()}
    cpu_med = {k: statistics.median(r["cpu_seconds"] for r in v) for k, v in runs.items()}
    same = sum(a == b for a, b in zip(outputs["batchinfer"], outputs["transformers"]))
    return {
        "model": str(model_dir),
        "docs": str(docs),
        "prompts": num_prompts,
        "mean_prompt_tokens": prompts.mean_len,
        "max_tokens": max_tokens,
        "ignore_eos": ignore_eos,
        "threads": threads,
        "repeats": repeats,
        "runs": runs,
        "median_tokens_per_s": med,
        "ratio": med["batchinfer"] / med["transformers"],
        "median_cpu_seconds": cpu_med,
        "cpu_time_ratio": cpu_med["transformers"] / cpu_med["batchinfer"],
        "identical_rows": same,
        "mean_output_tokens": sum(map(len, outputs["batchinfer"])) / num_prompts,
        "torch": torch.__version__,
    }


def format_cpu_report(r: dict) -> str:
    med = r["median_tokens_per_s"]
    return "\n".join([
        f"{r['prompts']} chat prompts (mean {r['mean_prompt_tokens']:.0f} tokens), at most {r['max_tokens']} new tokens"
        f"{' (ignore_eos)' if r['ignore_eos'] else ''}, greedy float32, {r['threads']} threads, {r['repeats']} runs each",
        f"batchinfer engine:        {med['batchinfer']:.1f} output tok/s (median)",
        f"transformers generate:    {med['transformers']:.1f} output tok/s (median, one static batch)",
        f"CPU time (all threads): batchinfer {r['median_cpu_seconds']['batchinfer']:.1f} s, transformers "
        f"{r['median_cpu_seconds']['transformers']:.1f} s (ratio {r['cpu_time_ratio']:.2f}x)",
        f"ratio: {r['ratio']:.2f}x   identical outputs: {r['identical_rows']}/{r['prompts']} rows   "
        f"mean output {r['mean_output_tokens']:.1f} tokens",
    ])
