"""How many prefill tokens one step takes, chosen by name (EngineConfig.prefill_policy).

The scheduler places a step's decodes first, then asks the policy for the step's prefill allowance
(`prefill_tokens(view)`, at most the token budget the decodes left) and hands it to running prefills
and then to admissions, oldest first.

budget  (default) all of it: prefill chunks fill the step up to max_num_batched_tokens.
slack   only what the decode step absorbs: the most prefill tokens for which the step cost model
        (engine/step_cost.py) says the step stays within (1 + slack_tolerance) of the same step's
        decodes alone AND at least HIDDEN_SHARE of the chunk's GEMM time is hidden (what the step
        grows by is at most half of what those tokens cost in any compute-bound step: tokens that
        cost the same here as elsewhere are only moved, not hidden, and moving them idles slots,
        e.g. on a small model whose decode step is long from its KV reads, where 5% of it would
        take hundreds of tokens at full price); with mixed-step CUDA graphs the step's tokens are rounded to a captured size,
        since a step pads to the next one anyway (padded rows cost GEMM time; filled with prefill
        they do work). It falls back to the whole budget, as `budget` does, when
          - nothing is decoding (there is no step to hide in);
          - a running sequence has been prefilling for more than slack_max_wait_steps steps since it
            was admitted (no starvation);
          - more than slack_max_idle_slots slots could decode but do not (free slots with sequences
            waiting, sequences still prefilling): the batch is not full;
          - the step absorbs fewer than MIN_SLACK_CHUNK tokens: there is no slack, and holding
            prefill back would only leave slots idle.

Why those fallbacks, for a batch job whose measure is documents per GPU-hour: every prompt token is
prefilled once under any schedule, so hiding prefill saves only the GEMM time of tokens that land
below the ridge point of a step that would have run anyway. A slot that is not decoding costs a
whole row of every step until it is filled: a decode step's weight read (and on small models its
launches) is paid for the rows present, so a full batch matters more than where prefill runs. A
policy that held prefill back while slots idle would trade a small GEMM saving for fewer decode
rows per weight read. `slack` therefore only defers prefill while the batch stays (nearly) full and
the step really has room; at 16-bit weights with max_num_seqs 256 decode rows are above the ridge,
the step has no room, and `slack` schedules what `budget` does.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Protocol

from batchinfer.engine.step_cost import StepCost

MIN_SLACK_CHUNK = 16  # fewer absorbable tokens than this: no slack, admit as `budget` does
HIDDEN_SHARE = 0.5  # a chunk counts as absorbed only if at least this share of its GEMM time is hidden
POLICIES = ("budget", "slack")


@dataclass(frozen=True)
class StepView:
    """What the scheduler knows about a step once its decodes are placed.

    budget: tokens the decodes left (the most any policy may give); decode_rows / decode_context:
    the step's decode tokens and their contexts in all; prefill_context: computed tokens of the
    first sequence that prefills (0: a new one); idle_slots: slots that could decode but do not
    (sequences still prefilling, free slots with sequences waiting); oldest_wait: steps since the
    longest-prefilling running sequence was admitted (0: none prefills).
    """

    budget: int
    decode_rows: int
    decode_context: int
    prefill_context: int
    idle_slots: int
    oldest_wait: int


class PrefillPolicy(Protocol):
    """The interface the scheduler calls: the step's prefill allowance, 0..view.budget."""

    name: str

    def prefill_tokens(self, view: StepView) -> int: ...


class BudgetPolicy:
    name = "budget"

    def prefill_tokens(self, view: StepView) -> int:
        return view.budget


class SlackPolicy:
    """Prefill sized to the decode step's slack (module docstring)."""

    name = "slack"

    def __init__(
        self, cost: StepCost, tolerance: float, max_wait_steps: int, max_idle_slots: int,
        graph_sizes: tuple[int, ...] | None = None,
    ) -> None:
        """graph_sizes: token counts of the mixed-step CUDA graphs (engine/cuda_graphs.py), sorted;
        None: prefill steps run eagerly at their own size."""
        self.cost = cost
        self.tolerance = tolerance
        self.max_wait_steps = max_wait_steps
        self.max_idle_slots = max_idle_slots
        self.graph_sizes = graph_sizes

    def prefill_tokens(self, view: StepView) -> int:
        if view.budget <= 0:
            return 0
        if view.decode_rows == 0 or view.oldest_wait > self.max_wait_steps or view.idle_slots > self.max_idle_slots:
            return view.budget
        n = self.absorbable(view.decode_rows, view.decode_context, view.prefill_context, view.budget)
        return n if n >= MIN_SLACK_CHUNK else view.budget

    def absorbable(self, decode_rows: int, decode_context: int, prefill_context: int, limit: int) -> int:
        """The most prefill tokens (<= limit) that keep the step within the tolerance of its decodes
        alone; with graph sizes, such that decode rows + prefill tokens is a captured size."""
        cost = self.cost
        alone = cost.seconds(decode_rows, decode_context)
        bound = (1.0 + self.tolerance) * alone
        per_token = cost.layer_flops_per_token / cost.layer_flops_per_s  # a prefill token's GEMMs anywhere

        def fits(p: int, padded: int | None = None) -> bool:
            t = cost.seconds(decode_rows, decode_context, p, prefill_context, padded)
            return t <= bound and t - alone <= (1.0 - HIDDEN_SHARE) * p * per_token

        if self.graph_sizes is not None:
            best = 0
            lo = bisect.bisect_right(self.graph_sizes, decode_rows)
            for size in self.graph_sizes[lo:]:  # cost grows with the size: stop at the first miss
                p = size - decode_rows
                if p > limit or not fits(p, size):
                    break
                best = p
            if best or decode_rows + limit > self.graph_sizes[-1]:
                return best
            # the limit ends between two sizes: the step pads up to the next one
            size = self.graph_sizes[bisect.bisect_left(self.graph_sizes, decode_rows + limit)]
            return limit if fits(limit, size) else 0
        lo, hi = 0, limit  # cost is monotone in p: the largest p that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo


def make_prefill_policy(
    name: str, cost: StepCost | None = None, *, tolerance: float = 0.05, max_wait_steps: int = 32,
    max_idle_slots: int = 1, graph_sizes: tuple[int, ...] | None = None,
) -> PrefillPolicy:
    """The policy called `name` (POLICIES); slack needs the step cost model."""
    if name == "budget":
        return BudgetPolicy()
    if name == "slack":
        if cost is None:
            raise ValueError("prefill_policy slack needs a step cost model")
        return SlackPolicy(cost, tolerance, max_wait_steps, max_idle_slots, graph_sizes)
    raise ValueError(f"prefill_policy must be one of {', '.join(POLICIES)}, not {name!r}")
