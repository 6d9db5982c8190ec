"""Whether one-token matmuls prefetch their weights in software, chosen while decoding.

A one-token step streams every weight once. On some hosts the kernels' software prefetch is what
lets it keep up with memory; on others the hardware prefetcher already does, and the software
prefetches only compete with the kernel's own loads. Both were measured on the same CPU model on
different days (docs/cpu-kernels.md): the choice is the host's, not the CPU's, so no build
constant can make it. The GGUF block kernels (gguf_dot.h), the bf16 slabs (small_batch_linear.cpp)
and the int8 and int4 panels (quantized/vnni_io.h) each have a switch; a model's tuner sets those
its linears run on, alike.

So one one-token decode step in `explore_every` runs with the other choice, and its time is set
against the step before it, on the current choice. When the median of the last `window` such
ratios says the other choice is faster by more than `margin`, it becomes the current one. Each
`window` explored steps that change nothing double the interval, up to `max_explore_every`
(exploring a worse choice costs its margin on those steps); a change starts it over. The outputs
are the same bits either way (a prefetch moves no data the kernel computes with).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from statistics import median

logger = logging.getLogger(__name__)


class PrefetchTuner:
    """Plain bookkeeping: `begin_step` says which choice a one-token step runs with (and sets it
    through `set_prefetch`), `end_step` takes its seconds."""

    def __init__(self, set_prefetch: Callable[[bool], None], prefetch: bool = True, explore_every: int = 8,
                 max_explore_every: int = 64, window: int = 9, margin: float = 0.03) -> None:
        self.set_prefetch = set_prefetch
        self.prefetch = prefetch  # the current choice
        self.min_explore_every = self.explore_every = explore_every
        self.max_explore_every = max_explore_every
        self.window = window
        self.margin = margin
        self.num_steps = 0
        self.num_explored = 0
        self.ratios: deque[float] = deque(maxlen=window)  # explored step's time / the step's before
        self.last_seconds: float | None = None  # the last step on the current choice
        self._steps_to_explore = explore_every
        self._explored_since_change = 0
        self._exploring = False
        set_prefetch(prefetch)

    def begin_step(self) -> bool:
        """The choice this step runs with (set already)."""
        self.num_steps += 1
        self._steps_to_explore -= 1
        self._exploring = self._steps_to_explore <= 0 and self.last_seconds is not None
        if self._exploring:
            self._steps_to_explore = self.explore_every
        choice = self.prefetch != self._exploring
        self.set_prefetch(choice)
        return choice

    def end_step(self, seconds: float) -> None:
        if not self._exploring:
            self.last_seconds = seconds
            return
        self.set_prefetch(self.prefetch)
        self.num_explored += 1
        self._explored_since_change += 1
        self.ratios.append(seconds / self.last_seconds)
        if len(self.ratios) == self.window and median(self.ratios) < 1.0 - self.margin:
            logger.info("one-token matmuls: software prefetch %s (steps without the current choice took %.2f "
                        "of its time, median of %d)", "on" if not self.prefetch else "off", median(self.ratios),
                        self.window)
            self.prefetch = not self.prefetch
            self.set_prefetch(self.prefetch)
            self.ratios.clear()
            self.last_seconds = None
            self.explore_every = self._steps_to_explore = self.min_explore_every
            self._explored_since_change = 0
        elif self._explored_since_change % self.window == 0:
            self.explore_every = self._steps_to_explore = min(2 * self.explore_every, self.max_explore_every)


def prefetch_tuner_for(model) -> PrefetchTuner | None:
    """A tuner of the switches of the kernels the model's linears run on (the GGUF blocks', the
    bf16 slabs', the int8 and int4 panels'), all set alike; None where it has none of them."""
    from engine.cpu.gguf_linear import GgufLinear
    from engine.cpu.int8_linear import QuantizedLinear
    from engine.cpu.packing import PackedLinear

    setters = []
    if any(isinstance(module, GgufLinear) for module in model.modules()):
        from engine.cpu.gguf_extension import load_gguf_kernels

        setters.append(load_gguf_kernels().set_one_token_prefetch)
    if any(isinstance(module, QuantizedLinear) for module in model.modules()):
        from engine.cpu.quantized_extension import load_quantized_kernels

        setters.append(load_quantized_kernels().set_one_token_prefetch)
    slabs = [m.slab_plan for m in model.modules() if isinstance(m, PackedLinear) and m.slabs is not None]
    if slabs:
        setters.append(slabs[0].kernels.set_one_token_prefetch)
    if not setters:
        return None

    def set_prefetch(on: bool) -> None:
        for setter in setters:
            setter(on)

    return PrefetchTuner(set_prefetch)
