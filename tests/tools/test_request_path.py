"""scripts/tools/request_path.py and its tracer: which of our files one streamed chat request runs.

The tracer is tested on a small module of its own (fast): start-up is forgotten on SIGUSR1, and
a function run on a thread started later counts. The counter runs for real on the default model
(slow): the request's path holds the core loop, the scheduler, the runner and the chat serving
module, and none of the modules that only start the server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from scripts.lib.fake_engine import REPO_ROOT, subprocess_env
from scripts.tools.request_path import by_room, main as request_path_main, room_of
from scripts.tools.trace_files import ENV_VAR

# Run on every request's path: the core loop, the scheduler, the runner, the chat serving module.
ON_THE_PATH = ("engine/loop/engine_core.py", "engine/core/scheduler.py", "engine/worker/model_runner.py",
               "frontend/serving_chat.py")
# Run only while the server starts: resolving the model (engine/loader/model_files.py, in the
# frontend through frontend/model_folder.py and in EngineCore.__init__), the command line, the
# GGUF block reader the runner is handed at construction.
START_UP_ONLY = ("engine/loader/model_files.py", "engine/loader/gguf_blocks.py", "frontend/cli.py",
                 "frontend/server_args.py", "frontend/model_folder.py")

# A plain streamed chat request passes at most this many of our files (39 when set).
MAX_PATH_FILES = 40

TARGET = '''
import sys
import threading

from scripts.tools.request_path import room_of
from scripts.lib.local_server import parse_metrics

room_of("engine/core/scheduler.py")  # start-up: forgotten on SIGUSR1
print("ready", flush=True)
for line in sys.stdin:  # one line per step the test asks for; the signals arrive between them
    worker = threading.Thread(target=parse_metrics, args=("tokenloom_x 1",))
    worker.start()
    worker.join()
    print("done", flush=True)
'''


def wait_for_event(path: Path, event: str, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            answer = json.loads(path.read_text())
            if answer["event"] == event:
                return answer
        time.sleep(0.05)
    raise AssertionError(f"no {event} in {path}")


def test_the_tracer_forgets_start_up_and_sees_threads(tmp_path):
    (tmp_path / "trace_target_module.py").write_text(textwrap.dedent(TARGET))
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    env[ENV_VAR] = str(tmp_path / "trace-{pid}.json")
    process = subprocess.Popen([sys.executable, "-m", "scripts.tools.trace_files", "-m", "trace_target_module"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
    try:
        assert process.stdout.readline() == "ready\n"
        trace = tmp_path / f"trace-{process.pid}.json"
        process.send_signal(signal.SIGUSR2)
        before = wait_for_event(trace, "dumped")
        assert "scripts/tools/request_path.py" in before["files"]  # start-up is recorded until cleared
        process.send_signal(signal.SIGUSR1)
        assert wait_for_event(trace, "cleared")["files"] == []
        process.stdin.write("go\n")
        process.stdin.flush()
        assert process.stdout.readline() == "done\n"
        trace.unlink()
        process.send_signal(signal.SIGUSR2)
        after = wait_for_event(trace, "dumped")
    finally:
        process.stdin.close()
        process.wait(30)
    assert after["pid"] == process.pid
    assert "scripts/lib/local_server.py" in after["files"]  # called on a thread started after the tracer
    assert "scripts/tools/request_path.py" not in after["files"]  # start-up only: forgotten
    assert "scripts/tools/trace_files.py" not in after["files"]  # the tracer's own handlers never count
    assert not any(path.startswith("/") or ".venv" in path for path in after["files"])


def test_tracer_refuses_to_run_without_its_output_path():
    env = {k: v for k, v in subprocess_env().items() if k != ENV_VAR}
    done = subprocess.run([sys.executable, "-m", "scripts.tools.trace_files", "-m", "json.tool", "--help"],
                          env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and ENV_VAR in done.stderr


def test_rooms_are_the_folder_a_file_sits_in():
    assert room_of("engine/core/scheduler.py") == "engine/core"
    assert room_of("frontend/api_server.py") == "frontend"
    assert room_of("ipc/text/output_processor.py") == "ipc/text"
    files = ["ipc/codec.py", "engine/loop/engine_core.py", "engine/core/request.py", "engine/core/block_manager.py"]
    assert by_room(files) == {
        "engine/core": ["engine/core/block_manager.py", "engine/core/request.py"],
        "engine/loop": ["engine/loop/engine_core.py"], "ipc": ["ipc/codec.py"]}


@pytest.mark.slow
def test_one_streamed_chat_request_path(tmp_path):
    report = request_path_main(["--json", str(tmp_path / "request_path.json")])
    assert json.loads((tmp_path / "request_path.json").read_text()) == report
    files = set(report["files"])
    assert report["num_files"] == len(files) == len(report["files"])
    assert set(ON_THE_PATH) <= files
    assert files.isdisjoint(START_UP_ONLY)
    # docs/architecture.md's bound: a plain chat request runs only the parts it uses (issue #55).
    assert report["num_files"] <= MAX_PATH_FILES, report["files_by_room"]
    assert report["measured_text"]  # the measured request did generate
    by_process = report["files_by_process"]
    assert "frontend/serving_chat.py" in by_process["frontend"]
    assert {"engine/loop/engine_core.py", "engine/core/scheduler.py"} <= set(by_process["engine_core"])
    assert not any(path.startswith("engine/") for path in by_process["frontend"])  # the frontend never steps
    assert not any(path.startswith("frontend/") for path in by_process["engine_core"])
    assert set(by_process["frontend"]) | set(by_process["engine_core"]) == files
    assert sorted(f for room_files in report["files_by_room"].values() for f in room_files) == report["files"]
