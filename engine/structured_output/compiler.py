"""Grammar compiles on worker threads, so the engine's busy loop never waits for one.

xgrammar's `GrammarCompiler` keeps a cache, so the n choices of a request, and
every later request with the same schema, compile once. Its tokenizer info is
built on the first compile, on a worker too: loading the tokenizer takes seconds.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ipc.structured_outputs import StructuredOutputsParams, choice_grammar

logger = logging.getLogger(__name__)

NUM_COMPILE_THREADS = 1  # two cores: one for the loop, one for compiles
MAX_WHITESPACE = 16  # JSON whitespace in a row, so a small model cannot spin on spaces forever


class GrammarCompilerPool:
    def __init__(self, model_folder: str | Path, vocab_size: int, stop_token_ids: list[int],
                 num_threads: int = NUM_COMPILE_THREADS) -> None:
        self.model_folder = str(model_folder)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="grammar")
        self._compiler = None
        self._lock = threading.Lock()

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of the xgrammar CompiledGrammar (or of the exception xgrammar raised)."""
        return self._pool.submit(self._compile, params)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, params: StructuredOutputsParams):
        compiler = self._get_compiler()
        kind = params.kind
        if kind == "json":
            return compiler.compile_json_schema(params.json, any_whitespace=params.any_whitespace,
                                                max_whitespace_cnt=MAX_WHITESPACE if params.any_whitespace else None)
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(params.choice))
        if kind == "grammar":
            return compiler.compile_grammar(params.grammar)
        return compiler.compile_builtin_json_grammar()

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.model_folder)
                info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=self.stop_token_ids)
                self._compiler = xgrammar.GrammarCompiler(info)
                logger.info("grammar compiler ready (vocabulary of %d, stop tokens %s)", self.vocab_size,
                            self.stop_token_ids)
            return self._compiler
