"""No engine, frontend, ipc or scripts module is over 350 lines: one concept per file, split past
that (the brief's rule, kept by a test so that the file that crosses it is split when it does)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "frontend", "ipc", "scripts")
MAX_LINES = 350


def num_lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def module_sizes() -> dict[str, int]:
    return {str(p.relative_to(ROOT)): num_lines(p) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def test_no_module_is_over_the_limit():
    sizes = module_sizes()
    assert len(sizes) > 100  # the walk found the packages
    assert sum(path.startswith("scripts/") for path in sizes) > 50  # and scripts/
    over = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert not over, f"split these (over {MAX_LINES} lines): {over}"


def test_the_count_is_lines_not_bytes(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("a = 1\n" * (MAX_LINES + 1))
    assert num_lines(path) == MAX_LINES + 1
