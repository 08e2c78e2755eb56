"""Test helper: a real engine that dies after a given number of results (a crash mid-run)."""

from __future__ import annotations


class FailingEngine:
    """Wraps an engine; raises after `after` results."""

    def __init__(self, engine, after: int):
        self.engine, self.after = engine, after
        self.tokenizer, self.model_info, self.max_model_len = engine.tokenizer, engine.model_info, engine.max_model_len

    def generate(self, requests):
        for n, r in enumerate(self.engine.generate(requests)):
            if n == self.after:
                raise RuntimeError("device lost")
            yield r
