"""Fixtures for every test: the fake model folder, the default model, and a live server on it.
The helpers they are built from are in tests/helpers/."""

from __future__ import annotations

import os
import time

import pytest

# Triton's interpreter must be chosen before triton is first imported anywhere in
# the session; on a machine without CUDA every kernel test runs under it.
os.environ.setdefault("TRITON_INTERPRET", "0" if os.path.exists("/dev/nvidia0") else "1")


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A tokenizer-only model folder for the fake engine core (scripts/lib/fake_engine.py)."""
    from scripts.lib.fake_engine import write_fake_model

    return write_fake_model(tmp_path_factory.mktemp("fake-model"))


@pytest.fixture(scope="module")
def event_log(tmp_path_factory):
    """Where the fake core appends its 'add ID' / 'abort ID' lines."""
    return tmp_path_factory.mktemp("events") / "events.log"


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from engine.loader.model_files import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def server(request, default_model_path):
    """The real two-process server on the default model (served as "smollm2"), one per module; a
    module adds flags with SERVER_ARGS, or defines its own `server` (the fake-core ones do)."""
    from tests.helpers.server import real_server

    with real_server(default_model_path, *getattr(request.module, "SERVER_ARGS", ())) as s:
        s.start_time = time.time()
        yield s
