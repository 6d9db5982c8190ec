"""Fixtures shared by the model tests: a throwaway model cache for GGUF conversions."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture(scope="session")
def gguf_cache(tmp_path_factory):
    """A cache folder for this session's conversions (each SmolLM2 one is 540 MB). It links
    to the real cache's compiled CPU kernels and inductor code, which take minutes to build."""
    from engine.loader.model_files import cache_dir

    folder = tmp_path_factory.mktemp("tokenloom-cache")
    real_cache = cache_dir()
    for name in {"torch_extensions", "inductor", *(p.name for p in real_cache.glob("*"))} - {"models"}:
        (real_cache / name).mkdir(parents=True, exist_ok=True)
        (folder / name).symlink_to(real_cache / name)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def in_gguf_cache(gguf_cache, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_CACHE", str(gguf_cache))
    return gguf_cache
