"""What the engine reports about each step (the metrics, report and trace layers read these)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepStats:
    """One engine step. Times are seconds (perf_counter) / milliseconds as named."""

    step: int
    time: float  # perf_counter at the end of the step
    num_running: int
    num_waiting: int
    num_prefill_tokens: int
    num_decode_tokens: int  # one per decoding sequence
    kv_blocks_used: int
    kv_blocks_free: int
    num_preemptions: int  # preemptions during this step
    schedule_ms: float  # host work NOT hidden behind device work (on a GPU: the device's idle gaps)
    step_ms: float  # wall time of the whole step
    num_finished: int = 0
    host_ms: float = 0.0  # all host work of the step (step_ms - wait_ms), hidden or not
    wait_ms: float = 0.0  # host time blocked waiting on the device
    # host time by phase of the loop iteration, in order: schedule, prepare, launch (forward),
    # read_tokens (blocked on the device), grammar_accept, grammar_fill_start (planning the next
    # masks and starting their fill), post (detokenise, stops, finish), grammar_mask (waiting for /
    # filling the next masks), sample_launch
    phases_ms: dict[str, float] = field(default_factory=dict)
    num_draft_tokens: int = 0  # the drafts the decoding sequences verify (speculative decoding)
    # KV positions the step's attention covers (its sequences' tokens through their last new one;
    # a shared prefix counts once per sequence); 0: not known
    num_context_tokens: int = 0
    prefill_limited: bool = False  # the prefill policy (slack) held prefill back in this step
    # speculative decoding (engine/speculative.py; all 0 when off): draft tokens proposed, computed by
    # the step (after grammar cuts and the budget), and confirmed by the target; decoding sequences
    # that verified drafts, all decoding sequences of the step, and the tokens they emitted; of the
    # drafts, the grammar-forced tokens and the forced text's tokens proposed, verified and accepted
    # (the rest: n-gram / drafter; engine/drafts.py)
    spec_drafted: int = 0
    spec_verified: int = 0
    spec_accepted: int = 0
    spec_rows: int = 0
    spec_decode_rows: int = 0
    spec_emitted: int = 0
    spec_forced_drafted: int = 0
    spec_forced_verified: int = 0
    spec_forced_accepted: int = 0
    spec_text_drafted: int = 0
    spec_text_verified: int = 0
    spec_text_accepted: int = 0
