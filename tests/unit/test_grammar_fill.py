"""engine.structured_output.bitmask: the grammar fill started before the forward, on its own thread,
masks exactly as a fill after it does: the same rows, a verification step's sub-batch of other rows,
a grammar that was not started, a fill left behind by a failed step; and the model runner starts it.

Real xgrammar matchers on a small raw vocabulary (no model needed): tokens 0-9 are the digits,
then letters, braces and an end token.
"""

from __future__ import annotations

import threading

import pytest
import torch

from engine.structured_output.bitmask import GrammarBitmask

VOCAB = [str(d) for d in range(10)] + ["a", "b", "c", "{", "}", "</s>"]
END = len(VOCAB) - 1


class Grammar:
    """RequestGrammar's face to the bitmask: a matcher and fill_bitmask."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.num_fills = 0

    def fill_bitmask(self, bitmask, row: int) -> None:
        self.num_fills += 1
        self.matcher.fill_next_token_bitmask(bitmask, row)


def make_grammar(regex: str) -> Grammar:
    import xgrammar

    info = xgrammar.TokenizerInfo(VOCAB, stop_token_ids=[END])
    compiled = xgrammar.GrammarCompiler(info, max_threads=1).compile_regex(regex)
    return Grammar(xgrammar.GrammarMatcher(compiled))


def allowed(logits: torch.Tensor, row: int) -> list[str]:
    return [VOCAB[t] for t in torch.isfinite(logits[row]).nonzero().squeeze(1).tolist()]


def kernels_or_none(use_kernels: bool):
    if not use_kernels:
        return None
    from engine.cpu.extension import load_cpu_kernels

    return load_cpu_kernels()


@pytest.mark.parametrize("use_kernels", [False, True], ids=["xgrammar_apply", "cpu_kernel"])
def test_a_fill_started_before_the_forward_masks_as_a_fill_after_it(use_kernels):
    digits, letters = make_grammar("[0-9]+"), make_grammar("[a-c]")
    bitmask = GrammarBitmask(kernels_or_none(use_kernels))
    logits = torch.randn(3, len(VOCAB))  # [num_rows, vocab_size]
    original = logits.clone()
    bitmask.start_fill([0, 2], [digits, letters], len(VOCAB))
    bitmask.apply(logits, [0, 2], [digits, letters])
    assert allowed(logits, 0) == [str(d) for d in range(10)]
    assert allowed(logits, 2) == ["a", "b", "c"]
    assert torch.equal(logits[1], original[1])  # a row without a grammar is untouched
    assert torch.equal(logits[0, :10], original[0, :10])  # allowed logits keep their values
    assert bitmask.times.is_overlapped and bitmask.times.is_fused == use_kernels
    assert digits.num_fills == letters.num_fills == 0  # filled by the batch call on the fill thread
    assert bitmask.times.start <= bitmask.times.end
    # The next step, after a digit: a digit or the end.
    digits.matcher.accept_token(3)
    logits = torch.randn(1, len(VOCAB))
    bitmask.start_fill([0], [digits], len(VOCAB))
    bitmask.apply(logits, [0], [digits])
    assert allowed(logits, 0) == [str(d) for d in range(10)] + ["</s>"]


def test_a_sub_batch_of_other_rows_gets_the_started_rows_copied():
    """A verification step samples its plain rows (the grammar rows among them) as a sub-batch."""
    digits, letters = make_grammar("[0-9]"), make_grammar("[a-c]")
    bitmask = GrammarBitmask()
    bitmask.start_fill([1, 3], [digits, letters], len(VOCAB))  # rows among all sampled requests
    logits = torch.randn(2, len(VOCAB))
    bitmask.apply(logits, [0, 1], [digits, letters])  # the same grammars, rows of the sub-batch
    assert allowed(logits, 0) == [str(d) for d in range(10)]
    assert allowed(logits, 1) == ["a", "b", "c"]
    assert bitmask.times.is_overlapped and digits.num_fills == letters.num_fills == 0


def test_a_grammar_that_was_not_started_is_filled_at_the_apply():
    digits, letters = make_grammar("[0-9]"), make_grammar("[a-c]")
    bitmask = GrammarBitmask()
    logits = torch.randn(2, len(VOCAB))
    bitmask.apply(logits, [0, 1], [digits, letters])  # no start (a baseline runner): both filled here
    assert allowed(logits, 0) == [str(d) for d in range(10)] and allowed(logits, 1) == ["a", "b", "c"]
    assert not bitmask.times.is_overlapped and digits.num_fills == letters.num_fills == 1
    bitmask.start_fill([0], [digits], len(VOCAB))
    logits = torch.randn(2, len(VOCAB))
    bitmask.apply(logits, [0, 1], [digits, letters])  # one started, one not
    assert allowed(logits, 0) == [str(d) for d in range(10)] and allowed(logits, 1) == ["a", "b", "c"]
    assert digits.num_fills == 1 and letters.num_fills == 2


def test_a_fill_left_behind_by_a_failed_step_is_dropped_at_the_next_start():
    digits, letters = make_grammar("[0-9]"), make_grammar("[a-c]")
    bitmask = GrammarBitmask()
    bitmask.start_fill([0], [digits], len(VOCAB))  # the forward raised: no apply this step
    bitmask.start_fill([0], [letters], len(VOCAB))  # the next step's rows
    logits = torch.randn(1, len(VOCAB))
    bitmask.apply(logits, [0], [letters])
    assert allowed(logits, 0) == ["a", "b", "c"]


def test_the_fill_runs_on_its_own_named_thread_while_the_caller_goes_on():
    digits = make_grammar("[0-9]")
    bitmask = GrammarBitmask()
    seen = []
    fill = bitmask._fill

    def recording_fill(*args):
        seen.append(threading.current_thread().name)
        fill(*args)

    bitmask._fill = recording_fill
    bitmask.start_fill([0], [digits], len(VOCAB))
    bitmask.apply(torch.randn(1, len(VOCAB)), [0], [digits])
    assert seen and seen[0].startswith("grammar-fill") and seen[0] != threading.current_thread().name
