"""The hostile script's view of one live server: HTTP calls, answer checks, the core's pid, the local socket.

Everything here is a plain blocking client (requests, raw sockets, a ZeroMQ DEALER): the
cases in scripts/hostile/cases.py and scripts/hostile/fuzz.py want exact control over what is sent and
when, not throughput. Loopback only; scripts/hostile/run.py checks the address.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import requests
import zmq

# A 4xx message that shows one of these leaks the server's internals (the defect the fixes remove).
EXCEPTION_TEXT = re.compile(r"Traceback|\b[A-Z]\w*(?:Error|Exception)\(|object at 0x|File \"")
FINISH_REASONS = {1: "stop", 2: "length", 3: "abort", 4: "error"}
FINISH_ERROR = 4
# SamplingParams on the local socket, in wire order (docs/protocol.md).
WIRE_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "ignore_eos",
               "stop_token_ids", "stop", "logprobs", "skip_special_tokens", "include_stop_str_in_output")
# Greedy, two tokens, min_tokens 1: short, and stop_token_ids are then used as banned ids too.
WIRE_DEFAULTS = (0.0, 1.0, -1, 0.0, None, 2, 1, False, [], [], None, True, False)
GENERATE_REQUEST, ABORT_REQUESTS, GENERATE_OUTPUT = 20, 2, 21


class Raw(str):
    """A JSON token sent as is (NaN, Infinity, 1e400): json.dumps cannot write them."""


def dumps(body) -> bytes:
    raws: dict[str, str] = {}

    def swap(value):
        if isinstance(value, Raw):
            key = f"__raw{len(raws)}__"
            raws[key] = str(value)
            return key
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        if isinstance(value, list):
            return [swap(v) for v in value]
        return value

    text = json.dumps(swap(body))
    for key, raw in raws.items():
        text = text.replace(f'"{key}"', raw)
    return text.encode()


def error_problem(status: int, text: str) -> str | None:
    """What is wrong with an answer that should be a 4xx OpenAI-style error, or None."""
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"{status} without an {{'error': {{'message'}}}} body: {text[:200]!r}"
    if not isinstance(message, str) or not message:
        return f"{status} with an empty error message"
    if EXCEPTION_TEXT.search(message):
        return f"{status} message shows exception text: {message[:200]!r}"
    return None


def answer_problem(route: str, status: int, text: str) -> str | None:
    """None when the answer is a sane 2xx or a clean 4xx; else what is wrong."""
    if status >= 500 or status < 200 or 300 <= status < 400:
        return f"status {status}: {text[:200]!r}"
    if status >= 400:
        return error_problem(status, text)
    try:
        body = json.loads(text)
        if route == "/generate":
            is_sane = isinstance(body["text"], list) and all(isinstance(t, str) for t in body["text"])
        elif route == "/v1/responses":
            is_sane = isinstance(body["output"], list) and body["status"] in ("completed", "incomplete")
        elif route == "/v1/messages":
            is_sane = isinstance(body["content"], list) and body["stop_reason"] in (
                "end_turn", "max_tokens", "stop_sequence", "tool_use")
        elif route == "/v1/embeddings":
            is_sane = bool(body["data"]) and all(isinstance(d["embedding"], (list, str)) for d in body["data"])
        else:
            choices = body["choices"]
            key = "text" if route == "/v1/completions" else "message"
            is_sane = bool(choices) and all(key in c and c.get("finish_reason") for c in choices)
    except (ValueError, KeyError, TypeError):
        is_sane = False
    return None if is_sane else f"200 with an odd body: {text[:200]!r}"


@dataclass
class Target:
    url: str
    client_socket: str | None = None
    server_pid: int | None = None  # only when this script started the server
    vocab_size: int = 49152
    max_model_len: int = 8192
    model: str = ""
    model_path: str = ""  # the served model's folder (/v1/models root), for cases that write files against it
    session: requests.Session = field(default_factory=requests.Session)

    def post(self, path: str, body, timeout: float = 30.0) -> tuple[int, str, float]:
        """(status, text, seconds); status 0 with the error's name when no answer came."""
        data = body if isinstance(body, bytes) else dumps(body)
        start = time.monotonic()
        try:
            r = self.session.post(self.url + path, data=data, timeout=timeout,
                                  headers={"Content-Type": "application/json"})
            return r.status_code, r.text, time.monotonic() - start
        except requests.RequestException as e:
            return 0, f"no answer: {type(e).__name__}", time.monotonic() - start

    def health(self, timeout: float = 5.0) -> tuple[int, float]:
        start = time.monotonic()
        try:
            status = requests.get(self.url + "/health", timeout=timeout).status_code
        except requests.RequestException:
            status = 0
        return status, time.monotonic() - start

    def wait_healthy(self, timeout_s: float) -> float | None:
        """Seconds until /health answered 200, or None if it did not within timeout_s."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.health()[0] == 200:
                return time.monotonic() - start
            time.sleep(0.25)
        return None

    def metrics(self) -> dict[str, float]:
        text = requests.get(self.url + "/metrics", timeout=10).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("tokenloom_") and "_bucket" not in line and "finish_reason" not in line:
                name = line.split("{", 1)[0][len("tokenloom_"):]
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return values

    def wait_idle(self, timeout_s: float = 60.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            if not (m["num_requests_running"] + m["num_requests_waiting"] + m["kv_blocks_used"]) \
                    or time.monotonic() > deadline:
                return m
            time.sleep(0.25)

    def greedy(self, prompt: str = "The capital of France is", **extra) -> dict:
        """The baseline: a greedy completion's text, plus its token ids over the local socket when there is one."""
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, **extra}
        status, text, _ = self.post("/v1/completions", body, timeout=120)
        result = {"status": status, "text": json.loads(text)["choices"][0]["text"] if status == 200 else text[:300]}
        if self.client_socket and not extra:
            with LocalClient(self.client_socket) as local:
                local.generate("baseline", prompt=prompt, max_tokens=16, min_tokens=0)
                outputs = local.collect(["baseline"], timeout_s=30)["baseline"]
                result["token_ids"] = [t for o in outputs for t in o[2]]
        return result

    def core_pids(self) -> list[int]:
        """The engine cores this script's server started: its children running engine.loop.core_process."""
        if self.server_pid is None:
            return []
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                if ppid == self.server_pid and b"engine.loop.core_process" in (stat.parent / "cmdline").read_bytes():
                    pids.append(int(stat.parent.name))
            except (OSError, ValueError, IndexError):
                continue  # the process went away while we read it
        return sorted(pids)


def wire_params(**overrides) -> list:
    params = dict(zip(WIRE_FIELDS, WIRE_DEFAULTS))
    params.update(overrides)
    return [params[name] for name in WIRE_FIELDS]


class LocalClient:
    """A DEALER on the server's --client-socket; records are raw msgpack so any value can be sent."""

    def __init__(self, address: str):
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, uuid.uuid4().hex.encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)

    def __enter__(self) -> LocalClient:
        return self

    def __exit__(self, *exc) -> None:
        self.socket.close(0)
        self.ctx.term()

    def send_raw(self, record: list) -> None:
        self.socket.send(msgpack.packb(record))

    def generate(self, request_id, prompt=None, token_ids=None, params: list | None = None, **overrides) -> None:
        if prompt is None and token_ids is None:
            prompt = "Hello"
        self.send_raw([GENERATE_REQUEST, request_id, prompt, token_ids, params or wire_params(**overrides)])

    def abort(self, request_ids: list) -> None:
        self.send_raw([ABORT_REQUESTS, request_ids])

    def collect(self, request_ids: list, timeout_s: float, linger_s: float = 0.0) -> dict:
        """Outputs per id until every id has a final one (then linger_s more, to catch extra finals) or timeout."""
        outputs: dict = {rid: [] for rid in request_ids}
        deadline = time.monotonic() + timeout_s
        linger_until = None
        while time.monotonic() < (linger_until or deadline):
            wait_ms = max(1, int(1000 * ((linger_until or deadline) - time.monotonic())))
            if not self.socket.poll(wait_ms):
                continue
            record = msgpack.unpackb(self.socket.recv(), strict_map_key=False)
            if isinstance(record, list) and len(record) >= 6 and record[0] == GENERATE_OUTPUT:
                outputs.setdefault(record[1], []).append(record[1:])  # [id, text, token_ids, finish, error]
            finished = all(any(o[3] is not None for o in outputs[rid]) for rid in request_ids)
            if finished and linger_until is None:
                linger_until = time.monotonic() + linger_s
        return outputs

    def drain_until_quiet(self, quiet_s: float, timeout_s: float) -> dict:
        """Every output, by request id, until none has come for quiet_s (or timeout_s is over)."""
        outputs: dict = {}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.socket.poll(int(1000 * quiet_s)):
            record = msgpack.unpackb(self.socket.recv(), strict_map_key=False)
            if isinstance(record, list) and len(record) >= 6 and record[0] == GENERATE_OUTPUT:
                outputs.setdefault(record[1], []).append(record[1:])
        return outputs


def finals(outputs: list) -> list[tuple[str, str | None]]:
    """The final outputs of one request as (finish reason, error)."""
    return [(FINISH_REASONS.get(o[3], str(o[3])), o[4]) for o in outputs if o[3] is not None]
