"""Per-layer K and V scales of an FP8 KV cache, calibrated at engine start (engine.kv_cache_scale: auto).

An e4m3 cache stores value / scale: values past 448 x scale saturate, values under 2^-6 x scale lose
mantissa bits (e4m3's subnormals), and in between every value keeps 3 mantissa bits. One scale of 1.0
for every layer (the fixed default) wastes most of that range on models whose K and V stay far below
448, and saturates those with larger ones. Calibration runs the model once over a short fixed text in
a cache of the model's dtype, takes every layer's largest |K| and |V| there (K after its norm and
rotary: what the cache stores) and sets

    scale = amax x KV_SCALE_MARGIN / 448

so the calibration's largest value lands at 448 / KV_SCALE_MARGIN: a prompt whose K or V is up to
KV_SCALE_MARGIN times the calibration's still does not saturate, and the precision of everything
above amax x KV_SCALE_MARGIN / 28672 (e4m3's normal range is 2^14.8 wide) is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from batchinfer.kernels.reference import FP8_MAX

KV_SCALE_MARGIN = 2.0
MIN_KV_SCALE = 1e-6  # a layer whose K or V was all zeros in calibration (its values quantise to 0 either way)

# Plain English prose, a JSON record and a small table of numbers: the kinds of text a batch job feeds.
CALIBRATION_TEXTS = (
    "The committee met on a rainy Tuesday morning to review the quarterly report. Revenue had grown by "
    "eleven percent, mostly from the new subscription plans, while costs in the northern warehouses rose "
    "faster than expected. After a long discussion about shipping delays, the members agreed to hire two "
    "more drivers, to renegotiate the fuel contract before the summer, and to publish a short summary "
    "for every employee by the end of the month. Questions about the budget should go to the finance office.",
    '{"invoice_id": "INV-2041", "issued_by": "Harbor Tools Ltd.", "date": "2024-03-18", "currency": "EUR", '
    '"items": [{"description": "steel hinges, 40 mm", "quantity": 120, "unit_price": 0.85}, '
    '{"description": "wood screws, box of 500", "quantity": 6, "unit_price": 12.40}], "total": 176.40, '
    '"paid": false, "notes": "Payment due within 30 days. Late payments incur a 2% monthly fee."}',
    "| city | population | area (km2) |\n|---|---|---|\n| Lisbon | 545,000 | 100.1 |\n| Porto | 232,000 | 41.4 |\n"
    "| Braga | 193,000 | 183.4 |\nQ: Which city is the most densely populated? A: Lisbon, with about 5,400 "
    "people per square kilometre, followed by Porto at roughly 5,600; so Porto, in fact, by a small margin.",
)


def calibration_token_ids(tokenizer, vocab_size: int) -> list[list[int]]:
    """CALIBRATION_TEXTS tokenised (with the tokenizer's special tokens); without a tokenizer (None),
    a fixed pseudo-random sequence of ids of the same total length."""
    if tokenizer is not None:
        return [list(tokenizer.encode(text)) for text in CALIBRATION_TEXTS]
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (160,), generator=gen).tolist() for _ in CALIBRATION_TEXTS]


def scales_from_amax(amax: Sequence[tuple[float, float]], margin: float = KV_SCALE_MARGIN) -> list[tuple[float, float]]:
    """Per layer (k_amax, v_amax) -> (k_scale, v_scale) = amax x margin / 448 (at least MIN_KV_SCALE)."""
    return [tuple(max(a * margin / FP8_MAX, MIN_KV_SCALE) for a in pair) for pair in amax]  # type: ignore[misc]


class _Recorder:
    """An attention backend wrapper that keeps the largest |k| and |v| a layer sends to the cache."""

    def __init__(self, backend, sink: list[float]) -> None:
        self.backend, self.sink = backend, sink

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, kv_scales=None):
        self.sink[0] = max(self.sink[0], float(k.abs().amax()))
        self.sink[1] = max(self.sink[1], float(v.abs().amax()))
        return self.backend.forward(q, k, v, k_cache, v_cache, meta, scale, kv_scales)


@torch.inference_mode()
def measure_kv_amax(model, run: Callable[[], object]) -> list[tuple[float, float]]:
    """Per layer of `model` (a CausalLM) the largest |K| and |V| its attention writes while `run()`
    runs it (a forward over the calibration text, in a scratch cache of the model's dtype)."""
    attns = [layer.self_attn for layer in model.layers]
    sinks = [[0.0, 0.0] for _ in attns]
    backends = [a.backend for a in attns]
    try:
        for attn, sink in zip(attns, sinks):
            attn.backend = _Recorder(attn.backend, sink)
        run()
    finally:
        for attn, backend in zip(attns, backends):
            attn.backend = backend
    return [(k, v) for k, v in sinks]


def describe(scales: Sequence[tuple[float, float]]) -> str:
    """One line for the log and reports: the range of the K and of the V scales over the layers."""
    ks, vs = [s[0] for s in scales], [s[1] for s in scales]
    return (f"{len(scales)} layers, K scales {min(ks):.3g}-{max(ks):.3g}, V scales {min(vs):.3g}-{max(vs):.3g} "
            f"(amax x {KV_SCALE_MARGIN:g} / 448)")
