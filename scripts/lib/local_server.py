"""A tokenloom server the benchmark scripts start for themselves, and its /metrics.

    process, url, log_path = start_server("smollm2", ["--no-enable-prefix-caching"])
    metrics = scrape_metrics(url)        # {"kv_blocks_used": 0.0, "prefix_cache_hits_total": 0.0, ...}
    stop_server(process)

The server runs `frontend.api_server` on a free loopback port with its log in the
temporary folder, so a script can start one per configuration (prefix caching on, then
off) in a single run. scrape_metrics reads the Prometheus text of tokenloom (names
without the `tokenloom_` prefix) or of `vllm serve` (without `vllm:`; its
prefix_cache_queries_total and prefix_cache_hits_total count prompt tokens, as ours do),
summed over label sets, histograms left out. `Server` is the record a benchmark keeps of each
server it starts (ours or a peer's), `free_port` the loopback port it starts one on.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 600  # a cold start builds the CPU kernels (~20 s) and may convert the model
METRIC_PREFIXES = ("tokenloom_", "vllm:")


@dataclass
class Server:
    """A server a benchmark runs: its command line, and what it learns of it while measuring."""
    name: str
    command: list[str]
    payload_extra: dict  # fields only this server's API takes
    url: str = ""
    log_path: Path | None = None
    process: subprocess.Popen | None = None
    model: str = ""  # as /v1/models lists it
    runs: list[dict] = field(default_factory=list)


def free_port() -> int:
    """A loopback port free right now (the OS picks it; the server binds it a moment later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(model: str, server_args: list[str] = (), log_name: str = "tokenloom-server"
                 ) -> tuple[subprocess.Popen, str, Path]:
    """Starts a server and waits for /health; returns the process, its base URL and its log."""
    port = free_port()
    log_path = Path(tempfile.gettempdir()) / f"{log_name}-{port}.log"
    command = [sys.executable, "-m", "frontend.api_server", "--model", model, "--port", str(port),
               "--log-level", "warning", *server_args]
    url = f"http://127.0.0.1:{port}"
    return launch_server(command, url, log_path), url, log_path


def server_env() -> dict[str, str]:
    """The environment a server runs in: this one, with the repository importable."""
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


def launch_server(command: list[str], url: str, log_path: Path) -> subprocess.Popen:
    """Runs `command` (a server listening at `url`) with its output in `log_path`; returns once /health is 200.

    Exits the script when the server dies first or is not healthy within START_TIMEOUT_S.
    """
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=server_env())
    if wait_healthy(process, url, START_TIMEOUT_S):
        return process
    if process.poll() is not None:
        raise SystemExit(f"the server exited with {process.returncode}; see {log_path}")
    process.kill()
    raise SystemExit(f"the server did not become healthy; see {log_path}")


def wait_healthy(process: subprocess.Popen, url: str, timeout_s: float, poll_s: float = 0.5) -> bool:
    """Polls `url`/health: True once it answers 200; False when the process exits or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return True
        except OSError:
            time.sleep(poll_s)  # not listening yet, or still loading: 503
    return False


def stop_server(process: subprocess.Popen, timeout_s: float = 120) -> int:
    """SIGTERM (the server drains), then SIGKILL if it is still there after `timeout_s`."""
    process.terminate()
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def parse_metrics(text: str) -> dict[str, float]:
    """Sample values by name, summed over label sets (engines, models); tokenloom's
    requests_finished_total is kept per reason as `requests_finished_total:REASON`, and its
    speculative decoding series per method as `spec_decode_accepted_tokens_total:ngram`."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        prefix = next((p for p in METRIC_PREFIXES if line.startswith(p)), None)
        if prefix is None:
            continue
        name_and_labels, _, value = line.rpartition(" ")
        name = name_and_labels.split("{", 1)[0][len(prefix):]
        if name.endswith(("_bucket", "_sum", "_count", "_created")):
            continue
        for label in ("finish_reason", "method"):
            if f'{label}="' in name_and_labels and prefix == "tokenloom_":
                name += ":" + name_and_labels.split(f'{label}="', 1)[1].split('"', 1)[0]
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values


def scrape_metrics(url: str, timeout_s: float = 30) -> dict[str, float]:
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout_s) as response:
        return parse_metrics(response.read().decode())


def spec_decode_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, dict]:
    """Speculative decoding over a run, per method that drafted in it, from two scrape_metrics:
    {method: {num_drafts, num_proposed_tokens, num_accepted_tokens, num_emitted_tokens,
    acceptance_rate, tokens_per_draft}}; {} when none did (or a scrape failed)."""
    if not before or not after:
        return {}
    fields = {"num_drafts": "spec_decode_num_drafts_total", "num_proposed_tokens": "spec_decode_proposed_tokens_total",
              "num_accepted_tokens": "spec_decode_accepted_tokens_total",
              "num_emitted_tokens": "spec_decode_emitted_tokens_total"}
    methods = {name.split(":", 1)[1] for name in after if name.startswith(fields["num_drafts"] + ":")}
    result = {}
    for method in sorted(methods):
        counts = {key: int(after.get(f"{name}:{method}", 0) - before.get(f"{name}:{method}", 0))
                  for key, name in fields.items()}
        if counts["num_drafts"] > 0:
            rate = counts["num_accepted_tokens"] / max(1, counts["num_proposed_tokens"])
            result[method] = {**counts, "acceptance_rate": round(rate, 4),
                              "tokens_per_draft": round(counts["num_emitted_tokens"] / counts["num_drafts"], 3)}
    return result


def reset_prefix_cache(url: str) -> bool:
    """POST /reset_prefix_cache; False where the server has no such route (vllm serve
    outside its dev mode), so the caller can say the run may start warm."""
    request = urllib.request.Request(url.rstrip("/") + "/reset_prefix_cache", method="POST", data=b"")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return 200 <= response.status < 300
    except OSError:
        return False
