"""Kernel builds: a killed build no longer hangs every later engine start (engine.cpu.build_lock),
checkouts with the same kernels share one build (engine.cpu.extension.copy_sources), as do
caches reached through a link, and
without kernels their users fall back to torch through one helper (load_cpu_kernels_or_none)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from engine.cpu.build_lock import TORCH_LOCK_NAME, exclusive_build
from tests.helpers import REPO_ROOT


# A build that takes the flock, leaves torch's lock file as a build in progress does, and hangs.
HOLDER = """
import sys, time
from pathlib import Path
from engine.cpu.build_lock import exclusive_build
with exclusive_build(Path(sys.argv[1])):
    (Path(sys.argv[1]) / "lock").touch()
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_lock_file_left_by_a_dead_build_is_removed(tmp_path):
    (tmp_path / TORCH_LOCK_NAME).touch()  # a build killed before torch could delete it
    with exclusive_build(tmp_path):
        assert not (tmp_path / TORCH_LOCK_NAME).exists()


def test_waits_for_a_live_build_then_takes_over_when_it_is_killed(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              cwd=REPO_ROOT, env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"})
    try:
        assert holder.stdout.readline().strip() == "held"
        acquired = threading.Event()
        lock_seen_inside: list[bool] = []

        def build() -> None:
            with exclusive_build(tmp_path):
                lock_seen_inside.append((tmp_path / TORCH_LOCK_NAME).exists())
                acquired.set()

        thread = threading.Thread(target=build, daemon=True)
        thread.start()
        time.sleep(0.5)
        assert not acquired.is_set()  # the live build's lock file is left alone while it runs
        assert (tmp_path / TORCH_LOCK_NAME).exists()
        holder.kill()  # killed mid-build: its lock file stays, its flock goes
        assert acquired.wait(timeout=10)
        assert lock_seen_inside == [False]
        thread.join(timeout=5)
    finally:
        holder.kill()
        holder.wait()


def test_sources_are_compiled_from_one_copy_whichever_checkout_asks(tmp_path):
    """Two checkouts with the same kernels hand ninja the same paths, so neither rebuilds the other's build."""
    from engine.cpu.extension import HEADERS, SOURCES, copy_sources

    folder = tmp_path / "src"
    copies = copy_sources(SOURCES + HEADERS, folder)
    assert [c.parent for c in copies] == [folder] * len(copies)
    assert all(c.read_bytes() == s.read_bytes() for c, s in zip(copies, SOURCES + HEADERS))
    mtimes = [c.stat().st_mtime_ns for c in copies]
    other_checkout = tmp_path / "other"
    other_checkout.mkdir()
    moved = [other_checkout / s.name for s in SOURCES + HEADERS]
    for source, path in zip(SOURCES + HEADERS, moved):
        path.write_bytes(source.read_bytes())
    assert copy_sources(moved, folder) == copies
    assert [c.stat().st_mtime_ns for c in copies] == mtimes  # the same bytes: untouched, nothing to rebuild
    moved[0].write_bytes(moved[0].read_bytes() + b"\n// changed\n")
    copy_sources(moved, folder)
    assert copies[0].read_bytes().endswith(b"// changed\n")


def test_no_kernel_source_includes_the_whole_cpp_frontend():
    """<torch/extension.h> tripled each translation unit's compile (engine/cpu/extension.py)."""
    sources = sorted((REPO_ROOT / "engine" / "cpu" / "csrc").rglob("*.[ch]*"))
    assert len(sources) > 20
    offenders = [str(s.relative_to(REPO_ROOT)) for s in sources if "<torch/extension.h>" in s.read_text()]
    assert not offenders, offenders


def test_a_cache_reached_through_a_link_builds_in_the_same_place(tmp_path, monkeypatch):
    """The tests' throwaway caches link the real cache's torch_extensions: through the link, ninja
    must see the same paths, or it rebuilds every kernel (and again on the next plain start)."""
    import torch.utils.cpp_extension

    import engine.cpu.extension as cpu_extension

    real = tmp_path / "real"
    (real / "torch_extensions").mkdir(parents=True)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "torch_extensions").symlink_to(real / "torch_extensions")
    seen = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kwargs: seen.append(kwargs))
    for cache in (real, linked):
        monkeypatch.setenv("TOKENLOOM_CACHE", str(cache))
        cpu_extension.load_extension("probe", cpu_extension.SOURCES[:1], cpu_extension.HEADERS)
    assert seen[0]["build_directory"] == seen[1]["build_directory"]
    assert seen[0]["sources"] == seen[1]["sources"]
    assert seen[1]["build_directory"].startswith(str(real.resolve()))


def test_without_kernels_attention_fused_ops_and_sampling_fall_back_to_torch(monkeypatch, caplog):
    """A machine that cannot build the kernels (no compiler): every user of them takes the torch path, with a warning."""
    import logging

    import torch

    import engine.cpu.extension as cpu_extension
    from engine.worker.attention_choice import resolve_attention_backend
    from engine.cpu.host import CpuFeatures
    from engine.cpu.fused import select_fused_ops

    def no_compiler():
        raise RuntimeError("c++: command not found")

    monkeypatch.setattr(cpu_extension, "load_cpu_kernels", no_compiler)
    with caplog.at_level(logging.WARNING, logger="engine.cpu.extension"):
        assert resolve_attention_backend(None, "cpu", torch.float32, CpuFeatures(has_avx512_bf16=True)) == "torch"
        assert select_fused_ops(torch.device("cpu"), "torch", is_compiled=False) is None
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["attention runs the torch backend: no CPU kernels (c++: command not found)",
                        "fused CPU ops off, the torch ops run: no CPU kernels (c++: command not found)"]


def test_venvs_linked_to_one_get_builds_of_their_own(monkeypatch):
    """ninja's command lines name torch's headers by the venv's own path (a worktree's .venv link):
    two such venvs sharing one build folder would rebuild every kernel over each other, on every start."""
    import torch

    import engine.cpu.extension as cpu_extension

    sources = cpu_extension.SOURCES[:1]
    keys = []
    for venv in ("/work/a/.venv", "/work/b/.venv"):
        monkeypatch.setattr(torch, "__file__", f"{venv}/lib/python3.11/site-packages/torch/__init__.py")
        keys.append(cpu_extension._sources_key(sources))
    assert keys[0] != keys[1]
    assert cpu_extension._sources_key(sources) == keys[1]  # and the same venv keeps its key
