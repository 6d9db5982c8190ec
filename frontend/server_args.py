"""Command-line flags of the API server, shared by `python -m frontend.api_server` and `tokenloom serve`."""

from __future__ import annotations

import argparse
import os
import shlex

from frontend.admission import (
    DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_CONCURRENT_REQUESTS, DEFAULT_MAX_REQUEST_BYTES,
    AdmissionConfig,
)
from frontend.chat_tools import ToolOptions
from frontend.media import DEFAULT_IMAGES_PER_PROMPT, MediaOptions, parse_limit_mm_per_prompt
from frontend.engine_client import EngineClientConfig
from frontend.engine_connection import DEFAULT_ENGINE_COMMAND
from frontend.reasoning_parsers import REASONING_PARSER_NAMES
from frontend.tool_parsers import TOOL_PARSER_NAMES
from ipc.engine_config import DEFAULT_MODEL, add_engine_args, engine_argv
from ipc.speculative_config import SpeculativeConfig
from ipc.vision.image_decode import ImageLimits

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
DEFAULT_ENGINE_TIMEOUT_S = 60.0  # as vLLM's engine iteration timeout: a slow step on a loaded host is not a hang
API_KEY_ENV = "TOKENLOOM_API_KEY"


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"known model name or local HF folder (default: {DEFAULT_MODEL})")
    parser.add_argument("--served-model-name", help="model name shown to clients (default: --model)")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--data-parallel", type=int, default=1, metavar="N",
                        help="engine cores to start: locally, or with --distributed-executor-backend ray as Ray "
                             "actors anywhere in the cluster")
    parser.add_argument("--engine", action="extend", nargs="+", default=[], metavar="ADDR",
                        help="connect to running cores (tcp://host:port or ipc://path) instead of starting any")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"require 'Authorization: Bearer KEY' on /v1/* and /generate (default: ${API_KEY_ENV})")
    parser.add_argument("--client-socket", metavar="ADDR",
                        help="also serve GenerateRequest over a ZeroMQ ROUTER at ADDR (see docs/protocol.md)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--engine-ready-timeout", type=float, default=600.0, metavar="S",
                        help="seconds to wait for each core's EngineReady")
    tools = parser.add_argument_group("tool calling (vLLM's flags)")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser')
    tools.add_argument("--tool-call-parser", choices=TOOL_PARSER_NAMES,
                       help='how calls are read from a free answer (tool_choice "auto")')
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSER_NAMES,
                        help="move the answer's <think>...</think> part into message.reasoning_content (vLLM's "
                             "flag); a grammar then applies after the reasoning")
    lora = parser.add_argument_group("LoRA adapters (vLLM's flags; also --enable-lora, --max-loras, --max-lora-rank, "
                                     "--max-cpu-loras below)")
    lora.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                      help='adapters served by name: name=path, or JSON {"name", "path", "base_model_name"}')
    lora.add_argument("--allow-runtime-lora-updating", action="store_true",
                      help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
    limits = parser.add_argument_group("limits and faults")
    limits.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
                        help=f"largest request body; larger ones get 413 (default: {DEFAULT_MAX_REQUEST_BYTES})")
    limits.add_argument("--max-concurrent-requests", type=int, default=DEFAULT_MAX_CONCURRENT_REQUESTS, metavar="N",
                        help=f"API requests served at once; more get 429 (default: {DEFAULT_MAX_CONCURRENT_REQUESTS})")
    limits.add_argument("--max-request-prompt-tokens", type=int, default=0, metavar="N",
                        help="prompt tokens of one request, all its prompts together; more get 400, counted as they "
                             "are tokenized (default 0: twice the context length)")
    limits.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S, metavar="S",
                        help="seconds a connection gets to send a request's line and headers (from connecting, or "
                             f"from the first byte of its next request); then it is closed (default: "
                             f"{DEFAULT_HEADER_TIMEOUT_S:g})")
    limits.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S, metavar="S",
                        help="seconds a request gets to send its whole body after its headers; then it gets 408 and "
                             f"the connection is closed (default: {DEFAULT_BODY_TIMEOUT_S:g})")
    limits.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="S",
                        help="on SIGTERM, seconds running requests get to finish before they are aborted "
                             f"(default: {DEFAULT_SHUTDOWN_TIMEOUT_S:.0f})")
    limits.add_argument("--restart-engine", action="store_true",
                        help="start a fresh core when a local one dies or hangs, instead of staying down (503)")
    limits.add_argument("--engine-timeout", type=float, default=DEFAULT_ENGINE_TIMEOUT_S, metavar="S",
                        help="a core that sends nothing for S seconds (an idle one sends a heartbeat every second) "
                             f"is hung and counts as dead; 0 disables (default: {DEFAULT_ENGINE_TIMEOUT_S:.0f})")
    media = parser.add_argument_group("images (vision-language models)")
    media.add_argument("--limit-mm-per-prompt", metavar="JSON", help=f'images per prompt, vLLM\'s \'{{"image": N}}\' '
                       f"(default: {DEFAULT_IMAGES_PER_PROMPT})")
    media.add_argument("--allowed-local-media-path", metavar="DIR",
                       help="the folder file:// image URLs may read (default: none; http(s) URLs are never fetched)")
    media.add_argument("--max-image-bytes", type=int, default=ImageLimits.max_bytes, metavar="N",
                       help="largest encoded image; base64 images also count toward --max-request-bytes")
    media.add_argument("--max-image-pixels", type=int, default=ImageLimits.max_pixels, metavar="N",
                       help="largest image in width x height, read from its header before decoding (bombs)")
    parser.add_argument("--allow-remote", action="store_true",
                        help="let cores and --client-socket bind non-loopback tcp addresses")
    add_engine_args(parser.add_argument_group(
        "engine core", "passed to the cores this server starts; unset flags keep the core's defaults"),
        unset_by_default=True)
    # Tests swap the core for scripts/lib/fake_engine.py, and make it fail; not for users.
    parser.add_argument("--engine-command", help=argparse.SUPPRESS)
    parser.add_argument("--inject-fault-at-step", type=int, help=argparse.SUPPRESS)  # first start of each core only
    parser.add_argument("--inject-fault-persistent", action="store_true", help=argparse.SUPPRESS)
    return parser


def make_parser(prog: str | None = None) -> argparse.ArgumentParser:
    return add_server_args(argparse.ArgumentParser(prog=prog, description="tokenloom OpenAI-compatible API server"))


def engine_args_from(args: argparse.Namespace) -> list[str]:
    """The flags a local core gets: the engine flags given, --allow-remote, and the log level."""
    return [*engine_argv(args), *(["--allow-remote"] if args.allow_remote else []), "--log-level", args.log_level]


def _thread_share_args(args: argparse.Namespace) -> list[str]:
    """With several local cores, each core's ranks get their share of this host's CPUs (unless
    --num-threads says otherwise): left alone, every core's torch would take all of them."""
    if args.data_parallel <= 1 or args.num_threads:
        return []
    # --master-port (multi-node) is refused with DP
    num_ranks = args.data_parallel * (args.tensor_parallel_size or 1) * (args.pipeline_parallel_size or 1)
    return ["--num-threads", str(max(1, len(os.sched_getaffinity(0)) // num_ranks))]


def tool_options(args: argparse.Namespace) -> ToolOptions:
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    return ToolOptions(args.enable_auto_tool_choice, args.tool_call_parser)


def engine_client_config(args: argparse.Namespace) -> EngineClientConfig:
    if args.data_parallel < 1:
        raise ValueError("--data-parallel must be at least 1")
    if args.engine and args.data_parallel != 1:
        raise ValueError("--data-parallel starts local cores; with --engine, list every core's address instead")
    if args.engine_timeout < 0:
        raise ValueError("--engine-timeout must not be negative")
    if args.master_port and args.data_parallel > 1:
        raise ValueError("--master-port would be shared by every local core's tensor-parallel group; leave it unset")
    if args.engine and args.restart_engine:
        raise ValueError("--restart-engine restarts the cores this server starts; it cannot be used with --engine")
    check_speculative_config(args.speculative_config)
    first_start_args = []
    if args.inject_fault_at_step is not None:
        first_start_args = ["--inject-fault-at-step", str(args.inject_fault_at_step)]
        if args.inject_fault_persistent:
            first_start_args.append("--inject-fault-persistent")
    return EngineClientConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        num_local_engines=args.data_parallel,
        engine_addresses=list(args.engine),
        engine_args=engine_args_from(args) + _thread_share_args(args),
        engine_command=tuple(shlex.split(args.engine_command)) if args.engine_command else DEFAULT_ENGINE_COMMAND,
        ready_timeout_s=args.engine_ready_timeout,
        restart_engine=args.restart_engine,
        engine_timeout_s=args.engine_timeout,
        first_start_args=first_start_args,
        max_request_prompt_tokens=args.max_request_prompt_tokens,
        on_ray=args.data_parallel > 1 and args.distributed_executor_backend == "ray",
        media_options=media_options(args),
    )


def media_options(args: argparse.Namespace) -> MediaOptions:
    if args.allowed_local_media_path is not None and not os.path.isdir(args.allowed_local_media_path):
        raise ValueError(f"--allowed-local-media-path {args.allowed_local_media_path!r} is not a folder")
    if args.max_image_bytes < 1 or args.max_image_pixels < 1:
        raise ValueError("--max-image-bytes and --max-image-pixels must be at least 1")
    limits = ImageLimits(args.max_image_bytes, args.max_image_pixels, args.allowed_local_media_path)
    return MediaOptions(parse_limit_mm_per_prompt(args.limit_mm_per_prompt), limits)


def check_speculative_config(value: str | None) -> None:
    """Refuse a bad --speculative-config here, naming its field, before any core starts loading a model."""
    try:
        SpeculativeConfig.parse(value)
    except ValueError as e:
        raise ValueError(f"--speculative-config: {e}") from None


def admission_config(args: argparse.Namespace) -> AdmissionConfig:
    if args.max_request_bytes < 1 or args.max_concurrent_requests < 1:
        raise ValueError("--max-request-bytes and --max-concurrent-requests must be at least 1")
    if args.shutdown_timeout < 0:
        raise ValueError("--shutdown-timeout must not be negative")
    if args.header_timeout <= 0 or args.body_timeout <= 0:
        raise ValueError("--header-timeout and --body-timeout must be positive")
    return AdmissionConfig(args.api_key or None, args.max_request_bytes, args.max_concurrent_requests,
                           header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout)
