"""Step 4 of the logits pipeline: the grammar rows' tokens that their matchers reject get -inf.

One int32 bitmask ([num_rows, ceil(vocab_size / 32)], 1 = allowed) is kept and grown
as needed. The model runner starts the fill (`start_fill`) before the forward: a grammar
row is never speculated, so its matcher already holds every token before the one this
step samples, and the fill needs nothing from the forward. It runs on one thread of its
own as one xgrammar call for all rows (`BatchGrammarMatcher` with one thread, which drops
the GIL: the forward runs meanwhile), so it hides behind the forward. `apply` waits for
it, then our CPU kernel (engine/cpu/csrc/apply_token_bitmask.cpp) masks the logits, whole
words of allowed tokens skipped where xgrammar's CPU apply visits every token. Without
the kernels, and off the CPU, xgrammar's own apply (its triton or CUDA kernel on a GPU)
does it. A sub-batch whose rows are not the started ones (a verification step's plain
rows) gets its filled rows copied to its own; a grammar that was not started is filled
then, on the caller's thread.

One fill thread and one xgrammar thread, not xgrammar's pool: on a 2-core host the
forward's two torch threads already hold both cores, and a pool's threads would stall
their barriers (the issue #30 effect; issue #58).
"""

from __future__ import annotations

import ctypes
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType

import torch

MIN_BITMASK_ROWS = 64


@dataclass
class FillTimes:
    """The last step's grammar work (time.perf_counter() seconds), for the step trace."""

    start: float = 0.0  # the fill thread began
    end: float = 0.0  # ... and ended
    waited_s: float = 0.0  # apply's wait for the fill thread
    apply_s: float = 0.0  # the copy of rows (if any) and the mask
    num_rows: int = 0
    is_fused: bool = False  # masked by our C++ kernel (else xgrammar's apply)
    is_overlapped: bool = False  # filled on the fill thread, started before the forward


class GrammarBitmask:
    def __init__(self, kernels: ModuleType | None = None) -> None:
        self._bitmask: torch.Tensor | None = None
        self._kernels = kernels  # engine/cpu/csrc's module, or None
        self._executor: ThreadPoolExecutor | None = None
        self._batch_matcher = None
        self._started: tuple[list[int], list, Future] | None = None  # (rows, grammars, the fill's future)
        self.times = FillTimes()
        # False: start_fill waits for its fill, so nothing runs beside the forward (for A/B probes:
        # scripts/bench/probes/grammar_forward.py)
        self.is_overlapping = True

    def start_fill(self, rows: list[int], grammars: list, vocab_size: int) -> None:
        """Fill bitmask row rows[i] from grammars[i] (RequestGrammar) on the fill thread; `apply` waits for it."""
        import xgrammar

        if self._started is not None:  # a step that failed before its apply left its fill behind
            self._started[2].exception()  # waits for it; its error, if any, was that step's
            self._started = None
        if not grammars:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-fill",
                                                initializer=name_native_thread, initargs=("grammar-fill",))
            self._batch_matcher = xgrammar.BatchGrammarMatcher(max_threads=1)
        bitmask = self._rows(max(rows) + 1, vocab_size)
        matchers = [g.matcher for g in grammars]
        self._started = (list(rows), list(grammars), self._executor.submit(self._fill, matchers, bitmask, list(rows)))
        if not self.is_overlapping:
            self._started[2].exception()  # done before the forward; its error, if any, raised in apply

    def _fill(self, matchers: list, bitmask: torch.Tensor, rows: list[int]) -> None:
        self.times.start = time.perf_counter()
        self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        self.times.end = time.perf_counter()

    def apply(self, logits: torch.Tensor, rows: list[int], grammars: list) -> None:
        """logits: [num_rows, vocab_size] fp32, in place; grammars[i] masks logits[rows[i]]."""
        import xgrammar

        start = time.perf_counter()
        filled = self._wait_for_fill()  # {id(grammar): its filled bitmask row}
        waited = time.perf_counter()
        num_rows, vocab_size = logits.shape
        is_overlapped = all(id(g) in filled for g in grammars)
        if is_overlapped and all(filled[id(g)] == row for row, g in zip(rows, grammars)):
            bitmask = self._bitmask  # the started rows are these rows: no copy
        else:
            if not is_overlapped:
                self.times.start = time.perf_counter()  # filled here, after the forward
            source = self._bitmask.clone() if filled else None  # [rows, ceil(vocab_size / 32)] int32
            bitmask = self._rows(num_rows, vocab_size)
            for row, grammar in zip(rows, grammars):
                if id(grammar) in filled:
                    bitmask[row] = source[filled[id(grammar)]]
                else:
                    grammar.fill_bitmask(bitmask, row)
            if not is_overlapped:
                self.times.end = time.perf_counter()
        is_fused = (self._kernels is not None and logits.device.type == "cpu" and logits.dtype == torch.float32
                    and logits.is_contiguous())
        if is_fused:
            self._kernels.apply_token_bitmask(logits, bitmask, torch.tensor(rows, dtype=torch.int64))
        else:
            xgrammar.apply_token_bitmask_inplace(logits, bitmask[:num_rows].to(logits.device, non_blocking=True),
                                                 indices=rows)
        self.times.waited_s, self.times.apply_s = waited - start, time.perf_counter() - waited
        self.times.num_rows, self.times.is_fused, self.times.is_overlapped = len(rows), is_fused, is_overlapped

    def _wait_for_fill(self) -> dict[int, int]:
        if self._started is None:
            return {}
        rows, grammars, future = self._started
        self._started = None
        future.result()  # what xgrammar raised, raised here: the step fails as a serial fill would
        return {id(g): row for row, g in zip(rows, grammars)}

    def _rows(self, num_rows: int, vocab_size: int) -> torch.Tensor:
        """The kept bitmask, grown to at least `num_rows` rows; [rows, ceil(vocab_size / 32)] int32."""
        import xgrammar

        num_words = (vocab_size + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < num_rows or self._bitmask.shape[1] != num_words:
            self._bitmask = xgrammar.allocate_token_bitmask(max(num_rows, MIN_BITMASK_ROWS), vocab_size)
        return self._bitmask


def name_native_thread(name: str) -> None:
    """The calling thread's name as `top -H` and /proc/PID/task/TID/comm show it (Linux; elsewhere nothing)."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
