"""Checks a request's schema, regex or grammar with xgrammar before the request is sent.

xgrammar imports torch, and the frontend never does, so the check runs in a child
process (`engine.structured_output.checker`, started by command line, not imported)
that builds the grammar and, given the model's tokenizer folder, compiles it as a core
would (milliseconds for the usual schemas). One check at a time goes through the
pipe; a check that takes longer than `timeout_s` kills the child (the next check
starts a fresh one) and refuses the request, so a pathological grammar (one whose
compile would take a core's compile thread for a minute) costs its own request the
timeout and the checks queued behind it that long, and the cores nothing.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import sys
from collections import OrderedDict

import msgpack

from frontend.errors import FrontendError, InvalidRequestError
from ipc.structured_outputs import StructuredOutputsParams, choice_grammar

logger = logging.getLogger(__name__)

CHECKER_COMMAND = (sys.executable, "-m", "engine.structured_output.checker")
HEADER = struct.Struct(">I")
DEFAULT_TIMEOUT_S = 5.0  # usual schemas compile in milliseconds; checks queue behind a slow one this long
START_TIMEOUT_S = 120.0  # importing torch and xgrammar on a cold, busy machine
MAX_REMEMBERED = 256


class GrammarChecker:
    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, command: tuple[str, ...] = CHECKER_COMMAND,
                 tokenizer_folder: str | None = None) -> None:
        self.timeout_s = timeout_s
        self.command = (*command, "--tokenizer", tokenizer_folder) if tokenizer_folder else command
        self._process: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._accepted: OrderedDict[tuple, None] = OrderedDict()  # recent grammars that passed: no second trip

    async def check(self, params: StructuredOutputsParams) -> None:
        """Raise InvalidRequestError with xgrammar's reason if it cannot use `params`."""
        try:
            params.validate()
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        kind, text = params.kind, None
        if kind == "json_object":
            return  # xgrammar's built-in JSON grammar
        text = choice_grammar(params.choice) if kind == "choice" else getattr(params, kind)
        kind = "grammar" if kind == "choice" else kind
        key = (kind, text, params.any_whitespace)
        if key in self._accepted:
            self._accepted.move_to_end(key)
            return
        async with self._lock:
            error = await self._ask(*key)
        if error is not None:
            raise InvalidRequestError(f"structured output ({params.kind}) is not usable: {error}")
        self._accepted[key] = None
        if len(self._accepted) > MAX_REMEMBERED:
            self._accepted.popitem(last=False)

    async def _ask(self, kind: str, text: str, any_whitespace: bool) -> str | None:
        process = await self._ensure_started()
        data = msgpack.packb([kind, text, any_whitespace])
        try:
            process.stdin.write(HEADER.pack(len(data)) + data)
            reply = await asyncio.wait_for(_read_frame(process), self.timeout_s)
        except (asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError) as e:
            await self.close()
            if isinstance(e, asyncio.TimeoutError):
                return f"checking it took longer than {self.timeout_s:g} s"
            return "the grammar checker failed on it"
        return reply[0]

    async def _ensure_started(self) -> asyncio.subprocess.Process:
        if self._process is None or self._process.returncode is not None:
            logger.info("starting the grammar checker: %s", " ".join(self.command))
            self._process = await asyncio.create_subprocess_exec(
                *self.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
            try:
                await asyncio.wait_for(_read_frame(self._process), START_TIMEOUT_S)  # ["ready"]
            except (asyncio.TimeoutError, asyncio.IncompleteReadError):
                await self.close()
                raise FrontendError("structured outputs are not available: the grammar checker did not start")
        return self._process

    async def close(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            process.kill()
            await process.wait()


async def _read_frame(process: asyncio.subprocess.Process) -> list:
    header = await process.stdout.readexactly(HEADER.size)
    (size,) = HEADER.unpack(header)
    return msgpack.unpackb(await process.stdout.readexactly(size))
