"""The slow checks of stage 1, on threads while the model loads: the id scan, the tokenizer, the grammar.

`plan_inputs` does the cheap checks itself (files, columns, the schema's text, the output folder) and
starts a Preflight; the driver lets the executor load its engine meanwhile (the local executor does,
in the main thread) and then calls `Preflight.check()`, which raises the user's error (a duplicate
id, a schema the backend cannot compile) before any row is read for the engine. The engine takes
the tokenizer and the compiled grammar from here instead of loading and compiling them again.

Every part also works without a thread pool (pool=None: each runs at once, in this thread).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from batchinfer.io.ids import IdCheck, check_ids
from batchinfer.io.readers import InputFile
from batchinfer.job.phases import PhaseTimer
from batchinfer.job.spec import JobSpec


def _now(fn: Callable[[], Any]) -> Future:
    """fn's outcome as a finished Future (its exception stored, as a pool would)."""
    fut: Future = Future()
    try:
        fut.set_result(fn())
    except BaseException as e:  # raised again by .result(), where the caller waits
        fut.set_exception(e)
    return fut


class Preflight:
    """Futures of the id check (IdCheck), the tokenizer, and the grammar compiler (None without a constraint).

    The grammar compiler is made as the engine would make it (the model's vocabulary size and EOS ids,
    the job's backend and grammar_threads) and has compiled the job's constraint, so the engine's
    first request finds it in the compiler's memo.
    """

    def __init__(
        self,
        spec: JobSpec,
        files: list[InputFile],
        model_dir: Path,
        pool: ThreadPoolExecutor | None = None,
        phases: PhaseTimer | None = None,
        ids: IdCheck | None = None,
    ) -> None:
        """ids: the id check when it is done already (a resumed output needs it before anything else)."""
        self.spec, self.files, self.model_dir, self.phases = spec, files, model_dir, phases

        def submit(name: str, fn: Callable[[], Any]) -> Future:
            timed = self._timed(name, fn)
            return pool.submit(timed) if pool is not None else _now(timed)

        scan = lambda: check_ids(files, spec.input.id_column, spec.input.duplicates)  # noqa: E731
        self.ids: Future = _now(lambda: ids) if ids is not None else submit("input_scan", scan)
        self.tokenizer: Future = submit("tokenizer", self._load_tokenizer)
        self.grammar: Future = submit("grammar_compile", self._compile) if spec.structured is not None else _now(lambda: None)

    def _timed(self, name: str, fn: Callable[[], Any]) -> Callable[[], Any]:
        if self.phases is None:
            return fn

        def run() -> Any:
            with self.phases.span(name):  # type: ignore[union-attr]
                return fn()

        return run

    def _load_tokenizer(self) -> Any:
        from batchinfer.models.loader import load_tokenizer

        return load_tokenizer(self.model_dir)

    def _compile(self) -> Any:
        """The engine's GrammarCompiler with the job's constraint compiled (GrammarError: no backend can)."""
        from batchinfer.models.loader import load_model_info
        from batchinfer.structured.compiler import GrammarCompiler

        info = load_model_info(str(self.model_dir), self.spec.model.dtype)
        tokenizer = self.tokenizer.result()  # the tokenizer task is ahead of this one in the pool
        compiler = GrammarCompiler(
            tokenizer, info.vocab_size, self.spec.grammar_backend, eos_ids=info.eos_token_ids,
            fill_threads=self.spec.engine.grammar_threads,
        )
        compiler.compile(self.spec.structured.constraint())  # type: ignore[union-attr]
        return compiler

    def check(self) -> IdCheck:
        """Wait for every part; raise the first problem (ids, then tokenizer, then grammar). Returns the IdCheck."""
        ids = self.ids.result()
        self.tokenizer.result()
        self.grammar.result()
        return ids

    def done(self) -> bool:
        return all(f.done() for f in (self.ids, self.tokenizer, self.grammar))
