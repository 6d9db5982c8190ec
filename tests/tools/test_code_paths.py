"""Every path and module that a comment or docstring names in our code exists: a moved file leaves
no stale pointer behind in the Python and C++ sources (README.md and docs/ are test_doc_paths').

Two kinds of names are checked, in the text of every .py, .cpp and .h file under engine/,
frontend/, ipc/, scripts/ and tests/:
- paths from a top-level folder: `engine/cpu/csrc/decode_stack.cpp`, `engine/worker/`;
- in comments and docstrings, dotted modules of our packages: `engine.worker.step_inputs.to_row_tensors`
  names engine/worker/step_inputs.py (what follows a module is an attribute, not checked).
"""

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "frontend", "ipc", "scripts", "tests")
SOURCES = [p for pkg in PACKAGES for suffix in ("*.py", "*.cpp", "*.h") for p in (ROOT / pkg).rglob(suffix)]
PATH = re.compile(r"(?<![\w./-])((?:engine|frontend|ipc|scripts|tests|docs)/[\w./-]*\.(?:py|cpp|h|md|html|json)|"
                  r"(?:engine|frontend|ipc|scripts|tests|docs)/[\w/-]*/)(?![\w])")
DOTTED = re.compile(r"(?<![\w./-])((?:engine|frontend|ipc)(?:\.[A-Za-z_]\w*)+)")


def path_exists(path: str) -> bool:
    return (ROOT / path).exists()


def module_exists(dotted: str) -> bool:
    """The longest run of packages and a module (or package) that the name starts with exists;
    a name after a package must be one of its modules or be named in its __init__."""
    parts = dotted.split(".")
    where = ROOT / parts[0]
    for i, part in enumerate(parts[1:], start=1):
        if (where / part).is_dir():
            where = where / part
        elif (where / f"{part}.py").exists():
            return True  # a module: the rest are its attributes
        else:
            init = where / "__init__.py"
            return init.exists() and re.search(rf"\b{re.escape(part)}\b", init.read_text()) is not None
    return True


def prose(path: Path, text: str) -> str:
    """A Python file's comments and docstrings (code names variables like `engine.step`); a C++
    file's whole text (its code never spells our dotted modules)."""
    if path.suffix != ".py":
        return text
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return "\n".join(t.string for t in tokens if t.type == tokenize.COMMENT
                     or (t.type == tokenize.STRING and t.string.lstrip("rbfu").startswith(('"""', "'''"))))


def stale_names(path: Path) -> list[str]:
    text = path.read_text(errors="replace")
    names = [p for p in PATH.findall(text) if "*" not in p and not path_exists(p)]
    names += [d for d in DOTTED.findall(prose(path, text)) if not module_exists(d.rstrip("."))]
    return names


def test_the_patterns_find_paths_and_modules():
    assert PATH.findall("see engine/cpu/host.py and engine/worker/ but not xengine/a.py") == [
        "engine/cpu/host.py", "engine/worker/"]
    assert module_exists("engine.worker.step_inputs.to_row_tensors") and module_exists("engine.attention.BACKEND_NAMES")
    assert not module_exists("engine.model_runner") and not module_exists("engine.distributed.executor")
    assert not path_exists("engine/kernels/cpu/decode_stack.cpp")


def test_every_name_in_our_code_exists():
    examples = {Path(__file__).name, "test_doc_paths.py"}  # these two name missing paths on purpose
    missing = [f"{p.relative_to(ROOT)}: {name}" for p in sorted(SOURCES) if p.name not in examples
               for name in stale_names(p)]
    assert missing == []
