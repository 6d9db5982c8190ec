"""The `tokenloom` command.

    tokenloom serve --model smollm2 --port 8000 [--host 127.0.0.1] [--data-parallel N]
                    [--engine ADDR ...] [--api-key KEY] [--client-socket ADDR] [engine flags]
    tokenloom engine --listen tcp://127.0.0.1:PORT --model smollm2 [--engine-id N] [engine flags]
    tokenloom engine --tensor-parallel-size N --nnodes K --node-rank R --master-addr HOST --master-port P ...

`serve` is `python -m frontend.api_server`. `engine` replaces itself with an engine core
(`python -m engine.loop.core_process`) bound at --listen, for a frontend elsewhere to reach
with `serve --engine tcp://...`; it stays up when that frontend goes away. With
tensor parallelism over several hosts (torchrun's flags), node 0 runs the core
(with --listen) and every other node runs only its workers
(`python -m engine.executor.worker_process`), no --listen. On a Ray cluster one `serve` command does
it all: `--distributed-executor-backend ray` places the ranks, and `--data-parallel N` cores, as
Ray actors (docs/scale-out.md).
"""

from __future__ import annotations

import argparse
import os
import sys

from frontend.server_args import add_server_args, check_speculative_config
from ipc.engine_config import DEFAULT_MODEL
from ipc.sockets import check_bind_address

ENGINE_MODULE = "engine.loop.core_process"
WORKER_MODULE = "engine.executor.worker_process"


def run_serve(args: argparse.Namespace, extra: list[str], parser: argparse.ArgumentParser) -> None:
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from frontend.api_server import serve  # imported late: `tokenloom engine` needs none of it

    serve(args)


def run_engine(args: argparse.Namespace, extra: list[str], parser: argparse.ArgumentParser) -> None:
    if args.node_rank > 0:  # this host runs tensor-parallel workers only; node 0's core is the one to reach
        if args.listen:
            parser.error("--listen is for node 0, which runs the engine core; other nodes run only workers")
        command = [sys.executable, "-m", WORKER_MODULE, "--model", args.model, "--node-rank", str(args.node_rank),
                   *extra]
        sys.stdout.flush()
        os.execv(sys.executable, command)
        return
    if not args.listen:
        parser.error("--listen is required (but on tensor-parallel nodes other than --node-rank 0)")
    # Checked here too so a refused address fails at once, before the core loads torch and the model.
    try:
        check_bind_address(args.listen, allow_remote="--allow-remote" in extra)
    except ValueError as e:
        parser.error(str(e).replace("allow_remote=True", "--allow-remote"))
    speculative = argparse.ArgumentParser(add_help=False)
    speculative.add_argument("--speculative-config")
    try:
        check_speculative_config(speculative.parse_known_args(extra)[0].speculative_config)
    except ValueError as e:
        parser.error(str(e))
    # Everything not parsed here (--max-num-seqs, --allow-remote, ...) is the core's to check.
    command = [sys.executable, "-m", ENGINE_MODULE, "--model", args.model, "--address", args.listen,
               "--engine-id", str(args.engine_id), *extra]
    sys.stdout.flush()
    os.execv(sys.executable, command)


COMMANDS = {"serve": run_serve, "engine": run_engine}


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenloom", description="tokenloom LLM inference server")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{serve,engine}")
    add_server_args(commands.add_parser("serve", help="run the HTTP API server and its engine cores"))
    engine = commands.add_parser("engine", help="run one engine core for a frontend to connect to",
                                 epilog="Other flags are passed to the engine core unchanged.")
    engine.add_argument("--listen", metavar="ADDR",
                        help="address to bind, e.g. tcp://127.0.0.1:5555 (loopback unless --allow-remote); "
                             "required but on tensor-parallel nodes after the first")
    engine.add_argument("--node-rank", type=int, default=0,
                        help="tensor parallelism over hosts: this host's index among --nnodes (0: the core)")
    engine.add_argument("--model", default=DEFAULT_MODEL, help=f"known model name or local folder (default: {DEFAULT_MODEL})")
    engine.add_argument("--engine-id", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = make_parser()
    args, extra = parser.parse_known_args(argv)
    COMMANDS[args.command](args, extra, parser)


if __name__ == "__main__":
    main()
