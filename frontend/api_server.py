"""The HTTP frontend: FastAPI on uvicorn (uvloop, httptools) in front of AsyncEngineClient.

    POST /generate               vLLM's simple API ({"text": [prompt + output]}, NUL-separated stream)
    POST /v1/completions         OpenAI completions (SSE when "stream": true)
    POST /v1/chat/completions    OpenAI chat completions (tools, response_format, structured outputs)
    POST /v1/responses           OpenAI's Responses API (an adapter over chat: frontend.serving_responses)
    GET  /v1/responses/{id}      a stored response
    POST /v1/messages            Anthropic's Messages API (an adapter over chat: frontend.serving_messages)
    POST /v1/embeddings          OpenAI embeddings: the served model's pooled final hidden states
    POST /tokenize, /detokenize  vLLM's: a prompt or messages to token ids, and back
    GET  /v1/models              the served model, and its LoRA adapters (parent: the base)
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   LoRA adapters at run time (frontend.serving_lora)
    GET  /health                 200; 503 while an engine core is dead or the server is draining
    GET  /metrics                Prometheus text
    POST /reset_prefix_cache     drop the cores' cached prefix blocks that no request holds (benchmarks)
    GET  /openapi.json           the schema
    GET  /, /dashboard           a chat page and the engine live, in the browser (frontend.web_pages)

Errors are `{"error": {"message", "type", "code"}}` (Anthropic's shape on /v1/messages): 400 bad input, 401 bad
key, 404 unknown model, 408 body too slow, 413 body too large, 431 headers too large,
429 too many concurrent requests, 503 engine dead or shutting down (limits and
flags: docs/reliability.md).
On SIGTERM the server drains: no new requests, running ones get --shutdown-timeout
seconds to finish, the rest are failed, the cores are shut down, exit code 0.
Run: `python -m frontend.api_server --model PATH --port 8000`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal
import sys
import time
from typing import TypeVar

import pydantic_core
import uvicorn
import uvloop
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from frontend.admission import Admission, AdmissionConfig, AdmissionMiddleware
from frontend.chat_tools import ToolOptions
from frontend.reasoning_parsers import ReasoningPrompt, get_reasoning_parser
from frontend.engine_client import AsyncEngineClient
from frontend.engine_connection import EngineStartError
from frontend.errors import (
    EngineDeadError, FrontendError, InvalidRequestError, ModelNotFoundError, ShuttingDownError, error_body,
)
from frontend.http_protocol import guarded_protocol, raise_open_file_limit
from frontend.local_socket import LocalSocketServer
from frontend.metrics import CONTENT_TYPE
from frontend.protocol import ChatCompletionRequest, CompletionRequest, GenerateBody
from frontend.protocol_messages import MessagesRequest
from frontend.protocol_responses import ResponsesRequest
from frontend.response_store import ResponseStore
from frontend.serving_chat import create_chat_completion
from frontend.serving_messages import create_message
from frontend.serving_responses import create_response, get_response
from frontend.serving_completions import create_completion, generate
from frontend.protocol_embeddings import EmbeddingRequest
from frontend.serving_embeddings import create_embedding
from frontend.serving_tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from frontend.serving_lora import LoRARegistry, add_lora_routes, requested_adapter
from frontend.serving_utils import ClientDisconnected
from frontend.server_args import admission_config, engine_client_config, make_parser, tool_options
from frontend.web_pages import add_web_routes
from ipc.sockets import check_bindable

logger = logging.getLogger(__name__)

TIMEOUT_KEEP_ALIVE_S = 5
DRAIN_BACKSTOP_S = 5.0  # uvicorn cancels what is left this long after our own grace
BodyT = TypeVar("BodyT", bound=BaseModel)


def build_app(client: AsyncEngineClient, admission: Admission | None = None,
              tools: ToolOptions | None = None, reasoning_parser: str | None = None,
              loras: LoRARegistry | None = None) -> FastAPI:
    app = FastAPI(title="tokenloom", summary="OpenAI-compatible LLM inference server")
    admission = admission or Admission(AdmissionConfig())
    tools = tools or ToolOptions()
    reasoning = ReasoningPrompt(get_reasoning_parser(reasoning_parser), client.tokenizer) if reasoning_parser else None
    app.state.client = client
    app.state.admission = admission
    response_store = ResponseStore()
    loras = loras or LoRARegistry(client.model_name)  # none: only the base model's name is served
    created = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        if admission.is_draining:
            return _error_response(ShuttingDownError("the server is shutting down"))
        if not client.is_healthy:
            return _error_response(EngineDeadError(f"the engine is not available: {client.dead_reason}"))
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(client.metrics.render(client.stats(), client.is_healthy), media_type=CONTENT_TYPE)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        client.reset_prefix_cache()
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": client.model_name, "object": "model", "created": created, "owned_by": "tokenloom",
                "root": client.model_folder, "max_model_len": client.max_model_len,
                "dtype": client.engines[0].ready.dtype, "quantization": client.engines[0].ready.quantization or None}
        return {"object": "list", "data": [card, *loras.model_cards(created)]}

    # Each route parses its body itself (read_body) so every way a body can be wrong gets
    # its own 400 message; vLLM's /generate also reads JSON whatever the Content-Type.
    @app.post("/generate", openapi_extra=_body_schema(GenerateBody))
    async def generate_route(raw_request: Request) -> Response:
        return await generate(await read_body(raw_request, GenerateBody), raw_request, client)

    # Routes whose body may name the model: read the body, check the name, hand it over.
    model_routes = {
        "/v1/completions": (CompletionRequest, lambda body, raw: create_completion(body, raw, client)),
        "/v1/chat/completions": (ChatCompletionRequest,
                                 lambda body, raw: create_chat_completion(body, raw, client, tools, reasoning)),
        "/v1/responses": (ResponsesRequest,
                          lambda body, raw: create_response(body, raw, client, tools, reasoning, response_store)),
        "/v1/messages": (MessagesRequest, lambda body, raw: create_message(body, raw, client, tools, reasoning)),
        "/v1/embeddings": (EmbeddingRequest, lambda body, raw: create_embedding(body, raw, client)),
        "/tokenize": (TokenizeRequest, lambda body, raw: tokenize(body, client)),
        "/detokenize": (DetokenizeRequest, lambda body, raw: detokenize(body, client)),
    }
    for path, (body_type, handle) in model_routes.items():
        app.add_api_route(path, _model_route(client, loras, body_type, handle), methods=["POST"],
                          name=path.strip("/").replace("/", "_"), openapi_extra=_body_schema(body_type))

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str) -> Response:
        return get_response(response_id, response_store)

    add_web_routes(app, client, admission)
    add_lora_routes(app, loras, read_body)
    app.add_exception_handler(FrontendError, _on_frontend_error)
    app.add_exception_handler(ClientDisconnected, _on_client_disconnected)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected_error)
    app.add_middleware(AdmissionMiddleware, admission=admission)
    return app


def _model_route(client: AsyncEngineClient, loras: LoRARegistry, body_type: type[BaseModel], handle):
    async def route(raw_request: Request):
        body = await read_body(raw_request, body_type)
        if body.model in loras.adapters:  # a LoRA adapter's name: the engine client sends it with the request
            requested_adapter.set(loras.resolve(body.model))
        else:
            _check_model(client, body.model)
        return await handle(body, raw_request)

    return route


def _body_schema(model: type[BaseModel]) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


async def read_body(raw_request: Request, model: type[BodyT]) -> BodyT:
    """Parse the JSON body into `model`; each kind of bad body raises its own 400."""
    raw = await raw_request.body()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequestError(f"the request body is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        # jiter also refuses lone surrogate escapes (no tokenizer takes them) and deep nesting.
        obj = pydantic_core.from_json(text, allow_inf_nan=False)
    except ValueError as e:
        raise InvalidRequestError(f"the request body is not valid JSON: {_non_finite_field(text) or e}") from None
    if not isinstance(obj, dict):
        raise InvalidRequestError(f"the request body must be a JSON object, got {_json_type(obj)}")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


def _non_finite_field(text: str) -> str | None:
    """Name the first NaN or Infinity in a body that is JSON but for them, or None."""
    try:
        obj = pydantic_core.from_json(text, allow_inf_nan=True)
    except ValueError:
        return None
    stack = [("", obj)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return f"`{path or 'the body'}` is {value} (JSON has no NaN or Infinity)"
        if isinstance(value, dict):
            stack.extend((f"{path}.{key}" if path else str(key), item) for key, item in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None


def _json_type(obj) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if obj is None else names.get(type(obj), type(obj).__name__)


def _check_model(client: AsyncEngineClient, model: str | None) -> None:
    if model is not None and model != client.model_name:
        raise ModelNotFoundError(f"The model `{model}` does not exist; this server serves `{client.model_name}`.")


def _error_response(error: FrontendError, path: str = "") -> JSONResponse:
    return JSONResponse(error_body(error, path), status_code=error.status_code, headers=error.headers)


async def _on_frontend_error(request: Request, exc: FrontendError) -> JSONResponse:
    return _error_response(exc, request.url.path)


async def _on_client_disconnected(request: Request, exc: ClientDisconnected) -> Response:
    return Response(status_code=499)


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    # FastAPI says 422; OpenAI and vLLM say 400 for a body that does not parse.
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error.get("loc", ()) if part != "body")
        problems.append(f"{where}: {error.get('msg')}" if where else str(error.get("msg")))
    return _error_response(InvalidRequestError("; ".join(problems) or "invalid request"), request.url.path)


async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    error = FrontendError(str(exc.detail))
    error.status_code = exc.status_code
    error.error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(error, request.url.path), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


async def _on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    # A bug, not the client's fault: still a JSON error in the route's shape, never Starlette's
    # plain-text 500 (Starlette logs the traceback after this answer).
    error = FrontendError("internal error while serving this request")
    return _error_response(error, request.url.path)


class _DrainingServer(uvicorn.Server):
    """uvicorn, plus: the first SIGTERM/SIGINT starts our drain before uvicorn's own shutdown.

    uvicorn then closes its listening socket (new connections are refused) and waits for
    open responses; our drain fails whatever still runs once the grace is over, so the
    clients get an error event instead of a cut connection.
    """

    def __init__(self, config: uvicorn.Config, on_first_signal):
        super().__init__(config)
        self.on_first_signal = on_first_signal

    def handle_exit(self, sig: int, frame) -> None:
        if not self.should_exit:
            self.on_first_signal(sig)
        super().handle_exit(sig, frame)


async def _drain(client: AsyncEngineClient, admission: Admission, grace_s: float) -> None:
    """Wait up to grace_s for the requests in flight, then fail the rest (they are aborted in the cores)."""
    deadline = time.monotonic() + grace_s
    while (client.num_in_flight or admission.num_active) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if client.num_in_flight:
        logger.warning("shutdown grace of %.0f s is over: aborting %d requests", grace_s, client.num_in_flight)
        client.fail_all(ShuttingDownError("the server shut down before this request finished"))


async def run_frontend(args: argparse.Namespace) -> None:
    """Start the cores, serve HTTP (and the local socket) until a signal, drain, then shut the cores down."""
    admission = Admission(admission_config(args))
    tools = tool_options(args)
    if args.client_socket:  # a taken socket fails now, before the cores load the model
        check_bindable(args.client_socket, allow_remote=args.allow_remote)
    client = await AsyncEngineClient.start(engine_client_config(args))
    local_server = None
    drain_tasks = []
    try:
        if args.client_socket:
            local_server = LocalSocketServer(client, args.client_socket, allow_remote=args.allow_remote)
        loop = asyncio.get_running_loop()

        def start_drain(signum: int) -> None:
            logger.info("signal %d: draining (grace %.0f s)", signum, args.shutdown_timeout)
            drain_tasks.append(loop.create_task(_drain(client, admission, args.shutdown_timeout)))

        def on_first_signal(signum: int) -> None:  # runs in a signal handler: hand the rest to the loop
            admission.is_draining = True
            loop.call_soon_threadsafe(start_drain, signum)

        raise_open_file_limit()  # each connection is a file; thousands of idle ones must not run out
        # uvicorn's own timeout is a backstop: by then our drain has ended every request.
        # The protocol is uvicorn's httptools one with bounded header size and time.
        loras = LoRARegistry.from_args(args, client.model_name, client.model_folder)
        config = uvicorn.Config(build_app(client, admission, tools, args.reasoning_parser, loras), host=args.host,
                                port=args.port, loop="uvloop",
                                http=guarded_protocol(admission.config), log_level=args.log_level,
                                timeout_keep_alive=TIMEOUT_KEEP_ALIVE_S,
                                timeout_graceful_shutdown=args.shutdown_timeout + DRAIN_BACKSTOP_S)
        # uvicorn re-raises the signal that stopped it once serve() returns; with these
        # handlers that is a no-op, so the finally below still shuts the cores down.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: logger.debug("signal %d: already shut down", signum))
        await _DrainingServer(config, on_first_signal).serve()
    finally:
        for task in drain_tasks:
            task.cancel()
        if local_server is not None:
            await local_server.close()
        await client.shutdown()


def serve(args: argparse.Namespace) -> None:
    """Run the server in this process until it is stopped; exit 1 if the engines cannot start."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        uvloop.run(run_frontend(args))
    except (EngineStartError, ValueError) as e:
        logger.error("cannot start: %s", e)
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    serve(make_parser().parse_args(argv))


if __name__ == "__main__":
    main()
