"""AsyncEngineClient: the frontend's handle on its engine cores.

    handler ──generate()──▶ AsyncEngineClient ──AddRequest──▶ least-loaded core
       ▲                                                          │ EngineOutputs
       │  output pump (frontend.engine_connection, one per core) ◀─┘
       └── per-request asyncio.Queue ◀── OutputProcessor (ipc.text: detokenize, stop strings)

`generate` tokenizes (off the event loop), validates and sends before it returns (so bad
input raises at once and the HTTP layer can answer 400), then hands back a
`RequestStream` of `RequestDelta`s.
Closing it, or cancelling a read from it, aborts whatever is still running. A core that
dies fails every request on it with `EngineDeadError` and marks the client unhealthy:
nothing waits on a dead core. A core that sends nothing for `engine_timeout_s` (an idle
one sends a heartbeat every second) counts as dead too: it is hung. With
`restart_engine`, a dead local core is replaced by a fresh one (`frontend.engine_restarter`)
and the client is healthy again once it is ready.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from msgspec.structs import replace

from frontend.engine_connection import DEFAULT_ENGINE_COMMAND, EngineConnection, OutputPumps
from frontend.engine_restarter import EngineRestarter
from frontend.errors import EngineDeadError, FrontendError, InvalidRequestError
from frontend.grammar_checker import GrammarChecker
from frontend.metrics import FrontendMetrics
from frontend.model_folder import resolve_model_folder
from frontend.prompt_tokenizer import PromptTokenizer
from frontend.ray_engines import RayEngineCores
from frontend.request_state import RequestState, RequestStream
from frontend.serving_lora import requested_adapter
from frontend.spec_decode_metrics import sum_spec_decode
from frontend.step_timeline import StepTimeline
from ipc.messages import (
    AbortRequests,
    AddRequest,
    FinishReason,
    ResetPrefixCache,
    SchedulerStats,
    WatchSteps,
)
from ipc.pooling_params import PoolingParams
from ipc.sampling_params import MAX_BAD_WORDS, PREDICTION_WITH_N, SamplingParams, check_request, tokenize_bad_words
from ipc.text.output_processor import OutputProcessor
from ipc.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

MAX_CHOICES = 1024  # prompts x n in one request: bounds what one HTTP body can put in the cores


@dataclass
class EngineClientConfig:
    model: str  # known name or local folder; the tokenizer comes from it
    served_model_name: str | None = None  # the name clients see; defaults to `model`
    num_local_engines: int = 1  # cores started as children (ignored when engine_addresses is set)
    engine_addresses: list[str] = field(default_factory=list)  # already-running cores to connect to
    engine_args: list[str] = field(default_factory=list)  # passed through to local cores
    engine_command: tuple[str, ...] = DEFAULT_ENGINE_COMMAND  # tests swap in a fake core
    ready_timeout_s: float = 600.0  # model loading on a cold cache takes minutes
    restart_engine: bool = False  # replace a local core that dies instead of staying down
    # A core silent this long is hung (an idle one sends a heartbeat every second); 0: never.
    engine_timeout_s: float = 60.0
    first_start_args: list[str] = field(default_factory=list)  # test hooks (fault injection): first start only
    max_request_prompt_tokens: int = 0  # all of a request's prompts together; 0: two contexts
    on_ray: bool = False  # the local cores as Ray actors, placed and restarted by Ray (frontend.ray_engines)
    media_options: object = None  # frontend.media.MediaOptions: images' bounds (None: the defaults)


class AsyncEngineClient:
    """Routes requests to engine cores and streams their text back."""

    def __init__(self, config: EngineClientConfig, tokenizer: Tokenizer, model_folder: str):
        self.config = config
        self.tokenizer = tokenizer
        self.prompt_tokenizer = PromptTokenizer(tokenizer, max_request_prompt_tokens=config.max_request_prompt_tokens)
        self.model_folder = model_folder
        self.model_name = config.served_model_name or config.model
        self.frontend_id = f"frontend-{os.getpid()}"
        self.ctx = zmq.asyncio.Context()
        self.engines: list[EngineConnection] = []
        self.metrics = FrontendMetrics(self.model_name)
        self.timeline = StepTimeline()  # the dashboard's occupancy strips, from the cores' step counts
        self.max_model_len = 0
        self.vocab_size = tokenizer.vocab_size
        self.hidden_size = 0  # an embedding's length, from the cores' EngineReady
        self.runner = "generate"  # "pooling": the cores serve embeddings only
        self.is_healthy = False
        self.dead_reason: str | None = "the engines are not ready yet"
        self._states: dict[str, RequestState] = {}
        self.output_processor = OutputProcessor(tokenizer)  # the text of every request in _states
        self.grammar_checker = GrammarChecker(tokenizer_folder=model_folder)
        self.pumps = OutputPumps(self._states, self.output_processor, self.metrics, self.timeline,
                                 config.engine_timeout_s, finish=self._finish, fail=self._fail,
                                 on_engine_dead=self._on_engine_dead)
        self.restarter = EngineRestarter(self.ctx, model_folder, self.frontend_id, config.engine_args,
                                         config.engine_command, config.ready_timeout_s)
        self._is_shutting_down = False
        self._num_routed = 0  # rotates ties between equally loaded cores
        self.ray_cores = (RayEngineCores(config.engine_command, model_folder, config.engine_args)
                          if config.on_ray else None)

    @classmethod
    async def start(cls, config: EngineClientConfig) -> AsyncEngineClient:
        """Load the tokenizer, start or connect the cores and wait until each is ready."""
        loop = asyncio.get_running_loop()
        model_folder = await loop.run_in_executor(None, resolve_model_folder, config.model)
        tokenizer = await loop.run_in_executor(None, Tokenizer, model_folder)
        client = cls(config, tokenizer, model_folder)
        try:
            await client._connect_engines()
        except BaseException:
            await client.shutdown()
            raise
        return client

    async def _connect_engines(self) -> None:
        config = self.config
        addresses = config.engine_addresses
        if self.ray_cores is not None:
            addresses = await self.ray_cores.start(config.num_local_engines)
        if addresses:
            self.engines = [EngineConnection(i, addr, self.ctx) for i, addr in enumerate(addresses)]
        else:
            for i in range(config.num_local_engines):
                self.engines.append(await EngineConnection.start_local(
                    i, self.ctx, self.model_folder, [*config.engine_args, *config.first_start_args],
                    config.engine_command))
        readies = await asyncio.gather(*(e.handshake(self.frontend_id, config.ready_timeout_s) for e in self.engines))
        self.max_model_len = min(r.max_model_len for r in readies)
        self.prompt_tokenizer.set_max_model_len(self.max_model_len)
        self.vocab_size = min([self.vocab_size, *(r.vocab_size for r in readies if r.vocab_size)])
        self.hidden_size = readies[0].hidden_size
        # The cores compile grammars against their own vocabulary size and stop tokens: so does the check.
        await self.grammar_checker.use_core_vocabulary(readies[0].vocab_size or None, list(readies[0].eos_token_ids))
        self.runner = "pooling" if any(r.runner == "pooling" for r in readies) else "generate"
        self.timeline.resize(len(self.engines))
        for engine in self.engines:
            self.pumps.start(engine)
        self.is_healthy, self.dead_reason = True, None

    # ------------------------------------------------------------ requests

    async def generate(self, prompt: str | None, params: SamplingParams, request_id: str, *,
                       prompt_token_ids: list[int] | None = None, n: int = 1,
                       prediction: str | None = None, images: list | None = None) -> RequestStream:
        """Send one prompt (text, or token ids) as n choices and return its delta stream."""
        prompts = [prompt if prompt_token_ids is None else prompt_token_ids]
        return await self.generate_batch(prompts, params, request_id, n=n, prediction=prediction, images=images)

    async def generate_batch(self, prompts: list[str | list[int]], params: SamplingParams, request_id: str, *,
                             n: int = 1, prediction: str | None = None, pooling_params: PoolingParams | None = None,
                             max_choices: int = MAX_CHOICES, images: list | None = None) -> RequestStream:
        """Send each prompt as n choices (seeds seed, seed+1, ...); choice j of prompt p has index p*n + j.
        `prediction`: OpenAI's predicted text, the draft of every prompt's answer (tokenized here).

        Every prompt is checked before any is sent, so InvalidRequestError or
        EngineDeadError raise here, before anything streams. With `pooling_params` each prompt
        is an embedding request (frontend.serving_embeddings).
        """
        self._check_healthy()
        if pooling_params is None and self.runner == "pooling":
            raise InvalidRequestError("this server runs --runner pooling: it serves embeddings only (/v1/embeddings)")
        num_choices = len(prompts) * (n if isinstance(n, int) else 1)
        if num_choices > max_choices:
            raise InvalidRequestError(f"a request may ask for at most {max_choices} choices (prompts x n), "
                                      f"this one asks for {num_choices}")
        params = await self._resolve_params(params, prediction, n)
        prompt_ids_list = await self._tokenize(prompts)  # under one budget for all of them
        self._check_healthy()  # the core may have died while we tokenized
        # Per prompt: a missing max_tokens becomes "up to the context length" for that prompt.
        try:
            params_list = [check_request(prompt_token_ids, params, n=n, vocab_size=self.vocab_size,
                                         max_model_len=self.max_model_len, is_pooling=pooling_params is not None)
                           for prompt_token_ids in prompt_ids_list]
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(str(e)) from None
        lora_request = requested_adapter.get()  # the adapter the route resolved from `model` (frontend.serving_lora)
        request_ids = [request_id] if num_choices == 1 else [f"{request_id}-{k}" for k in range(num_choices)]
        if any(rid in self._states for rid in request_ids):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        states = []
        for index, rid in enumerate(request_ids):
            prompt_token_ids, prompt_params, choice = prompt_ids_list[index // n], params_list[index // n], index % n
            choice_params = prompt_params
            if prompt_params.seed is not None and choice:
                choice_params = replace(prompt_params, seed=prompt_params.seed + choice)
            engine = self._pick_engine()
            state = RequestState(rid, index, queue, engine.index)
            self.output_processor.add_request(rid, prompt_token_ids, choice_params, index)
            self._states[rid] = state
            engine.request_ids.add(rid)
            engine.send(AddRequest(rid, prompt_token_ids, choice_params, time.time(), pooling_params, images or [],
                                   lora_request))
            self.metrics.num_prompt_tokens += len(prompt_token_ids)
            states.append(state)
        return RequestStream(states, queue, self._abort, prompt_ids_list)

    async def _resolve_params(self, params: SamplingParams, prediction: str | None = None,
                              n: int = 1) -> SamplingParams:
        """Bad words and the prediction as token ids; a structured output checked by xgrammar (a 400
        with its reason), so that nothing the engine could not compile ever reaches a core."""
        if prediction is not None:
            if n != 1:  # before tokenizing; check_request says it again for params built elsewhere
                raise InvalidRequestError(PREDICTION_WITH_N)
            token_ids = await self.prompt_tokenizer.encode_prediction(prediction)
            params = replace(params, prediction_token_ids=token_ids or None)
        if params.bad_words:
            if len(params.bad_words) > MAX_BAD_WORDS:  # before any tokenizing
                raise InvalidRequestError(f"at most {MAX_BAD_WORDS} bad_words are allowed")
            encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
            params = replace(params, bad_words_token_ids=tokenize_bad_words(params.bad_words, encode))
        if params.structured_outputs is not None:
            await self.grammar_checker.check(params.structured_outputs)
        return params

    def _check_healthy(self) -> None:
        # A core down while others serve (data parallel): new requests go to the live ones.
        if not self.is_healthy and (self._is_shutting_down or not any(e.is_alive for e in self.engines)):
            raise EngineDeadError(f"the engine is not available: {self.dead_reason}")

    async def _tokenize(self, prompts: list[str | list[int]]) -> list[list[int]]:
        for prompt in prompts:
            if not isinstance(prompt, (list, tuple)) and (not isinstance(prompt, str) or not prompt):
                raise InvalidRequestError("the prompt must be a non-empty string")
        return await self.prompt_tokenizer.encode_prompts(prompts)

    async def tokenize_chat(self, messages: list[dict], add_generation_prompt: bool,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        return await self.prompt_tokenizer.encode_chat(messages, add_generation_prompt, tools, template_kwargs)

    def _pick_engine(self) -> EngineConnection:
        # Fewest requests in flight; ties rotate so sequential requests spread over idle cores.
        self._num_routed += 1
        num_engines = len(self.engines)
        alive = [e for e in self.engines if e.is_alive]
        return min(alive, key=lambda e: (e.num_in_flight, (e.index - self._num_routed) % num_engines))

    def _abort(self, states: list[RequestState]) -> None:
        for state in states:
            self._finish(state, FinishReason.ABORT)
        self._abort_in_cores(states)

    def _abort_in_cores(self, states: list[RequestState]) -> None:
        """One AbortRequests per live core, listing its requests among `states`."""
        request_ids_by_engine = defaultdict(list)
        for state in states:
            request_ids_by_engine[state.engine_index].append(state.request_id)
        for engine_index, request_ids in request_ids_by_engine.items():
            engine = self.engines[engine_index]
            if engine.is_alive:
                logger.debug("aborting %s on engine %d", request_ids, engine_index)
                engine.send(AbortRequests(request_ids))

    def reset_prefix_cache(self) -> None:
        """Ask every live core to forget its free cached blocks (fire and forget: cores apply it in order)."""
        for engine in self.engines:
            if engine.is_alive:
                engine.send(ResetPrefixCache())

    def watch_steps(self, is_on: bool) -> None:
        """A dashboard feed opened (or closed): the cores count their steps while any is open."""
        if self.timeline.watch(is_on):
            for engine in self.engines:
                if engine.is_alive:
                    engine.send(WatchSteps(self.timeline.is_watched))

    def _finish(self, state: RequestState, reason: FinishReason) -> None:
        state.is_finished = True
        self._states.pop(state.request_id, None)
        self.output_processor.remove_requests([state.request_id])
        self.engines[state.engine_index].request_ids.discard(state.request_id)
        self.metrics.record_finished(reason)

    def _fail(self, state: RequestState, error: FrontendError) -> None:
        self._finish(state, FinishReason.ERROR)
        state.queue.put_nowait(error)

    # ------------------------------------------------------------ dead and restarted cores

    def _on_engine_dead(self, engine: EngineConnection, reason: str) -> None:
        if not engine.is_alive:
            return
        engine.is_alive = False
        self.is_healthy, self.dead_reason = False, reason
        logger.error("%s; failing its %d in-flight requests", reason, engine.num_in_flight)
        for request_id in list(engine.request_ids):
            self._fail(self._states[request_id], EngineDeadError(reason))
        if self.ray_cores is not None and not self._is_shutting_down:  # Ray restarts its actor
            self.ray_cores.reconnect(engine, self.ctx, self.frontend_id, self.config.ready_timeout_s,
                                     self.pumps.stop, self._on_restarted)
        elif self.config.restart_engine and engine.process is not None and not self._is_shutting_down:
            self.restarter.restart(engine, self.pumps.stop, self._on_restarted)

    def _on_restarted(self, engine: EngineConnection) -> None:
        self.engines[engine.index] = engine
        self.pumps.start(engine)
        if all(e.is_alive for e in self.engines):
            self.is_healthy, self.dead_reason = True, None

    # ------------------------------------------------------------ state and shutdown

    def stats(self) -> SchedulerStats:
        """The engines' latest scheduler stats, summed."""
        total = SchedulerStats()
        for engine in self.engines:
            for name in total.__struct_fields__:
                if name != "spec_decode":
                    setattr(total, name, getattr(total, name) + getattr(engine.stats, name))
        total.spec_decode = sum_spec_decode(engine.stats.spec_decode for engine in self.engines)
        return total

    @property
    def num_in_flight(self) -> int:
        return len(self._states)

    def fail_all(self, error: FrontendError) -> None:
        """Fail every request in flight with `error` and abort them in their cores (shutdown grace is over)."""
        states = list(self._states.values())
        for state in states:
            self._fail(state, error)
        self._abort_in_cores(states)

    async def shutdown(self) -> None:
        """Stop the pumps and restarts, shut local cores down, fail whatever is still waiting."""
        self._is_shutting_down = True
        self.is_healthy, self.dead_reason = False, "the server is shutting down"
        await self.restarter.cancel()
        await self.pumps.stop_all()
        # Close first: a remote core's close aborts the requests still listed on it.
        await asyncio.gather(*(engine.close() for engine in self.engines), return_exceptions=True)
        if self.ray_cores is not None:
            await self.ray_cores.shutdown()
        for state in list(self._states.values()):
            self._fail(state, EngineDeadError(self.dead_reason))
        self.prompt_tokenizer.shutdown()
        await self.grammar_checker.close()
        self.ctx.term()
