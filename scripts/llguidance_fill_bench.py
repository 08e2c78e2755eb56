"""Host cost of llguidance masks for docs1000-json's schema: fresh matchers vs deep copies of prototypes.

256 rows at different positions inside the schema's maxLength-bounded strings (Qwen 151k vocabulary),
12 parallel fills on llguidance's executor (the engine's pool size for this host). Prints ms per fill
for: fresh matchers; copies of one prototype; copies of K prototypes (K = pool threads), rows in
arbitrary order; the same with rows grouped by prototype (what the engine does).

Usage: python3 scripts/llguidance_fill_bench.py
"""
import time, torch, llguidance, random
from pathlib import Path
from batchinfer.bench.shapes import write_shape
from batchinfer.bench.workloads import make_workload
from batchinfer.structured.compiler import GrammarCompiler
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(write_shape("qwen3-0.6b", Path("/tmp/bi-shape")))
c = make_workload("docs1000-json", len(tok)).requests[0].constraint
comp = GrammarCompiler(tok, len(tok), "llguidance")
g = comp.compile(c)
be = comp.backend("llguidance")
words = "the of report quarterly widget gadget analysis market growth summary finance data model".split()
rng = random.Random(0)
n, steps = 256, 12
texts = []
for i in range(n):
    body = " ".join(rng.choice(words) for _ in range(60))
    texts.append('{"title":"' + body[:rng.randint(5, 150)] + '","summary":"' + body + body)
ids = [tok.encode(t, add_special_tokens=False) for t in texts]
starts = [rng.randint(0, 60) for _ in range(n)]
W = (len(tok) + 31) // 32
ex = be._pool()
def run(make, label, order=None):
    t0 = time.perf_counter()
    ms = make()
    build_us = (time.perf_counter() - t0) / n * 1e6
    for m, i, s in zip(ms, ids, starts):
        for t in i[:s]: assert m.consume_token(t)
    mask = torch.full((n, W), -1, dtype=torch.int32)
    rows = order if order is not None else list(range(n))
    tot = acc = 0.0
    for k in range(steps):
        t0 = time.perf_counter()
        ex.unsafe_compute_mask_ptr([(ms[r], r) for r in rows], mask.data_ptr(), W * 4, n)
        tot += time.perf_counter() - t0
        t0 = time.perf_counter()
        assert all(ex.consume_token_par([(ms[r], ids[r][starts[r] + k]) for r in rows]))
        acc += time.perf_counter() - t0
    print(f"{label}: {tot / steps * 1e3:.2f} ms per fill of {n} rows, {acc / steps * 1e3:.2f} ms per parallel accept; "
          f"{build_us:.0f} us to build a matcher")
fresh = lambda: [llguidance.LLMatcher(g._tok, g.grammar, log_level=0) for _ in range(n)]
proto = llguidance.LLMatcher(g._tok, g.grammar, log_level=0)
one = lambda: [proto.deep_copy() for _ in range(n)]
K = be.fill_threads()
protos = [llguidance.LLMatcher(g._tok, g.grammar, log_level=0) for _ in range(K)]
grouped = lambda: [protos[i % K].deep_copy() for i in range(n)]
order = sorted(range(n), key=lambda i: i % K)
run(fresh, "fresh")
run(one, "one prototype")
run(grouped, f"{K} prototypes, rows unsorted")
run(grouped, f"{K} prototypes, rows sorted by prototype", order)
