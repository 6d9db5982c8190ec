"""Import boundaries. The frontend, and the text logic it shares with the offline API
(`ipc.text`), must never import torch, not even through transformers: checked in fresh
interpreters. The engine and the frontend meet only in `ipc`: neither imports the other,
checked by parsing every module's imports. The scripts are packages run with `python -m`: they
import nothing from tests/ and never edit sys.path."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT

TORCH_FREE_MODULES = ["frontend", "frontend.api_server", "frontend.client", "frontend.cli", "frontend.engine_client",
                      "frontend.ray_engines", "ipc.ray_cluster",
                      "frontend.local_socket", "frontend.model_folder", "ipc", "ipc.text", "ipc.text.tokenizer",
                      "ipc.text.stop_checker", "ipc.text.hold_back",
                      "ipc.text.output_processor"]


@pytest.mark.parametrize("module", TORCH_FREE_MODULES)
def test_import_keeps_torch_out(module):
    code = (f"import sys, {module}; "
            "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules); "
            "assert not heavy, heavy")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_every_ipc_text_module_is_checked():
    modules = {f"ipc.text.{p.stem}" for p in (REPO_ROOT / "ipc" / "text").glob("*.py") if p.stem != "__init__"}
    assert modules <= set(TORCH_FREE_MODULES)


def test_loading_a_tokenizer_keeps_torch_out(tmp_path):
    code = ("import sys; from scripts.lib.fake_engine import write_fake_model; "
            "from pathlib import Path; from frontend.model_folder import load_tokenizer; "
            f"tok = load_tokenizer(str(write_fake_model(Path({str(tmp_path)!r})))); "
            "tok.encode_chat([{'role': 'user', 'content': 'hi'}]); "
            "assert 'torch' not in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def imported_packages(path: Path) -> set[str]:
    """The top-level package of every module `path` imports, lazy imports inside functions included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package, forbidden", [("engine", "frontend"), ("frontend", "engine"),
                                                ("ipc", "engine"), ("ipc", "frontend"), ("scripts", "tests")])
def test_packages_do_not_import_each_other(package, forbidden):
    offenders = sorted(str(path.relative_to(REPO_ROOT)) for path in (REPO_ROOT / package).rglob("*.py")
                       if forbidden in imported_packages(path))
    assert not offenders, f"{offenders} import {forbidden}"


def test_scripts_do_not_edit_sys_path():
    offenders = sorted(str(path.relative_to(REPO_ROOT)) for path in (REPO_ROOT / "scripts").rglob("*.py")
                       if "sys.path" in path.read_text(encoding="utf-8"))
    assert not offenders, f"{offenders} edit sys.path; run them with python -m from the repository root"
