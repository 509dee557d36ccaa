"""The package's import structure (docs/architecture.md): no import circle between modules, and no module imports
from a layer above its own. Imports are read from the source, including those inside functions."""

import ast
from collections import defaultdict

from loopq.paths import REPO_ROOT

PACKAGE = REPO_ROOT / "loopq"

#: ``python -m loopq.<name>`` entry points: ``loopq/<name>.py`` runs the ``main`` of ``loopq.commands.<command>``
ENTRY_POINTS: dict[str, str] = {
    **{name: name for name in ("evaluate", "examine", "experiments", "export", "fit", "generate", "pretrain")},
    **{name: name for name in ("run", "stress", "testbed")},
    "eval": "harness",
    "gpu_check": "gpu_check.run_checks",
    "report": "report.write_report",
}

#: top-level parts of ``loopq`` by layer, from the ground up (a part may import its own layer and those below)
LAYERS: list[set[str]] = [
    {
        "errors",
        "paths",
        "files",
        "locks",
        "provenance",
        "qspec",
        "stats",
        "stages",
        "devices",
        "numerics",
        "config_yaml",
    },
    {"models", "kernels"},
    {"quant", "data"},
    {"calib", "artifacts"},
    {"planning"},
    {"metrics"},
    {"commands"},
    set(ENTRY_POINTS),
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


def test_an_entry_point_only_runs_its_command():
    """``loopq/<name>.py`` holds a docstring, the import of its command's ``main`` (and ``run_cli``) and the
    ``__main__`` guard: nothing of the command lives there, and nothing imports it."""
    for name, command in ENTRY_POINTS.items():
        tree = ast.parse((PACKAGE / f"{name}.py").read_text())
        imported = {
            (node.module, alias.name) for node in tree.body if isinstance(node, ast.ImportFrom) for alias in node.names
        }
        assert (f"loopq.commands.{command}", "main") in imported, name
        assert imported <= {(f"loopq.commands.{command}", "main"), ("loopq.errors", "run_cli")}, name
        kinds = [type(node).__name__ for node in tree.body]
        assert kinds[0] == "Expr" and kinds[-1] == "If" and set(kinds[1:-1]) <= {"ImportFrom", "FunctionDef"}, name
    _, graph = imports()
    importers = {a for a, targets in graph.items() for b in targets if part(b) in ENTRY_POINTS and part(a) != part(b)}
    assert importers == set()


def test_no_two_modules_share_a_name_and_none_is_named_after_the_standard_library():
    """Every module's own name (a package's folder name) is unique across the package, entry points aside (each is
    named after its command on purpose), and none is a standard-library module's (``loopq.inspect`` was)."""
    import sys

    names = defaultdict(list)
    for path in PACKAGE.rglob("*.py"):
        name = path.parent.name if path.stem == "__init__" else path.stem
        if (
            path.stem == "__main__"
            or (path.parent == PACKAGE and name in ENTRY_POINTS)
            or path == PACKAGE / "__init__.py"
        ):
            continue
        names[name].append(str(path.relative_to(PACKAGE)))
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}
    assert sorted(set(names) & set(sys.stdlib_module_names)) == []


def test_bit_widths_are_spelled_only_in_qspec():
    """Issue 40: which bit widths exist and which the kernels run is ``loopq.qspec``'s (``SUPPORTED_BITS``,
    ``KERNEL_WEIGHT_BITS``, ``KERNEL_ACT_BITS``); no other module checks a ``*bits`` name against a literal set of
    widths (``a_bits not in (4, 8)``) - they import those names. A branch on one width (``bits == 4``: nibble
    packing) is a dispatch, not a support list."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "qspec.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare) or not isinstance(node.left, ast.Name | ast.Attribute):
                continue
            name = node.left.id if isinstance(node.left, ast.Name) else node.left.attr
            if not name.endswith("bits") or not isinstance(node.ops[0], ast.In | ast.NotIn):
                continue
            right = node.comparators[0]
            widths = [e.value for e in getattr(right, "elts", []) if isinstance(e, ast.Constant)]
            if len([w for w in widths if isinstance(w, int)]) >= 2:
                found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
    assert not found, f"bit widths spelled outside loopq/qspec.py: {found}"
