"""scripts/ has no import circle either, and scripts/lib is its floor (#55 item 7).

The same AST walk as tests/unit/test_import_graph.py (lazy imports count, `if TYPE_CHECKING:`
ones do not), over scripts/: benchmarks may build on one another (static on offline), but
never both ways, and what two of them share lives in scripts/lib, which imports nothing of
the folders above it.
"""
import ast

from tests.unit.test_import_graph import ROOT, _circles, _imported, _module_name, _without_package_parents


def scripts_graph() -> dict[str, set[str]]:
    """scripts/'s modules and the modules of scripts/ each imports."""
    files = {_module_name(p): p for p in (ROOT / "scripts").rglob("*.py")}
    known = set(files)
    return {module: _imported(ast.parse(path.read_text()), module, path.name == "__init__.py", known)
            for module, path in files.items()}


def test_scripts_have_no_import_circle():
    graph = scripts_graph()
    assert len(graph) > 50 and "scripts.bench.speculative" in graph  # the walk found scripts/
    assert _circles(_without_package_parents(graph)) == []


def test_scripts_lib_imports_nothing_above_it():
    graph = scripts_graph()
    upward = {module: sorted(dep for dep in deps if dep != "scripts" and not dep.startswith("scripts.lib"))
              for module, deps in graph.items() if module.startswith("scripts.lib.")}
    assert {module: deps for module, deps in upward.items() if deps} == {}


def test_the_walk_sees_a_circle_through_a_lazy_import():
    # the shape the speculative benchmark had: a top-level import one way, a lazy one back
    known = {"scripts.bench.a", "scripts.bench.b"}
    a = ast.parse("from scripts.bench.b import helper\n")
    b = ast.parse("def main():\n    from scripts.bench.a import run\n")
    graph = {"scripts.bench.a": _imported(a, "scripts.bench.a", False, known),
             "scripts.bench.b": _imported(b, "scripts.bench.b", False, known)}
    assert _circles(graph) == [["scripts.bench.a", "scripts.bench.b"]]
