"""The README stays a front door, its links and commands resolve, and code comments quote no benchmarks.

Fast and model-free: it reads files only. Measurements belong in docs/performance.md (or the
docs/ file of their topic), each with its command; module docstrings and kernel headers say why
the code is the way it is.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 300

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# A measured figure: a number with a time, rate or throughput unit, or a speed-up ratio.
FIGURE = re.compile(r"\d+(?:\.\d+)?\s*(?:ms|µs|GFLOP/s|GB/s|tok/s|tokens/s)\b|\d+(?:\.\d+)?\s*[×x]\s*(?:faster|slower)|\d+\.\d+×")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+)$", text, flags=re.M)}


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [m.group(1) for m in LINK.finditer(text)]


def test_readme_is_short():
    num_lines = len(README.read_text().splitlines())
    assert num_lines <= MAX_README_LINES, f"README.md has {num_lines} lines; move detail into docs/"


def test_every_relative_link_resolves():
    broken = []
    for page in [README, *DOCS]:
        for target in links(page):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (page.parent / file_part).resolve() if file_part else page
            if not resolved.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_readme_commands_exist():
    text = README.read_text()
    missing = [p for p in sorted(set(re.findall(r"scripts/[\w./-]+\.(?:py|sh)", text))) if not (ROOT / p).exists()]
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, flags=re.M))
    missing += [f"make {t}" for t in sorted(set(re.findall(r"\bmake ([\w-]+)", text))) if t not in targets]
    assert not missing, missing


def script_references(text: str) -> list[str]:
    """The scripts a page names: as paths (scripts/peers/bench.sh) and as modules (-m scripts.bench.offline)."""
    paths = re.findall(r"scripts/[\w./-]+\.(?:py|sh)", text)
    modules = [m.replace(".", "/") + ".py" for m in re.findall(r"-m (scripts(?:\.\w+)+)", text)]
    return sorted(set(paths + modules))


def test_every_documented_script_exists():
    missing = [f"{page.name}: {p}" for page in [README, *DOCS, ROOT / "Makefile"]
               for p in script_references(page.read_text()) if not (ROOT / p).exists()]
    assert not missing, missing


def test_readme_flags_exist():
    """Every --flag the README names is declared somewhere in the code."""
    code = "\n".join(p.read_text() for d in ("engine", "frontend", "ipc", "scripts")
                     for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".sh"))
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", README.read_text()))
    missing = sorted(f for f in flags if f not in code and f != "--no-deps")
    assert not missing, missing


def module_docstrings():
    for folder in ("engine", "frontend", "ipc"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            docstring = ast.get_docstring(ast.parse(path.read_text()))
            if docstring:
                yield path, docstring


def leading_comment(path: Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("//") or stripped.startswith("/*") or stripped.startswith("*"):
            lines.append(stripped)
        elif stripped and not stripped.startswith("#pragma"):
            break
    return "\n".join(lines)


def test_no_module_docstring_quotes_a_figure():
    found = [f"{p.relative_to(ROOT)}: {m.group(0)!r}" for p, d in module_docstrings() for m in FIGURE.finditer(d)]
    assert not found, "measurements belong in docs/performance.md:\n" + "\n".join(found)


def test_no_kernel_header_quotes_a_figure():
    kernels = ROOT / "engine" / "cpu" / "csrc"
    found = [f"{p.relative_to(ROOT)}: {m.group(0)!r}"
             for p in sorted([*kernels.glob("*.cpp"), *kernels.glob("*.h")])
             for m in FIGURE.finditer(leading_comment(p))]
    assert not found, "measurements belong in docs/cpu-kernels.md or docs/performance.md:\n" + "\n".join(found)


def test_slug_is_githubs():
    assert slug("Client → frontend") == "client--frontend"
    assert slug("Example (Python, without the client class)") == "example-python-without-the-client-class"
    assert slug("`torch.compile` on the CPU") == "torchcompile-on-the-cpu"
