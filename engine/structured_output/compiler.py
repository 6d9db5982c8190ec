"""Grammar compiles on worker threads, so the engine's busy loop never waits for one.

xgrammar's `GrammarCompiler` keeps a cache, so the n choices of a request, and
every later request with the same schema, compile once. The compiler itself (xgrammar's
import, the tokenizer info: seconds on 2 cores the first time) is built on the pool's
thread as soon as the pool exists, which the engine makes at its start: compiles queue
behind that build on the same thread, so a request that arrives before it is done waits
only for what is left of it, and one that arrives later for its own compile alone
(issue #58: the first constrained request had paid for the build). The tokenizer info is kept
on disk (`tokenizer_info.py`), so a later start reads it instead of loading the tokenizer.

`make_grammar_compiler` and `compile_grammar` are the whole xgrammar call: the
frontend's checker (`engine.structured_output.checker`) calls the same two with the
vocabulary size and stop tokens the core sends in its EngineReady, so a grammar it
accepts is one the core compiles.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from engine.structured_output.tokenizer_info import load_tokenizer_info
from ipc.structured_outputs import StructuredOutputsParams, grammar_source

logger = logging.getLogger(__name__)

NUM_COMPILE_THREADS = 1  # two cores: one for the loop, one for compiles
# xgrammar's own threads inside one compile (its default is 8): more than one competes with the
# forward's torch threads for the cores (issue #58), and on 2 cores a schema compiles no faster
# with 8 (the person schema: 56 ms with 1, 90 ms with 8). The checker compiles as the core does.
XGRAMMAR_COMPILE_THREADS = 1
MAX_WHITESPACE = 16  # JSON whitespace in a row, so a small model cannot spin on spaces forever


class GrammarCompilerPool:
    def __init__(self, model_folder: str | Path, vocab_size: int, stop_token_ids: list[int],
                 num_threads: int = NUM_COMPILE_THREADS, info_cache_dir: str | Path | None = None) -> None:
        self.model_folder = str(model_folder)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.info_cache_dir = info_cache_dir  # where the tokenizer info is kept (None: built each time)
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="grammar")
        self._compiler = None
        self._lock = threading.Lock()
        # First in the queue: the first compile finds the compiler built, or waits on the lock for the rest.
        self._compiler_future = self._pool.submit(self._build_compiler)

    @property
    def is_ready(self) -> bool:
        """The compiler is built (or failed to be: each compile then raises its error)."""
        return self._compiler_future.done()

    def wait_until_ready(self, timeout_s: float | None = None) -> bool:
        """True once the compiler is built; False if `timeout_s` passes first."""
        try:
            self._compiler_future.result(timeout_s)
        except TimeoutError:
            return False
        return True

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of the xgrammar CompiledGrammar (or of the exception xgrammar raised)."""
        return self._pool.submit(self._compile, params)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, params: StructuredOutputsParams):
        return compile_grammar(self._get_compiler(), *grammar_source(params), params.any_whitespace)

    def _build_compiler(self) -> None:
        try:
            self._get_compiler()
        except Exception:  # each compile tries again and fails its request with the reason
            logger.exception("the grammar compiler could not be built")

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                self._compiler = make_grammar_compiler(self.model_folder, self.vocab_size, self.stop_token_ids,
                                                       info_cache_dir=self.info_cache_dir)
                logger.info("grammar compiler ready (vocabulary of %d, stop tokens %s)", self.vocab_size,
                            self.stop_token_ids)
            return self._compiler


def make_grammar_compiler(model_folder: str | Path, vocab_size: int | None, stop_token_ids: list[int] | None,
                          cache_enabled: bool = True, info_cache_dir: str | Path | None = None):
    """An xgrammar GrammarCompiler over the folder's tokenizer, sized to the model's vocabulary
    (the logits' width, which may pad the tokenizer's) and ending on its stop tokens."""
    import xgrammar

    info = load_tokenizer_info(model_folder, vocab_size, stop_token_ids, info_cache_dir)
    return xgrammar.GrammarCompiler(info, max_threads=XGRAMMAR_COMPILE_THREADS, cache_enabled=cache_enabled)


def compile_grammar(compiler, kind: str, text: str | None, any_whitespace: bool):
    """The CompiledGrammar of `ipc.structured_outputs.grammar_source(params)`; raises what xgrammar raises."""
    if kind == "json":
        return compiler.compile_json_schema(text, **json_options(any_whitespace))
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind in ("choice", "grammar"):
        return compiler.compile_grammar(text)
    if kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    raise ValueError(f"unknown grammar kind {kind!r}")


def build_grammar(kind: str, text: str | None, any_whitespace: bool):
    """The grammar of `compile_grammar` with the same options, not compiled against a
    vocabulary (milliseconds): the checker when it has no tokenizer."""
    import xgrammar

    if kind == "json":
        return xgrammar.Grammar.from_json_schema(text, **json_options(any_whitespace))
    if kind == "regex":
        return xgrammar.Grammar.from_regex(text)
    if kind in ("choice", "grammar"):
        return xgrammar.Grammar.from_ebnf(text)
    if kind == "json_object":
        return xgrammar.Grammar.builtin_json_grammar()
    raise ValueError(f"unknown grammar kind {kind!r}")


def json_options(any_whitespace: bool) -> dict:
    return {"any_whitespace": any_whitespace, "max_whitespace_cnt": MAX_WHITESPACE if any_whitespace else None}
