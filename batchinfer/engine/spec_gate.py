"""Whether a step speculates: the measured output rate of steps with drafts against plain steps.

A sequence's draft length follows its acceptance (engine/drafts.py DraftLength), but acceptance
does not say what verifying costs. Where a step is bound by reading long KV caches, verifying k+1
tokens per sequence can cost about twice a plain step (H200, qwen3-0.6b, docs1000, 250 sequences of
~2k tokens: 27 ms against 14.9 ms, for 1.32 tokens per sequence: 0.86x the plain output rate), and
plain steps also run the overlapped loop (the host plans step N+1 while the device runs N), which
verify steps cannot. So speculation has to be measured against the alternative, on this engine,
device and workload.

SpecGate keeps, per bucket of running sequences (powers of two: the cost of both kinds of step
moves with the batch), an exponentially weighted output rate of each mode: tokens appended to
sequences per second of loop time (decayed sums of both, so long steps weigh what they cost). A
bucket runs the mode with the higher rate; every `probe_interval` of its steps it runs the other
mode for `probe_steps` steps so that a change (acceptance rising or falling, contexts growing) is
seen; a mode not yet measured in a bucket is tried first. The first step after a switch is not
measured: it carries the switch (the plain loop's first step reads nothing yet, the first step
with drafts reads the overlapped step still in flight).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MODES = ("plain", "speculate")


@dataclass(frozen=True)
class GateConfig:
    """probe_interval: steps of a bucket between probes of the mode it does not run; probe_steps:
    steps a probe runs; decay: weight of the past in the rates, per measured step."""

    probe_interval: int = 32
    probe_steps: int = 4
    decay: float = 0.9

    def __post_init__(self) -> None:
        if self.probe_interval < 1 or self.probe_steps < 2:
            raise ValueError("probe_interval must be at least 1 and probe_steps at least 2 (the first is not measured)")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), not {self.decay}")


@dataclass
class _Bucket:
    tokens: dict[str, float] = field(default_factory=lambda: dict.fromkeys(MODES, 0.0))
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(MODES, 0.0))
    steps: int = 0  # steps chosen in this bucket
    probe_left: int = 0  # steps left of a running probe

    def rate(self, mode: str) -> float | None:
        s = self.seconds[mode]
        return self.tokens[mode] / s if s > 0 else None

    def best(self) -> str:
        plain, spec = self.rate("plain"), self.rate("speculate")
        if spec is None:
            return "speculate"
        if plain is None:
            return "plain"
        return "speculate" if spec >= plain else "plain"


def bucket_of(rows: int) -> int:
    """Bucket of a step with `rows` running sequences: 0 for none or one, then one per power of two."""
    return max(0, int(rows).bit_length() - 1)


class SpecGate:
    """Chooses, step by step, whether the engine speculates (module docstring)."""

    def __init__(self, config: GateConfig | None = None) -> None:
        self.config = config or GateConfig()
        self._buckets: dict[int, _Bucket] = {}
        self._last: str | None = None  # the mode of the step before
        self.steps = dict.fromkeys(MODES, 0)  # steps run in each mode (benchmarks report them)

    def choose(self, rows: int) -> bool:
        """Whether the next step, with `rows` running sequences, speculates."""
        b = self._buckets.setdefault(bucket_of(rows), _Bucket())
        b.steps += 1
        mode = b.best()
        if b.probe_left > 0:
            b.probe_left -= 1
            mode = "plain" if mode == "speculate" else "speculate"
        elif b.steps % self.config.probe_interval == 0 and b.rate("plain") is not None and b.rate("speculate") is not None:
            b.probe_left = self.config.probe_steps - 1
            mode = "plain" if mode == "speculate" else "speculate"
        self.steps[mode] += 1
        return mode == "speculate"

    def record(self, rows: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A step chosen by choose(rows) ran: it appended `tokens` tokens in `seconds` of loop time."""
        mode = "speculate" if speculated else "plain"
        switched = self._last is not None and self._last != mode
        self._last = mode
        if switched or seconds <= 0:
            return
        b = self._buckets.setdefault(bucket_of(rows), _Bucket())
        d = self.config.decay
        b.tokens[mode] = d * b.tokens[mode] + tokens
        b.seconds[mode] = d * b.seconds[mode] + seconds

    def passed(self) -> None:
        """A plain step ran that the gate was not asked about (no room for drafts: engine.py): not
        measured, but a step with drafts after it follows a switch."""
        self._last = "plain"

    def rates(self) -> dict[int, dict[str, float | None]]:
        """Measured tokens per second by bucket (its smallest row count) and mode."""
        return {1 << k: {m: b.rate(m) for m in MODES} for k, b in sorted(self._buckets.items())}
