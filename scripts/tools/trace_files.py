"""Run a module as `python -m` would, recording which of the repository's Python files its functions run from.

    TOKENLOOM_TRACE_FILES=/tmp/trace-{pid}.json python -m scripts.tools.trace_files -m frontend.cli serve ...
    kill -USR1 PID    # forget what ran so far (start-up), write {"event": "cleared", ...}
    kill -USR2 PID    # write {"event": "dumped", "files": [...]}: the files since the last USR1

Every thread is profiled: this one (sys.setprofile) and every thread started after it
(threading.setprofile), so the engine core's worker threads and the frontend's tokenizer pool
count too. A file is recorded when one of its functions is called (a coroutine or generator
counts each time it resumes). Only files under the repository are kept, this one and any
virtual environment inside it left out. Each write goes to TOKENLOOM_TRACE_FILES with `{pid}`
replaced by this process's id, via a temporary file and a rename, so a reader that sees the
file sees all of it. scripts/tools/request_path.py runs a server's two processes under this.

The profiler is a Python call on every call and return, so the traced process runs slower:
fine for counting files, not for timing anything.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import threading

ENV_VAR = "TOKENLOOM_TRACE_FILES"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
THIS_FILE = os.path.abspath(__file__)
USAGE = f"usage: {ENV_VAR}=PATH-WITH-{{pid}} python -m scripts.tools.trace_files -m MODULE [ARGS...]"

_seen_files: set[str] = set()  # co_filename of every function called since the last clear, as Python gave it


def _profile(frame, event, arg):
    if event == "call":  # a set's add is atomic under the GIL: threads need no lock
        _seen_files.add(frame.f_code.co_filename)


def repo_files(filenames) -> list[str]:
    """The repository's .py files among `filenames`, relative to its root, sorted."""
    found = set()
    for name in filenames:
        path = os.path.abspath(name)  # a module found through a relative import path has a relative name
        if not path.endswith(".py") or path == THIS_FILE or not path.startswith(REPO_ROOT + os.sep):
            continue
        relative = os.path.relpath(path, REPO_ROOT)
        if ".venv" in relative.split(os.sep) or "site-packages" in relative.split(os.sep):
            continue
        found.add(relative)
    return sorted(found)


def _write(event: str, files: list[str]) -> None:
    path = os.environ[ENV_VAR].replace("{pid}", str(os.getpid()))
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as out:
        json.dump({"pid": os.getpid(), "argv": sys.argv, "event": event, "files": files}, out)
    os.replace(temporary, path)


def _on_clear(signum, frame) -> None:
    _seen_files.clear()
    _write("cleared", [])


def _on_dump(signum, frame) -> None:
    _write("dumped", repo_files(_seen_files.copy()))


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] != "-m" or ENV_VAR not in os.environ:
        raise SystemExit(USAGE)
    module, args = argv[1], argv[2:]
    signal.signal(signal.SIGUSR1, _on_clear)
    signal.signal(signal.SIGUSR2, _on_dump)
    sys.argv = [module, *args]  # as `python -m module args` would see them (runpy sets [0] to the file)
    threading.setprofile(_profile)
    sys.setprofile(_profile)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
