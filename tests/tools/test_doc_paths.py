"""Every repository path that README.md and docs/*.md name exists: a renamed or deleted file
leaves no stale pointer behind. A path is a backticked or linked name that starts at one of the
repository's top-level folders (engine/, frontend/, ipc/, scripts/, tests/, docs/, ...);
`ipc/sockets.send_message` names ipc/sockets.py. results/ is what the benchmarks write (ignored
by git), so paths under it are not checked."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP_LEVEL = ("docs", "engine", "frontend", "ipc", "scripts", "tests")
# `engine/cpu/packing.py`, `scripts/bench/`, [text](docs/models.md#gguf-files), engine/cpu/csrc/x.cpp's
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*[\w/])" % "|".join(map(re.escape, TOP_LEVEL)))


def named_paths(text: str) -> set[str]:
    found = set()
    for quoted in re.findall(r"`([^`\n]+)`|\]\(([^)\s#]+)", text):
        for candidate in filter(None, quoted):
            found.update(PATH.findall(candidate))
    return found


def test_the_pattern_finds_paths_in_code_spans_and_links():
    text = "see `engine/cpu/host.py` and [docs](docs/models.md#gguf-files), not engine/x.py bare"
    assert named_paths(text) == {"engine/cpu/host.py", "docs/models.md"}
    assert exists("ipc/sockets.send_message") and exists("engine/cpu/") and not exists("frontend/request_checks.py")


def exists(path: str) -> bool:
    """The file or folder, or for `folder/module.name` the module's file."""
    if (ROOT / path).exists():
        return True
    module, _, attribute = path.rpartition(".")
    return bool(attribute) and "/" in module and (ROOT / f"{module}.py").exists()


def test_every_named_path_exists():
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for path in sorted(named_paths(doc.read_text())):
            if "*" not in path and "{" not in path and not exists(path):
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert missing == []
