"""The import graph of engine/, frontend/ and ipc/ has no circle, and engine/'s rooms stand on floors.

An AST walk: imports inside functions count (a lazy import still ties two modules together);
those under `if TYPE_CHECKING:` do not (they never run). And engine/models/ (what the network
computes) imports nothing of how the CPU runs it (engine/cpu/, engine/kernels/).
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "frontend", "ipc")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _runtime_nodes(tree: ast.AST):
    """Every node but those under `if TYPE_CHECKING:`."""
    pending = [tree]
    while pending:
        node = pending.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            is_type_only = (isinstance(child, ast.If) and isinstance(child.test, ast.Name)
                            and child.test.id == "TYPE_CHECKING")
            if is_type_only:
                pending.extend(child.orelse)
            else:
                pending.append(child)


def _imported(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The known modules a file imports (``from a import b`` names a.b when a.b is a module)."""
    found = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            # the longest known module that the name starts with
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    known = set(files)
    return {
        module: _imported(ast.parse(path.read_text()), module, path.name == "__init__.py", known)
        for module, path in files.items()
    }


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _without_package_parents(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's __init__ re-exporting its submodules is no circle of ours: a submodule's import
    of a sibling names the package first, so edges into a parent package from inside it are dropped."""
    return {
        module: {dep for dep in deps if not module.startswith(dep + ".")}
        for module, deps in graph.items()
    }


def test_no_import_circle():
    assert _circles(_without_package_parents(import_graph())) == []


def test_models_import_nothing_of_the_cpu_wing():
    graph = import_graph()
    offending = {
        module: sorted(dep for dep in deps if dep.startswith(("engine.cpu", "engine.kernels")))
        for module, deps in graph.items()
        if module == "engine.models" or module.startswith("engine.models.")
    }
    assert {module: deps for module, deps in offending.items() if deps} == {}


def test_the_walk_sees_lazy_imports_and_not_type_only_ones():
    tree = ast.parse("from typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from engine import b\n"
                     "def f():\n    from engine.c import thing\n")
    known = {"engine", "engine.a", "engine.b", "engine.c"}
    assert _imported(tree, "engine.a", False, known) == {"engine.c"}
    assert _circles({"engine.a": {"engine.c"}, "engine.c": {"engine.a"}, "engine.b": set()}) == [["engine.a", "engine.c"]]


# engine/'s rooms by floor, lowest first (docs/architecture.md): a room imports only rooms on
# floors below its own. A room is a subpackage of engine/ or a module loose at its root.
FLOORS = (
    ("engine.config", "engine.kernels", "engine.structured_output", "engine.parallel", "engine.core"),
    ("engine.attention",),
    ("engine.models",),
    ("engine.cpu", "engine.lora"),  # the CPU wing and the LoRA layers build on the model interfaces
    ("engine.loader", "engine.sample"),
    ("engine.worker",),
    ("engine.executor", "engine.baselines", "engine.spec_decode"),
    ("engine.loop",),
    ("engine.llm", "engine.simulator"),
    ("engine",),
)
FLOOR_OF = {room: floor for floor, rooms in enumerate(FLOORS) for room in rooms}


def room_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def room_graph() -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {}
    for module, deps in import_graph().items():
        if module.split(".")[0] != "engine":
            continue
        room = room_of(module)
        rooms.setdefault(room, set()).update(
            room_of(dep) for dep in deps if dep.startswith("engine.") and room_of(dep) != room)
    return rooms


def test_every_room_has_a_floor():
    assert set(room_graph()) - set(FLOOR_OF) == set()


def test_no_room_imports_its_own_floor_or_one_above():
    upward = sorted(f"{room} -> {dep}" for room, deps in room_graph().items() for dep in deps
                    if FLOOR_OF[dep] >= FLOOR_OF[room])
    assert upward == []


def test_rooms_form_no_circle_and_stand_at_most_ten_deep():
    graph = room_graph()
    assert _circles(graph) == []

    def depth(room: str) -> int:
        return 1 + max((depth(dep) for dep in graph.get(room, ())), default=0)

    assert max(depth(room) for room in graph) <= 10


def test_core_imports_no_other_room_and_only_the_loop_knows_the_baselines():
    graph = room_graph()
    assert graph["engine.core"] == set()
    importers = {room for room, deps in graph.items() if "engine.baselines" in deps}
    assert importers <= {"engine.loop", "engine.simulator"}  # the simulator steps the baselines' schedulers too


def test_the_cpu_wing_imports_only_the_model_interfaces_below_it():
    assert room_graph()["engine.cpu"] <= {"engine.config", "engine.models", "engine.attention", "engine.parallel"}


def test_a_room_on_its_floor_is_told_apart_from_one_above():
    assert room_of("engine.worker.model_runner") == "engine.worker" and room_of("engine.llm") == "engine.llm"
    assert FLOOR_OF["engine.core"] < FLOOR_OF["engine.worker"] < FLOOR_OF["engine.loop"]
