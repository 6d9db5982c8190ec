"""Adapters read beside the busy loop, as grammars compile beside it (engine/structured_output).

A request naming an adapter that is not in the CPU cache has its folder checked at once (header
and config, a few milliseconds: a bad one fails `add_request` with ValueError, as before), and its
tensors read on one reader thread (safetensors to `dtype`, B transposed: docs/lora.md has its
cost). The request waits in the scheduler, passed over in its place, while `AdapterRead.is_ready`
is False; a read that fails ends it with the reason (`check`). The
loop keeps only the copy into a pool slot (engine/lora/adapter_pool.py), so the other streams'
steps go on while the file is read:

    loop:    add_request ── check ─┐ step step step ... step(activate: copy into a slot) ...
    reader:                        └─ read + transpose ──┘ (done)

`before_read` is a hook for tests: called on the reader thread before each read (to make one slow).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.lora.adapter_files import LoRAWeights, read_adapter
from ipc.lora_adapter import AdapterSpec, ModelShape

logger = logging.getLogger(__name__)


class AdapterRead:
    """One adapter's read on the reader thread, as a waiting request's scheduler sees it."""

    def __init__(self, path: str, future: Future) -> None:
        self.path = path
        self.future = future

    @property
    def is_ready(self) -> bool:
        """Read, without error: the request may be scheduled."""
        return self.future.done() and self.future.exception() is None

    @property
    def has_failed(self) -> bool:
        return self.future.done() and self.future.exception() is not None

    def check(self) -> str | None:
        """The error that fails the waiting request (the file was bad), or None."""
        if not self.has_failed:
            return None
        error = self.future.exception()
        return str(error) if isinstance(error, ValueError) else f"the adapter at {self.path} could not be read: {error!r}"

    def weights(self) -> LoRAWeights:
        """The tensors, waiting for the read if it is not done (ValueError when it failed)."""
        error = self.check() if self.future.done() else None
        if error is not None:
            raise ValueError(error)
        try:
            return self.future.result()
        except ValueError:
            raise
        except Exception as e:  # anything else a read raises is still this adapter's fault, not the step's
            raise ValueError(f"the adapter at {self.path} could not be read: {e!r}") from None


class AdapterReader:
    def __init__(self, shape: ModelShape, dtype: torch.dtype) -> None:
        self.shape = shape
        self.dtype = dtype
        self.before_read: Callable[[AdapterSpec], None] | None = None
        self._executor: ThreadPoolExecutor | None = None  # started at the first read: most servers have none

    def submit(self, spec: AdapterSpec) -> AdapterRead:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-read")
        return AdapterRead(spec.path, self._executor.submit(self._read, spec))

    def _read(self, spec: AdapterSpec) -> LoRAWeights:
        if self.before_read is not None:
            self.before_read(spec)
        weights = read_adapter(spec, self.shape, self.dtype)
        logger.info("LoRA: read the adapter at %s (%.1f MiB)", spec.path, weights.num_bytes / 2**20)
        return weights

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
