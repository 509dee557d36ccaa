"""YAML configs read safely: bounded alias expansion, duplicate keys refused.

Every YAML a LoopQ command reads as settings - ``--config`` files and the YAML/JSON values of options, parsed by
jsonargparse for ``loopq.fit``, ``loopq.run`` and ``loopq.pretrain`` - goes through :func:`check_yaml` first:
:func:`loopq.errors.check_config_files` applies it to each ``--config`` file by name, :func:`check_arguments` to each
structured command-line value by option (jsonargparse reads those through several internal paths), and
:func:`install` puts it in front of jsonargparse's registered YAML loader (config files a config names). Two things
plain YAML allows are refused, with one line naming the file (or ``option value``), the key and its line:

* **Alias bombs.** An alias (``*a``) reuses an anchored node (``&a``) without copying it, so a kilobyte of nested
  aliases describes 10^9 nodes; jsonargparse then copies and walks the expanded tree (52 s and 4.2 GB before a
  traceback for nine levels of ten). The size of the expanded tree is counted on the composed node graph, each
  distinct node once (linear in the file), and a config expanding to more than :data:`MAX_NODES` nodes is refused.
* **Duplicate keys.** YAML keeps the last of two equal keys in one mapping, silently: a second ``lr:`` further down
  replaces the first without a word. Any repeated key in one mapping is refused.
"""

from __future__ import annotations

from typing import Any

import yaml

#: expanded nodes a settings file may describe (the largest shipped config has a few hundred)
MAX_NODES = 100_000


class ConfigYAMLError(yaml.YAMLError):
    """A YAML config LoopQ refuses to read (alias bomb, duplicate key); the message names the source and the key."""


def _loader_class() -> type:
    from jsonargparse._loaders_dumpers import get_yaml_default_loader

    return get_yaml_default_loader()


def expanded_size(node: yaml.Node, memo: dict[int, int], limit: int) -> int:
    """Nodes in the tree ``node`` stands for once every alias is expanded; each distinct node is sized once
    (``memo``), and counting stops past ``limit``."""
    key = id(node)
    if key in memo:
        return memo[key]
    memo[key] = limit + 1  # a node reached again while being sized is a recursive alias: unbounded
    children: list[yaml.Node] = []
    if isinstance(node, yaml.SequenceNode):
        children = list(node.value)
    elif isinstance(node, yaml.MappingNode):
        children = [part for pair in node.value for part in pair]
    total = 1
    for child in children:
        total += expanded_size(child, memo, limit)
        if total > limit:
            break
    memo[key] = min(total, limit + 1)
    return memo[key]


def duplicate_key(node: yaml.Node, seen: set[int] | None = None) -> yaml.Node | None:
    """The first key node that repeats an earlier key of the same mapping, anywhere under ``node``; None if none."""
    seen = set() if seen is None else seen
    if id(node) in seen:
        return None
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        keys: set[tuple[str, str]] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.value != "<<":
                ident = (key_node.tag, key_node.value)
                if ident in keys:
                    return key_node
                keys.add(ident)
    children = node.value if isinstance(node, (yaml.SequenceNode, yaml.MappingNode)) else []
    for child in children:
        for part in child if isinstance(child, tuple) else (child,):
            found = duplicate_key(part, seen)
            if found is not None:
                return found
    return None


def check_yaml(text: str, source: str) -> None:
    """Refuse ``text`` (from ``source``: a file or an option) if it expands past :data:`MAX_NODES` nodes or repeats a
    key within a mapping (module docstring). Syntax errors are left to the reader, which names the line."""
    loader = _loader_class()(text)
    try:
        node = loader.get_single_node()
    except yaml.YAMLError:
        return
    finally:
        loader.dispose()
    if node is None:
        return
    if expanded_size(node, {}, MAX_NODES) > MAX_NODES:
        raise ConfigYAMLError(
            f"{source}: its aliases (*name) expand to more than {MAX_NODES:,} settings; refused (an alias bomb?) - "
            "write the settings out, or use fewer nested aliases"
        )
    duplicate = duplicate_key(node)
    if duplicate is not None:
        raise ConfigYAMLError(
            f"{source}: key {duplicate.value!r} appears twice in one mapping (line {duplicate.start_mark.line + 1}); "
            "YAML would silently keep the last - remove one"
        )


def check_arguments(argv: list[str]) -> None:
    """:func:`check_yaml` on every command-line value that holds YAML structure (a flow collection, an anchor or
    alias, a line break), named by its option; a refusal is a :class:`ConfigYAMLError` (a user error of
    :mod:`loopq.errors`, which imports this module: this one imports nothing of ``loopq``)."""
    option = "a command-line value"
    for arg in argv:
        name, eq, inline = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        value = inline if eq or not arg.startswith("--") else ""
        if value and (value.lstrip()[:1] in ("{", "[") or any(mark in value for mark in ("&", "*", "\n"))):
            check_yaml(value, f"{name or option} value")
        option = arg if arg.startswith("--") and not eq else "a command-line value"


def checked_yaml_load(stream: str) -> Any:
    """jsonargparse's YAML loader behind :func:`check_yaml`."""
    from jsonargparse._loaders_dumpers import yaml_load

    if isinstance(stream, str):
        check_yaml(stream, "a YAML config or option value")
    return yaml_load(stream)


def install(argv: list[str] | None = None) -> None:
    """Check the command line's values (:func:`check_arguments`; ``argv`` default ``sys.argv[1:]``) and make
    jsonargparse's registered YAML loader :func:`checked_yaml_load`."""
    import sys

    check_arguments(sys.argv[1:] if argv is None else argv)
    from jsonargparse import set_loader

    set_loader("yaml", checked_yaml_load, exceptions=(yaml.YAMLError,))
