"""The package's import structure (docs/architecture.md): no import circle between modules, and no module imports
from a layer above its own. Imports are read from the source, including those inside functions."""

import ast
from collections import defaultdict

from loopq.paths import REPO_ROOT

PACKAGE = REPO_ROOT / "loopq"

#: top-level parts of ``loopq`` by layer, from the ground up (a part may import its own layer and those below)
LAYERS: list[set[str]] = [
    {"errors", "paths", "files", "locks", "provenance", "qspec", "stats", "stages", "devices"},
    {"models", "kernels"},
    {"quant", "data"},
    {"calib", "callbacks", "artifacts"},
    {"guards", "regime", "plan"},
    {"eval"},
    {
        "evaluate",
        "export",
        "report",
        "fit",
        "run",
        "experiments",
        "testbed",
        "pretrain",
        "stress",
        "gpu_check",
        "generate",
        "inspect",
    },
]
LAYER_OF = {part: i for i, parts in enumerate(LAYERS) for part in parts}


def module_name(path):
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports():
    """module -> the ``loopq`` modules it imports (``from loopq.x import y`` names module ``loopq.x.y`` when that
    is a module, else ``loopq.x``)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "loopq":
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    graph[name].add(target if target in modules else node.module)
            elif isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names if a.name.split(".")[0] == "loopq")
    return modules, graph


def part(module):
    return module.split(".")[1] if "." in module else ""


def test_every_part_of_the_package_has_a_layer():
    modules, _ = imports()
    assert {part(m) for m in modules if part(m)} <= set(LAYER_OF)


def test_no_module_imports_from_a_layer_above_its_own():
    _, graph = imports()
    upward = [
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if part(a) and part(b) and LAYER_OF[part(b)] > LAYER_OF[part(a)]
    ]
    assert upward == []


def test_no_import_circle_between_modules():
    modules, graph = imports()
    state: dict[str, int] = {}
    circles = []

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt not in modules or nxt == node or nxt == "loopq":
                continue
            if nxt.startswith(node + "."):  # a package importing its own submodules (re-exports)
                continue
            if state.get(nxt) == 1:
                circles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for name in sorted(modules):
        if name not in state:
            visit(name, [name])
    assert circles == []
