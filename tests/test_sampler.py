"""Sampler tests: greedy, distributions against the exact filtered softmax, seed reproducibility."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.engine.request import SamplingParams
from batchinfer.engine.sampler import ban_tokens_, make_sampling_batch, sample, uniform_noise


def reference_probs(logits: list[float], p: SamplingParams) -> list[float]:
    """The exact distribution sample() should draw from, in float64 plain Python.

    temperature -> top-k (ties at the k-th value kept) -> top-p on the renormalised top-k
    distribution (keep the shortest prefix whose mass reaches p) -> min-p (p_i >= min_p * p_max).
    """
    n = len(logits)
    if p.temperature < 1e-5:
        best = max(range(n), key=lambda i: (logits[i], -i))
        return [1.0 if i == best else 0.0 for i in range(n)]
    scaled = [x / p.temperature for x in logits]
    keep = [True] * n
    if p.top_k > 0:
        kth = sorted(scaled, reverse=True)[min(p.top_k, n) - 1]
        keep = [k and s >= kth for k, s in zip(keep, scaled)]
    if p.top_p < 1.0:
        z = sum(math.exp(s) for s, k in zip(scaled, keep) if k)
        order = sorted((i for i in range(n) if keep[i]), key=lambda i: -scaled[i])
        cum, kept = 0.0, []
        for i in order:
            if cum >= p.top_p:
                break
            kept.append(i)
            cum += math.exp(scaled[i]) / z
        thr = min(scaled[i] for i in kept)
        keep = [k and s >= thr for k, s in zip(keep, scaled)]
    if p.min_p > 0.0:
        top = max(scaled)
        keep = [k and math.exp(s - top) >= p.min_p for k, s in zip(keep, scaled)]
    w = [math.exp(s) if k else 0.0 for s, k in zip(scaled, keep)]
    z = sum(w)
    return [x / z for x in w]


def draw_many(logits: list[float], p: SamplingParams, n: int, vary: str = "step") -> torch.Tensor:
    """n draws for one request: one batch of n identical rows differing only in step (or seed)."""
    rows = torch.tensor([logits] * n, dtype=torch.float32)
    seeds = [1234] * n if vary == "step" else list(range(n))
    steps = list(range(n)) if vary == "step" else [7] * n
    batch = make_sampling_batch([p] * n, seeds, steps, "cpu")
    return sample(rows, batch)


def chi_square_critical(df: int, z: float = 4.0) -> float:
    """Upper critical value of chi-square(df) at a normal quantile z (Wilson-Hilferty)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def assert_matches(draws: torch.Tensor, expected: list[float]) -> None:
    n = draws.numel()
    counts = torch.bincount(draws, minlength=len(expected)).tolist()
    for i, (c, e) in enumerate(zip(counts, expected)):
        if e == 0.0:
            assert c == 0, f"token {i} is filtered out but was drawn {c} times"
    support = [i for i, e in enumerate(expected) if e > 0]
    if len(support) == 1:
        assert counts[support[0]] == n
        return
    chi2 = sum((counts[i] - n * expected[i]) ** 2 / (n * expected[i]) for i in support)
    crit = chi_square_critical(len(support) - 1)
    freqs = [round(c / n, 4) for c in counts]
    assert chi2 < crit, f"chi2 {chi2:.1f} >= {crit:.1f}; freqs {freqs} vs {[round(e, 4) for e in expected]}"


TOY = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]

DIST_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=2.0),
    SamplingParams(top_k=3),
    SamplingParams(top_k=1),
    SamplingParams(top_p=0.8),
    SamplingParams(top_p=0.5, temperature=1.5),
    SamplingParams(min_p=0.2),
    SamplingParams(top_k=5, top_p=0.9),
    SamplingParams(top_k=6, top_p=0.7, min_p=0.1, temperature=0.8),
    SamplingParams(top_p=0.95, min_p=0.05, temperature=1.3),
]


@pytest.mark.parametrize("params", DIST_CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_distribution_matches_filtered_softmax(params):
    draws = draw_many(TOY, params, 20000, vary="step")
    assert_matches(draws, reference_probs(TOY, params))


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(top_k=4, top_p=0.9)])
def test_distribution_over_seeds(params):
    draws = draw_many(TOY, params, 20000, vary="seed")
    assert_matches(draws, reference_probs(TOY, params))


def test_distribution_mixed_batch_paths():
    """Rows of different kinds in one batch each follow their own distribution."""
    kinds = [SamplingParams(top_k=2), SamplingParams(top_p=0.6), SamplingParams(temperature=0.0), SamplingParams()]
    n = 6000
    params = [kinds[i % 4] for i in range(4 * n)]
    logits = torch.tensor([TOY] * (4 * n))
    batch = make_sampling_batch(params, [99] * (4 * n), [i // 4 for i in range(4 * n)], "cpu")
    out = sample(logits, batch)
    for j, p in enumerate(kinds):
        assert_matches(out[j::4], reference_probs(TOY, p))


def test_greedy_equals_argmax_with_ties_lowest_id():
    torch.manual_seed(0)
    logits = torch.randn(16, 300)
    logits[3, [10, 200]] = 50.0  # tie: lowest id wins
    batch = make_sampling_batch([SamplingParams(temperature=0.0)] * 16, range(16), [5] * 16, "cpu")
    out = sample(logits, batch)
    assert out.dtype == torch.int64
    assert torch.equal(out, logits.argmax(dim=-1))
    assert out[3].item() == 10


def test_greedy_rows_among_sampled_rows():
    torch.manual_seed(1)
    logits = torch.randn(8, 100)
    params = [SamplingParams(temperature=0.0) if i % 2 else SamplingParams(top_p=0.9) for i in range(8)]
    out = sample(logits, make_sampling_batch(params, range(8), [0] * 8, "cpu"))
    assert torch.equal(out[1::2], logits[1::2].argmax(dim=-1))


REPRO_PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.7, top_k=20),
    SamplingParams(top_p=0.9),
    SamplingParams(min_p=0.05, temperature=1.2),
    SamplingParams(top_k=50, top_p=0.8, min_p=0.01),
    SamplingParams(temperature=0.0),
]


@pytest.mark.parametrize("target", REPRO_PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_same_seed_same_tokens_whatever_shares_the_batch(target):
    """A row draws the same tokens alone, or among others at another index (other sampling paths)."""
    gen = torch.Generator().manual_seed(3)
    vocab, steps = 500, 12
    row_logits = torch.randn(steps, vocab, generator=gen) * 3
    others = [SamplingParams(top_k=5), SamplingParams(temperature=0.0), SamplingParams(top_p=0.5), SamplingParams()]
    alone, mixed = [], []
    for step in range(steps):
        b = make_sampling_batch([target], [42], [step], "cpu")
        alone.append(sample(row_logits[step : step + 1], b).item())
        # Same request at index 2 among others with other seeds, steps and logits.
        noise = torch.randn(len(others), vocab, generator=gen)
        logits = torch.cat([noise[:2], row_logits[step : step + 1], noise[2:]])
        params = others[:2] + [target] + others[2:]
        b = make_sampling_batch(params, [1, 2, 42, 3, 4], [step + 5, 0, step, 9, 100], "cpu")
        mixed.append(sample(logits, b)[2].item())
    assert alone == mixed


def test_top_k_candidate_path_equals_full_path():
    """All-top-k batches sample on candidates only; a top-k=0 row forces the full path. Same draws."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(40, 1000, generator=gen) * 2
    params = [SamplingParams(top_k=30, top_p=0.9 if i % 2 else 1.0, min_p=0.02 * (i % 3)) for i in range(40)]
    seeds, steps = list(range(40)), [i * 7 for i in range(40)]
    fast = sample(logits, make_sampling_batch(params, seeds, steps, "cpu"))
    full_logits = torch.cat([logits, torch.randn(1, 1000, generator=gen)])
    full = sample(full_logits, make_sampling_batch(params + [SamplingParams()], seeds + [0], steps + [0], "cpu"))
    assert torch.equal(fast, full[:40])


def test_different_seeds_differ():
    logits = torch.zeros(1, 1000)
    runs = []
    for seed in (0, 1, 2**40 + 5, -3):
        runs.append([sample(logits, make_sampling_batch([SamplingParams()], [seed], [s], "cpu")).item() for s in range(30)])
    for i in range(len(runs)):
        for j in range(i + 1, len(runs)):
            assert runs[i] != runs[j]
    # Consecutive steps of one seed are not stuck on one token.
    assert len(set(runs[0])) > 20


def test_uniform_noise_statistics():
    seeds = torch.tensor([0, 1, 2**32 - 1])
    steps = torch.tensor([0, 0, 5])
    u = uniform_noise(seeds, steps, torch.arange(200000))
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005
    assert abs(u.var().item() - 1 / 12) < 0.002
    # Rows (different seeds) and adjacent steps are uncorrelated.
    c = torch.corrcoef(u)
    assert (c - torch.eye(3)).abs().max() < 0.01
    nxt = uniform_noise(seeds, steps + 1, torch.arange(200000))
    assert abs(torch.corrcoef(torch.stack([u[0], nxt[0]]))[0, 1].item()) < 0.01
    # Histogram of 16 bins is flat.
    hist = torch.histc(u[0], bins=16, min=0.0, max=1.0)
    expected = 200000 / 16
    chi2 = ((hist - expected) ** 2 / expected).sum().item()
    assert chi2 < chi_square_critical(15)


@settings(max_examples=40, deadline=None)
@given(
    logits=st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=2, max_size=24, unique=True),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.0]),
    top_k=st.integers(0, 30),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1]),
    min_p=st.sampled_from([0.0, 0.05, 0.5]),
    seed=st.integers(-(2**63), 2**63 - 1),
    step=st.integers(0, 10**6),
)
def test_draw_is_in_the_reference_support(logits, temperature, top_k, top_p, min_p, seed, step):
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    expected = reference_probs([float(torch.tensor(x, dtype=torch.float32)) for x in logits], p)
    batch = make_sampling_batch([p, SamplingParams(top_p=0.7)], [seed, 1], [step, 3], "cpu")
    out = sample(torch.tensor([logits, logits[::-1]], dtype=torch.float32), batch)
    assert expected[out[0].item()] > 0


def test_ban_tokens_sets_minus_inf_in_place():
    logits = torch.zeros(3, 10)
    ban_tokens_(logits, [0, 2], [[1, 5], [9]])
    assert torch.isinf(logits[0, [1, 5]]).all() and torch.isinf(logits[2, 9])
    assert torch.isinf(logits).sum().item() == 3
    ban_tokens_(logits, [], [])
    ban_tokens_(logits, [1], [[]])
    assert torch.isinf(logits).sum().item() == 3
    # A banned EOS is never sampled, even greedy.
    logits = torch.zeros(2, 4)
    logits[:, 3] = 10.0
    ban_tokens_(logits, [0, 1], [[3], [3]])
    out = sample(logits, make_sampling_batch([SamplingParams(temperature=0.0), SamplingParams()], [0, 0], [0, 0], "cpu"))
    assert (out != 3).all()


def test_make_sampling_batch_errors_and_flags():
    with pytest.raises(ValueError, match="one entry per row"):
        make_sampling_batch([SamplingParams()], [1, 2], [0], "cpu")
    with pytest.raises(ValueError, match="steps"):
        make_sampling_batch([SamplingParams()], [1], [-1], "cpu")
    b = make_sampling_batch([SamplingParams(temperature=0.0, top_k=5)], [0], [0], "cpu")
    assert b.all_greedy and not b.any_top_k
    b = make_sampling_batch([SamplingParams(top_k=5), SamplingParams(min_p=0.1)], [0, 0], [0, 0], "cpu")
    assert b.any_top_k and b.any_min_p and not b.any_top_p and not b.all_top_k and b.max_top_k == 5


def test_logits_shape_is_checked():
    with pytest.raises(ValueError, match="logits"):
        sample(torch.zeros(3, 5), make_sampling_batch([SamplingParams()], [0], [0], "cpu"))


@pytest.mark.gpu
def test_cuda_matches_cpu():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 4000, generator=gen) * 2
    params = [REPRO_PARAMS[i % len(REPRO_PARAMS)] for i in range(64)]
    seeds, steps = list(range(64)), list(range(100, 164))
    cpu = sample(logits, make_sampling_batch(params, seeds, steps, "cpu"))
    gpu = sample(logits.cuda(), make_sampling_batch(params, seeds, steps, "cuda"))
    assert gpu.device.type == "cuda"
    assert torch.equal(cpu, gpu.cpu())


def test_noise_chunking_does_not_change_draws(monkeypatch):
    import batchinfer.engine.sampler as sampler_module

    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(10, 300, generator=gen)
    params = [SamplingParams(top_p=0.9), SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(min_p=0.1)] * 2
    params += [SamplingParams(top_k=3), SamplingParams(temperature=0.4)]
    batch = make_sampling_batch(params, range(10), range(10), "cpu")
    whole = sample(logits, batch)
    monkeypatch.setattr(sampler_module, "NOISE_CHUNK_ELEMENTS", 700)  # 2 rows per chunk
    assert torch.equal(sample(logits, batch), whole)
