"""No engine, frontend, ipc or scripts module is over 350 lines: one concept per file, split past
that (the brief's rule, kept by a test so that the file that crosses it is split when it does)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "frontend", "ipc", "scripts")
MAX_LINES = 350
# Known exceptions, pending: scripts/hostile/ and scripts/soak/ were being edited on another
# branch (faults-routes) when scripts/ came under the rule (#55 item 7). Remove each once that
# branch is merged and the file is split; the test fails on an entry that is no longer over.
PENDING_SPLIT_ELSEWHERE = {"scripts/hostile/fuzz.py"}


def num_lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def module_sizes() -> dict[str, int]:
    return {str(p.relative_to(ROOT)): num_lines(p) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def test_no_module_is_over_the_limit():
    sizes = module_sizes()
    assert len(sizes) > 100  # the walk found the packages
    assert sum(path.startswith("scripts/") for path in sizes) > 50  # and scripts/
    over = {path: n for path, n in sizes.items() if n > MAX_LINES and path not in PENDING_SPLIT_ELSEWHERE}
    assert not over, f"split these (over {MAX_LINES} lines): {over}"


def test_every_pending_exception_is_still_over_the_limit():
    sizes = module_sizes()
    stale = sorted(path for path in PENDING_SPLIT_ELSEWHERE if sizes.get(path, 0) <= MAX_LINES)
    assert not stale, f"no longer over {MAX_LINES} lines (or gone): remove from PENDING_SPLIT_ELSEWHERE: {stale}"


def test_the_count_is_lines_not_bytes(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("a = 1\n" * (MAX_LINES + 1))
    assert num_lines(path) == MAX_LINES + 1
