"""The HTTP frontend: FastAPI on uvicorn (uvloop, httptools) in front of AsyncEngineClient.

    POST /generate               vLLM's simple API ({"text": [prompt + output]}, NUL-separated stream)
    POST /v1/completions         OpenAI completions (SSE when "stream": true)
    POST /v1/chat/completions    OpenAI chat completions
    GET  /v1/models              the served model
    GET  /health                 200, or 503 once an engine core is dead
    GET  /metrics                Prometheus text
    GET  /openapi.json           the schema

Errors are always `{"error": {"message", "type", "code"}}`: 400 bad input, 401 bad
key, 503 engine dead. Run: `python -m frontend.api_server --model PATH --port 8000`.
"""

from __future__ import annotations

import argparse
import hmac
import logging
import signal
import sys
import time

import uvicorn
import uvloop
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from frontend.engine_client import AsyncEngineClient
from frontend.engine_connection import EngineStartError
from frontend.errors import AuthenticationError, EngineDeadError, FrontendError, InvalidRequestError
from frontend.local_socket import LocalSocketServer
from frontend.metrics import CONTENT_TYPE
from frontend.protocol import ChatCompletionRequest, CompletionRequest, GenerateBody
from frontend.serving_chat import create_chat_completion
from frontend.serving_completions import create_completion, generate
from frontend.server_args import engine_client_config, make_parser

logger = logging.getLogger(__name__)

TIMEOUT_KEEP_ALIVE_S = 5


def build_app(client: AsyncEngineClient, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="tokenloom", summary="OpenAI-compatible LLM inference server")
    app.state.client = client
    created = int(time.time())
    auth = [Depends(_make_key_check(api_key))] if api_key else []

    @app.get("/health")
    async def health() -> Response:
        if not client.is_healthy:
            return _error_response(EngineDeadError(f"the engine is not available: {client.dead_reason}"))
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(client.metrics.render(client.stats(), client.is_healthy), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        card = {"id": client.model_name, "object": "model", "created": created, "owned_by": "tokenloom",
                "root": client.model_folder, "max_model_len": client.max_model_len}
        return {"object": "list", "data": [card]}

    # vLLM's /generate reads JSON whatever the Content-Type (its curl examples send none),
    # so this route parses the body itself instead of letting FastAPI insist on the header.
    generate_schema = {"requestBody": {"required": True,
                                       "content": {"application/json": {"schema": GenerateBody.model_json_schema()}}}}

    @app.post("/generate", dependencies=auth, openapi_extra=generate_schema)
    async def generate_route(raw_request: Request) -> Response:
        try:
            body = GenerateBody.model_validate_json(await raw_request.body())
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        return await generate(body, raw_request, client)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, raw_request: Request) -> Response:
        return await create_completion(body, raw_request, client)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request) -> Response:
        return await create_chat_completion(body, raw_request, client)

    app.add_exception_handler(FrontendError, _on_frontend_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    return app


def _error_response(error: FrontendError) -> JSONResponse:
    return JSONResponse(error.to_dict(), status_code=error.status_code)


async def _on_frontend_error(request: Request, exc: FrontendError) -> JSONResponse:
    return _error_response(exc)


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    # FastAPI says 422; OpenAI and vLLM say 400 for a body that does not parse.
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error.get("loc", ()) if part != "body")
        problems.append(f"{where}: {error.get('msg')}" if where else str(error.get("msg")))
    return _error_response(InvalidRequestError("; ".join(problems) or "invalid request"))


async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    body = {"error": {"message": str(exc.detail), "type": error_type, "code": exc.status_code}}
    return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))


def _make_key_check(api_key: str):
    expected = f"Bearer {api_key}".encode()

    async def check_api_key(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise AuthenticationError("invalid or missing API key")

    return check_api_key


async def run_frontend(args: argparse.Namespace) -> None:
    """Start the cores, serve HTTP (and the local socket) until a signal, then shut the cores down."""
    client = await AsyncEngineClient.start(engine_client_config(args))
    local_server = None
    try:
        if args.client_socket:
            local_server = LocalSocketServer(client, args.client_socket, allow_remote=args.allow_remote)
        config = uvicorn.Config(build_app(client, args.api_key), host=args.host, port=args.port, loop="uvloop",
                                http="httptools", log_level=args.log_level, timeout_keep_alive=TIMEOUT_KEEP_ALIVE_S)
        # uvicorn re-raises the signal that stopped it once serve() returns; with these
        # handlers that is a no-op, so the finally below still shuts the cores down.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: logger.info("signal %d: shutting down", signum))
        await uvicorn.Server(config).serve()
    finally:
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
