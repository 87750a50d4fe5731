"""The package's dependencies run one way: its import graph, imports inside functions included, has no circle.

Every `import` and `from ... import` anywhere in a module (at the top, inside a function, under a condition) is an
edge, as is `importlib.import_module("hf_moe....")` with a literal name: a lazy import that breaks a circle at run
time is still a circle in the design. Importing a module of a subpackage runs that subpackage's `__init__`, so it
is an edge to the subpackage too. The package root only re-exports: it may import anything, and nothing in the
package may import it (each module imports what it uses from where it lives). `hf_moe_cli.py`, the top-level
parser behind `hf-moe`, belongs to the graph too.

The graph also runs one way: `FLOORS`, the package bottom to top as docs/architecture.md lists it, and a module
imports only modules on its own floor or below (a subpackage's floor holds all its modules). An import up a floor
fails, naming both modules and their floors: move the module, there is no list of exceptions.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOT = "hf_moe"
MAX_LINES = 600
COMPILED = {"hf_moe._C"}  # the C++ extension when built ahead of time (HF_MOE_BUILD_EXT=1): a module with no .py
# The package bottom to top (docs/architecture.md, "The package, bottom to top", lists the same, in the same order).
# A name is a module or a subpackage (all its modules), relative to hf_moe; hf_moe_cli is the top-level parser.
FLOORS = [
    ["version", "compat", "losses", "profiling", "memory", "inputs", "huge_pages", "dense_mlp", "layerwise"],
    ["forkserver"],
    ["ops"],
    ["layers"],
    ["configuration"],
    ["routing"],
    ["model_card"],
    ["checkpoint"],
    ["parallel"],
    ["offload"],
    ["decode_native", "decode_one_op", "decode", "generation"],
    ["backbone"],
    ["modeling"],
    ["auto"],
    ["convert"],
    ["shrink"],
    ["quantize"],
    ["export", "export_files", "export_verify"],
    ["training"],
    ["inspect", "env"],
    ["gpu_check"],
    ["commands"],
    ["hf_moe_cli"],
    ["cli"],
]


def _modules() -> dict[str, Path]:
    modules = {}
    for path in (REPO / ROOT).rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    modules["hf_moe_cli"] = REPO / "hf_moe_cli.py"
    return modules


def imported_names(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every dotted name module `name` (at `path`) imports: `from x import m` names x.m when m is a module, else x."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:  # `from . import module` imports the module; `from . import name`, the package
                targets.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target)
        elif isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            targets.add(node.args[0].value)
    return targets


def import_graph() -> dict[str, set[str]]:
    """{module: the modules of the package it imports}, read from the source (nothing is imported)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        targets = imported_names(name, path, modules)
        edges = set()
        for target in targets:
            parts = target.split(".")
            # the module itself, and the subpackages whose __init__ importing it runs (not the root)
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix == ROOT:  # only an import of the root itself (or of a name it defines) is an edge to it
                    if target == ROOT:
                        edges.add(ROOT)
                elif prefix in modules and prefix != name and not name.startswith(prefix + "."):
                    edges.add(prefix)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_circle():
    graph = import_graph()
    assert len(graph) > 50  # the walker found the package
    assert cycles(graph) == []


def test_nothing_in_the_package_imports_its_root():
    graph = import_graph()
    assert sorted(name for name, edges in graph.items() if ROOT in edges and name != ROOT) == []


def test_the_walker_sees_lazy_imports_and_subpackage_inits():
    """The walker itself: a circle made only of an import inside a function, or through a subpackage's __init__,
    is found."""
    graph = {"a": {"b"}, "b": set(), "c.x": {"c"}, "c": {"c.y"}, "c.y": {"c.x"}}
    assert cycles(graph) == [["c", "c.x", "c.y"]]
    assert cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]
    real = import_graph()
    assert "hf_moe.commands" in real["hf_moe_cli"]  # a top-level module's import inside a function
    assert "hf_moe.ops.reference" in real["hf_moe.ops"]  # `from . import reference`
    assert {"hf_moe.checkpoint", "hf_moe.checkpoint.commit"} <= real["hf_moe.export"]  # `.checkpoint.commit` runs
    assert "hf_moe.checkpoint" not in real["hf_moe.checkpoint.save"]  # ... the __init__ of another package only


def test_no_module_is_over_600_lines():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def floor_of(module: str, floors: list[list[str]] = FLOORS) -> int | None:
    """The index in `floors` of the floor holding `module` (the longest name that is it or a package above it)."""
    found, length = None, -1
    for index, names in enumerate(floors):
        for name in names:
            full = name if name == "hf_moe_cli" else f"{ROOT}.{name}"
            if (module == full or module.startswith(full + ".")) and len(full) > length:
                found, length = index, len(full)
    return found


def upward_imports(graph: dict[str, set[str]], floors: list[list[str]] = FLOORS) -> list[str]:
    """Each import of `graph` that runs up a floor, as a sentence naming both modules and their floors."""

    def named(index: int) -> str:
        return f"floor {index} ({' '.join(floors[index])})"

    found = []
    for module in sorted(graph):
        here = floor_of(module, floors)
        for target in sorted(graph[module]):
            there = floor_of(target, floors)
            if here is not None and there is not None and there > here:
                found.append(f"{module} on {named(here)} imports {target} on {named(there)}, a floor above it")
    return found


def test_every_module_has_a_floor():
    """A new module is placed on a floor here and in docs/architecture.md (the root only re-exports: no floor)."""
    assert sorted(name for name in import_graph() if name != ROOT and floor_of(name) is None) == []


def test_no_import_runs_up_a_floor():
    assert upward_imports(import_graph()) == []


def test_the_floor_check_names_an_upward_import():
    """The check itself, on a made-up graph: a module importing one on a higher floor, in a function or not (the
    walker sees both), is named with both floors; one on its own floor or below is not."""
    floors = [["compat"], ["checkpoint"], ["modeling"]]
    graph = {"hf_moe.compat": set(), "hf_moe.checkpoint.checks": {"hf_moe.modeling", "hf_moe.compat"},
             "hf_moe.checkpoint.load": {"hf_moe.checkpoint.checks"}, "hf_moe.modeling": {"hf_moe.checkpoint"}}
    assert upward_imports(graph, floors) == [
        "hf_moe.checkpoint.checks on floor 1 (checkpoint) imports hf_moe.modeling on floor 2 (modeling), a floor "
        "above it"
    ]
    assert floor_of("hf_moe.checkpoint.adapter_experts") == floor_of("hf_moe.checkpoint")
    assert floor_of("hf_moe_cli") == len(FLOORS) - 2 and floor_of("hf_moe") is None


def test_the_floors_are_those_of_the_architecture_page():
    """docs/architecture.md lists the floors, one a line of its layout block (the names ending in .py or / at the
    start of the line, one space apart, two or more before the description; a description's next lines are indented
    further): the same names in the same order as FLOORS."""
    text = (REPO / "docs" / "architecture.md").read_text()
    block = text.split("## The package, bottom to top", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    listed = []
    for line in block.splitlines():
        if line.startswith("   "):  # a description continued
            continue
        words = re.split(r"\s{2,}", line.strip())[0].split()  # (two spaces or more end the names)
        names = [w.removesuffix(".py").removesuffix("/") for w in words if w.endswith((".py", "/"))]
        if names and names != [ROOT]:  # (the package's own line, hf_moe/, heads the block)
            listed.append(names)
    assert listed == FLOORS


def test_every_import_of_the_package_names_a_module_that_exists():
    """An import of a module that moved away (`from .adapters import x` after adapters.py left convert/) is no
    edge of the graph, so the checks above cannot see it; it fails only when its function runs."""
    modules = _modules()
    missing = sorted(
        f"{name} imports {target}"
        for name, path in modules.items()
        for target in imported_names(name, path, modules)
        if target.split(".")[0] == ROOT and target not in modules and target not in COMPILED
    )
    assert missing == []
