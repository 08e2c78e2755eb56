"""Speculative verify steps in two lanes: one lane's host work hides under the other's device work.

A verify step (engine/speculative.py) cannot be planned before the step before it is read: its
drafts follow the tokens that step accepts. Run serially (Speculator.step), all of the host's work
between two steps (accepting and appending the tokens, drafting, scheduling, packing) is device idle
time: 4-5 ms of a 17 ms step of 256 sequences on an H100 host (BENCHMARKS.md). Here the running
sequences are split into two lanes (Sequence.lane) that take turns: an iteration reads lane L's
step, then drafts, schedules (Scheduler.schedule(lane)) and launches L's next one, while the device
runs the other lane's step, launched an iteration earlier. Each step holds about half the sequences,
so the weights are read twice per round; what the host does per sequence is the same.

Outputs are those of the serial steps (a sequence's draws depend on its own tokens and counter, never
on which sequences share its step). Before a step that is not a verify step (no room for drafts: with
SpeculativeConfig.prefill_first, prefill filling the budget; or the gate choosing a plain step) the
engine drains both lanes; with SpeculativeConfig.lanes_drain off, lane steps carry such prefill
without drafts instead. Drafts first (the default), lane steps carry prefill beside their drafts.
"""

from __future__ import annotations

from typing import Any

from batchinfer.engine.request import Result
from batchinfer.engine.scheduler import ScheduledStep
from batchinfer.engine.speculative import Speculator, VerifyStep


class Lanes:
    """Two lanes of verify steps taking turns (see the module docstring)."""

    def __init__(self, speculator: Speculator) -> None:
        self.speculator = speculator
        self._flight: list[VerifyStep | None] = [None, None]
        self._next = 0  # the lane whose step is read and launched next (its step in flight is the older)

    @property
    def busy(self) -> bool:
        return self._flight[0] is not None or self._flight[1] is not None

    def step(self, engine: Any) -> list[Result]:
        """One iteration: read the next lane's step in flight (if any), then launch its next one."""
        t0 = engine._begin_iteration()
        lane, self._next = self._next, self._next ^ 1
        done, self._flight[lane] = self._flight[lane], None
        results = self.speculator.finish(engine, done) if done is not None else []
        if done is not None and self.speculator.config.lanes_drain and not self.speculator.has_room(engine):
            # the sequences it finished let waiting prompts fill the next step: no room for drafts,
            # so the engine's next iteration runs a plain step, after the other lane is read
            self._report(engine, done, t0, len(results))
            return results + self.drain(engine)
        self._even_out(engine, lane)
        launched = self.speculator.launch(engine, lane)
        if launched.step.seqs:
            self._flight[lane] = launched
        self._report(engine, done, t0, len(results))
        return results

    @staticmethod
    def _even_out(engine: Any, lane: int) -> None:
        """Before `lane` launches: if it holds more of the running sequences than the other lane, its
        newest move there, half the difference (none is in flight: this lane's step was just read, and
        the other lane's sequences stay where they are). Sequences finish unevenly, so without this a
        job's tail could leave one lane empty and the other's steps serial."""
        n, mine = len(engine.scheduler.running), engine.scheduler.running_in(lane)
        move = len(mine) - n // 2 - (n % 2 if lane == 0 else 0)
        for seq in mine[len(mine) - move:] if move > 0 else ():
            seq.lane = lane ^ 1

    def drain(self, engine: Any) -> list[Result]:
        """Read both lanes' steps in flight, the older first."""
        results: list[Result] = []
        for lane in (self._next, self._next ^ 1):
            done, self._flight[lane] = self._flight[lane], None
            if done is not None:
                t0 = engine._begin_iteration()
                finished = self.speculator.finish(engine, done)
                self._report(engine, done, t0, len(finished))
                results += finished
        return results

    def abandon(self) -> None:
        """Forget the steps in flight (the engine is aborting every sequence: their tokens are never read)."""
        self._flight = [None, None]

    @staticmethod
    def _report(engine: Any, done: VerifyStep | None, t0: float, num_finished: int) -> None:
        """StepStats of the iteration, for the step it read (an empty one on an iteration that read none)."""
        engine._spec_counts = done.counts if done is not None else None
        engine._report(done.step if done is not None else ScheduledStep(), t0, num_finished)
