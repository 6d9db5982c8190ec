"""`scripts/bench/offline.py --live`: the dashboard's occupancy strip for an offline run, one strip per mode.

    python -m scripts.bench.offline --modes continuous,static,static-padded --live
    # then open http://127.0.0.1:8001/live (--live-port)

A small stdlib HTTP server on a daemon thread serves `frontend/static/live.html` and a
server-sent-events feed, `GET /live/events`, a few snapshots a second. Each snapshot
carries, per mode, the step columns recorded since the page's previous snapshot, read
off the engine's own `step_stats` (the list `record_step_stats` already fills for the
benchmark's figures), so the run does no extra work per step. A page that connects
late gets the whole history first (at most MAX_COLUMNS_PER_EVENT columns an event).

The modes run one after another, as the benchmark runs them, so the strips fill in
turn; each column is one step and each cell one sequence of it, coloured prefill,
decode or (static-padded) a finished row still decoding pads. Continuous batching's
strip stays full; static batching's shows each batch draining to its longest member.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from engine.core.step_stats import padding_of

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parents[2] / "frontend" / "static"
ASSETS = {  # what the page loads; nothing else is served
    "/live": ("live.html", "text/html; charset=utf-8"),
    "/static/style.css": ("style.css", "text/css; charset=utf-8"),
    "/static/common.js": ("common.js", "text/javascript; charset=utf-8"),
    "/static/strip.js": ("strip.js", "text/javascript; charset=utf-8"),
    "/static/live.js": ("live.js", "text/javascript; charset=utf-8"),
}
EVENT_INTERVAL_S = 0.25
MAX_COLUMNS_PER_EVENT = 4096


@dataclass
class LiveRun:
    """One mode's run as the page sees it; `steps` is the engine's own StepStats list, which
    the engine appends to while the run lasts (holding it does not hold the engine)."""

    name: str
    state: str = "waiting"  # waiting, running, done
    steps: list = field(default_factory=list)  # engine.core.step_stats.StepStats
    start_time: float = 0.0
    elapsed_s: float = 0.0
    summary: dict = field(default_factory=dict)  # the benchmark's figures once done


def step_column(stats) -> list[int]:
    """[prefill, decode, padding] sequences of one StepStats (the scheduler's own counts)."""
    return [stats.num_prefill_requests, stats.num_decode_requests, padding_of(stats)[1]]


class LiveView:
    """The page's server and the runs it shows; `start_run` / `finish_run` come from the benchmark."""

    def __init__(self, names: list[str], port: int, host: str = "127.0.0.1",
                 interval_s: float = EVENT_INTERVAL_S):
        self.runs = {name: LiveRun(name) for name in names}
        self.interval_s = interval_s
        self.is_closed = False
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer((host, port), self._handler_class())
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, name="live-view", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/live"

    def start(self) -> "LiveView":
        self._thread.start()
        logger.info("live view at %s", self.url)
        return self

    def start_run(self, name: str, step_stats: list) -> None:
        with self._lock:
            run = self.runs.setdefault(name, LiveRun(name))
            run.state, run.steps, run.start_time = "running", step_stats, time.perf_counter()

    def finish_run(self, name: str, summary: dict) -> None:
        with self._lock:
            run = self.runs.setdefault(name, LiveRun(name))
            if run.state == "running":
                run.elapsed_s = time.perf_counter() - run.start_time
            run.state, run.summary = "done", summary

    def close(self) -> None:
        self.is_closed = True
        self.server.shutdown()
        self.server.server_close()

    def snapshot(self, cursors: dict[str, int]) -> dict:
        """Every run's state and its columns from `cursors[name]` on; moves the cursors."""
        runs = []
        with self._lock:
            for run in self.runs.values():
                steps = run.steps
                num_steps = len(steps)  # the engine thread appends; a length read once is a safe bound
                first = cursors.get(run.name, 0)
                skip = max(0, num_steps - first - MAX_COLUMNS_PER_EVENT)
                columns = [step_column(steps[i]) for i in range(first + skip, num_steps)]
                cursors[run.name] = num_steps
                elapsed = time.perf_counter() - run.start_time if run.state == "running" else run.elapsed_s
                num_tokens = sum(steps[i].num_tokens for i in range(num_steps)) if run.state == "running" else 0
                runs.append({
                    "name": run.name,
                    "state": run.state,
                    "elapsed_s": round(elapsed, 2),
                    "num_steps": num_steps,
                    "num_kv_blocks_used": steps[num_steps - 1].num_kv_blocks_used if num_steps else 0,
                    "tokens_per_s": round(num_tokens / elapsed, 1) if run.state == "running" and elapsed > 0
                    else run.summary.get("total_tokens_per_s", 0.0),
                    "steps": columns,
                    "num_steps_dropped": skip,
                })
        return {"runs": runs, "is_closed": self.is_closed}

    def _handler_class(self):
        view = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                if path == "/live/events":
                    self._events()
                elif path in ASSETS:
                    name, content_type = ASSETS[path]
                    self._send(200, (STATIC_DIR / name).read_bytes(), content_type)
                else:
                    self._send(404, b"not found\n", "text/plain; charset=utf-8")

            def _send(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                self.wfile.write(body)

            def _events(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                cursors: dict[str, int] = {}
                try:
                    while True:
                        is_closed = view.is_closed  # read first: the last snapshot then has every step
                        data = json.dumps(view.snapshot(cursors), separators=(",", ":"))
                        self.wfile.write(f"data: {data}\n\n".encode())
                        self.wfile.flush()
                        if is_closed:
                            break
                        time.sleep(view.interval_s)
                    self.wfile.write(b"data: [DONE]\n\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the page went away

            def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's name)
                logger.debug("live view: " + format, *args)

        return Handler

