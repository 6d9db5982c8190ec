"""Checks a request's schema, regex or grammar with xgrammar before the request is sent.

xgrammar imports torch, and the frontend never does, so the check runs in a child
process (`engine.structured_output.checker`, started by command line, not imported)
that, given the model's tokenizer folder and the cores' vocabulary size and stop
tokens (`use_core_vocabulary`, from their EngineReady), compiles the grammar with the
core's own function and arguments (milliseconds for the usual schemas). A grammar is
checked once: the requests that bring it while its check runs wait for that verdict (32
requests with one new schema made 32 compiles of it, beside the core's forward: issue #58),
and one that passed is remembered. One check at a time goes through the pipe; a check that takes longer than `timeout_s` kills the child
(the next check starts a fresh one) and refuses the request, so a pathological grammar
(one whose compile would take a core's compile thread for a minute) costs its own
request the timeout and the checks queued behind it that long, and the cores nothing.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections import OrderedDict

from frontend.errors import FrontendError, InvalidRequestError
from ipc.pipe_frames import pack_frame, read_frame_async
from ipc.structured_outputs import StructuredOutputsParams, grammar_source

logger = logging.getLogger(__name__)

CHECKER_COMMAND = (sys.executable, "-m", "engine.structured_output.checker")
DEFAULT_TIMEOUT_S = 5.0  # usual schemas compile in milliseconds; checks queue behind a slow one this long
START_TIMEOUT_S = 120.0  # importing torch and xgrammar on a cold, busy machine
MAX_REMEMBERED = 256


class GrammarChecker:
    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, command: tuple[str, ...] = CHECKER_COMMAND,
                 tokenizer_folder: str | None = None, vocab_size: int | None = None,
                 stop_token_ids: list[int] | None = None) -> None:
        self.timeout_s = timeout_s
        self.base_command = command
        self.tokenizer_folder = tokenizer_folder
        self.command = self._command(vocab_size, stop_token_ids)
        self._process: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._accepted: OrderedDict[tuple, None] = OrderedDict()  # recent grammars that passed: no second trip
        self._in_flight: dict[tuple, asyncio.Future] = {}  # grammars being checked: one trip for all who ask

    async def use_core_vocabulary(self, vocab_size: int, stop_token_ids: list[int]) -> None:
        """Compile as the cores do, against the vocabulary size and stop tokens of their EngineReady."""
        command = self._command(vocab_size, stop_token_ids)
        if command != self.command:
            self.command = command
            self._accepted.clear()
            await self.close()  # the next check starts a child with these

    def _command(self, vocab_size: int | None, stop_token_ids: list[int] | None) -> tuple[str, ...]:
        if self.tokenizer_folder is None:
            return self.base_command
        command = (*self.base_command, "--tokenizer", self.tokenizer_folder)
        if vocab_size is not None:
            command += ("--vocab-size", str(vocab_size))
        if stop_token_ids is not None:
            command += ("--stop-token-ids", ",".join(map(str, stop_token_ids)))
        return command

    async def check(self, params: StructuredOutputsParams) -> None:
        """Raise InvalidRequestError with xgrammar's reason if it cannot use `params`."""
        try:
            params.validate()
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        key = (*grammar_source(params), params.any_whitespace)
        if key in self._accepted:
            self._accepted.move_to_end(key)
            return
        pending = self._in_flight.get(key)
        if pending is None:  # the first of its grammar: the others that arrive meanwhile wait for its verdict
            pending = self._in_flight[key] = asyncio.ensure_future(self._check_once(key))
            pending.add_done_callback(lambda _: self._in_flight.pop(key, None))
        error = await asyncio.shield(pending)  # one request's disconnect does not cancel the others' check
        if error is not None:
            raise InvalidRequestError(f"structured output ({params.kind}) is not usable: {error}")

    async def _check_once(self, key: tuple) -> str | None:
        async with self._lock:
            error = await self._ask(*key)
        if error is None:
            self._accepted[key] = None
            if len(self._accepted) > MAX_REMEMBERED:
                self._accepted.popitem(last=False)
        return error

    async def _ask(self, kind: str, text: str | None, any_whitespace: bool) -> str | None:
        process = await self._ensure_started()
        try:
            process.stdin.write(pack_frame([kind, text, any_whitespace]))
            reply = await asyncio.wait_for(read_frame_async(process.stdout), self.timeout_s)
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
                await asyncio.wait_for(read_frame_async(self._process.stdout), START_TIMEOUT_S)  # ["ready"]
            except (asyncio.TimeoutError, asyncio.IncompleteReadError):
                await self.close()
                raise FrontendError("structured outputs are not available: the grammar checker did not start")
        return self._process

    async def close(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            process.kill()
            await process.wait()

