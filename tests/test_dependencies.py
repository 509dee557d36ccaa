"""Declared dependencies are used or gone (issue 41): every package of ``pyproject.toml``'s ``dependencies`` is
imported by ``loopq`` (or listed below with what uses it), and every third-party module the package or the tests
import is declared (``dependencies`` or the ``dev`` extra)."""

import ast
import re
import sys

import tomllib

from loopq.paths import REPO_ROOT

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
#: distribution name -> import name, where they differ
IMPORT_NAME = {"pyyaml": "yaml"}
#: declared but never imported by name: what uses them
USED_WITHOUT_IMPORT = {
    "tensorboard": "Lightning's default TensorBoardLogger, which loopq.fit keeps beside its CSV logs",
}


def declared(specs: list[str]) -> set[str]:
    """Distribution names of requirement strings (``lm_eval[hf]==0.4.13`` -> ``lm_eval``)."""
    return {re.match(r"[A-Za-z0-9_.-]+", spec).group(0).lower().replace("-", "_") for spec in specs}


def top_level_imports(root) -> set[str]:
    found: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


def third_party(modules: set[str]) -> set[str]:
    return {m for m in modules if m not in sys.stdlib_module_names and m not in ("loopq", "tests", "callbacks")}


def test_the_name_parser_on_a_hand_case():
    assert declared(["lm_eval[hf]==0.4.13", "jsonargparse[signatures]>=4.40,<5", "torch>=2.11"]) == {
        "lm_eval",
        "jsonargparse",
        "torch",
    }


def test_every_declared_dependency_is_used():
    imported = top_level_imports(REPO_ROOT / "loopq") | top_level_imports(REPO_ROOT / "callbacks")
    unused = [
        name
        for name in sorted(declared(PYPROJECT["dependencies"]))
        if IMPORT_NAME.get(name, name) not in imported and name not in USED_WITHOUT_IMPORT
    ]
    assert unused == [], f"declared in pyproject.toml but never imported by loopq: {unused}"


def test_every_imported_third_party_module_is_declared():
    names = declared(PYPROJECT["dependencies"]) | declared(PYPROJECT["optional-dependencies"]["dev"])
    allowed = {IMPORT_NAME.get(name, name) for name in names}
    package = third_party(top_level_imports(REPO_ROOT / "loopq") | top_level_imports(REPO_ROOT / "callbacks"))
    tests = third_party(top_level_imports(REPO_ROOT / "tests"))
    # a package that another dependency happens to install (torch brings numpy) must still be declared if imported
    missing = sorted(m for m in package | tests if m not in allowed)
    assert missing == [], f"imported but not declared in pyproject.toml: {missing}"
