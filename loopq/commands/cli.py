"""One command-line stack for every LoopQ command: jsonargparse over typed functions (issue 40).

A command is a typed function: its signature is the schema of its options and the ``Args:`` section of its
docstring their ``--help`` (litgpt's recipes; ``jsonargparse.auto_cli``). Each command module describes
itself as a :class:`Command`; its ``build_parser()`` returns :meth:`Command.parser` and its ``main(argv)`` is
:meth:`Command.run`; the LightningCLI commands (``fit``, ``run``, ``pretrain``, ``stress``) are jsonargparse too.
Every command reads ``--config FILE`` (its options as YAML) and spells its options with underscores.

Before parsing, :func:`prepare_argv` rewrites what jsonargparse does not read itself:

* an option renamed in this release (one table of old -> new per command) is read under its new name for one
  release, with a one-line deprecation notice on stderr;
* a bare boolean option (``--force``) is ``--force true``;
* a list option followed by several words (``--results a.json b.json``, a shell glob) is that JSON list, and one
  followed by none (``--tasks``) is ``[]``; one JSON or YAML value (``--tasks '[a, b]'``) is read as it is.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePath
from types import UnionType
from typing import Any, ClassVar, Union, get_args, get_origin

from jsonargparse import ArgumentParser, Namespace, auto_parser

from loopq.errors import UsageError, one_line

#: old option spelling -> new one, of one command
Renames = Mapping[str, str]
BOOL, LIST = "bool", "list"
#: errors raised, not printed with the usage (:func:`loopq.errors.run_cli` prints one line); no environment options
PARSER_SETTINGS = {"exit_on_error": False, "default_env": False}
#: the element types of a list option given as several words
WORDS = (str, int, float, PurePath)
#: the values a boolean option may be given (case does not matter)
BOOLEANS = ("true", "false")


@dataclass(frozen=True)
class Command:
    """``python -m loopq.<name>``: ``component`` (a function, or a list or name -> function dict of them: subcommands)
    as its options, the first paragraph of ``doc`` as its description, ``positional``: required parameters as
    positional arguments, ``renames``: its options' old spellings, ``shared_help``: the help of parameters that
    several subcommands share (by name), for those their docstrings leave out."""

    component: Any
    name: str
    doc: str
    positional: bool = False
    renames: Renames = field(default_factory=dict)
    shared_help: Mapping[str, str] = field(default_factory=dict)

    def parser(self) -> ArgumentParser:
        """The parser: the component's parameters as options, ``--config``, errors raised (not printed)."""
        prog, description = f"python -m {self.name}", self.doc.split("\n\n")[0]
        settings = {"as_positional": self.positional, "prog": prog, "description": description, **PARSER_SETTINGS}
        parser = auto_parser(self.component, **settings)
        for action in actions(parser):
            action.help = action.help or self.shared_help.get(action.dest.rpartition(".")[2])
        return parser

    def run(self, argv: list[str] | None = None) -> Any:
        """Parse ``argv`` (default ``sys.argv[1:]``, :func:`prepare_argv` first) and call the component with it; a
        bad option is a :class:`~loopq.errors.UsageError` naming it."""
        parser = self.parser()
        args = prepare_argv(sys.argv[1:] if argv is None else argv, parser, self.renames)
        try:
            config = parser.parse_args(args)
        except argparse.ArgumentError as err:
            message = as_typed(one_line(err), parser) + in_config_files(str(err), args)
            raise UsageError(f"{message} (see {parser.prog} --help)") from None
        return call(self.component, parser.instantiate(config))


def as_typed(message: str, parser: ArgumentParser) -> str:
    """``message`` with the missing required options jsonargparse names by key (``out``) as typed (``--out``)."""
    head, required, names = message.partition("the following arguments are required: ")
    typed = {action.dest: action.option_strings[0] for action in parser._actions if action.option_strings}
    return head + required + ", ".join(typed.get(name, name) for name in names.split(", ")) if required else message


def lightning_cli(cli_class: type, model: type, data: type, args: list[str] | None, command: str, **kwargs: Any) -> Any:
    """``cli_class`` (a LightningCLI with :class:`SharedParsing`) over ``model`` and ``data``, built from ``args`` (a
    list, or ``sys.argv``), not run: seed 0 by default, the resolved config saved over an earlier one, ``python -m
    <command>`` as its program. YAML is read through :mod:`loopq.config_yaml` (alias expansion bounded, duplicate
    keys refused); ``--help`` starts with ``cli_class.description``. ``kwargs``: more LightningCLI arguments."""
    from loopq.config_yaml import install as install_checked_yaml

    install_checked_yaml(args)
    parser_kwargs = {**PARSER_SETTINGS, "prog": f"python -m {command}", "description": cli_class.description}
    return cli_class(
        model,
        data,
        run=False,
        args=args,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        parser_kwargs=parser_kwargs,
        **kwargs,
    )


class SharedParsing:
    """A LightningCLI mixin (``fit``, ``run``, ``pretrain``, ``stress``): the command line is parsed after
    :func:`prepare_argv`, with the command's ``renames``."""

    renames: ClassVar[Renames] = {}

    def parse_arguments(self, parser: ArgumentParser, args: Any) -> None:
        if isinstance(args, dict):
            super().parse_arguments(parser, args)  # type: ignore[misc]
        else:  # LightningCLI's own parse_arguments warns about args given while sys.argv has some: they are ours
            argv = prepare_argv(list(sys.argv[1:] if args is None else args), parser, self.renames)
            try:
                self.config = parser.parse_args(argv)
            except argparse.ArgumentError as err:
                where = in_config_files(str(err), argv)
                raise (argparse.ArgumentError(None, str(err) + where) if where else err) from None


#: jsonargparse's refusal of a key it does not know, as it words it for a group or a whole option name
_UNACCEPTED = re.compile(r"Group '([\w.]+)' does not accept option '(\w+)'|Option '([\w.]+)' is not accepted")


def in_config_files(message: str, argv: list[str]) -> str:
    """Where ``message`` refuses a key a ``--config`` file of ``argv`` holds: `` (in --config FILE: remove or rename
    the key)`` naming those files (jsonargparse names only the key); else ``""``."""
    match = _UNACCEPTED.search(message)
    if not match:
        return ""
    keys = (f"{match[1]}.{match[2]}" if match[1] else match[3]).split(".")
    files = [path for path in config_paths(argv) if holds_key(path, keys)]
    return f" (in --config {', '.join(files)}: remove or rename the key)" if files else ""


def config_paths(argv: list[str]) -> list[str]:
    """The files ``argv`` passes as ``--config FILE`` or ``--config=FILE``, in order."""
    paths = []
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            paths.append(argv[i + 1])
        elif arg.startswith("--config="):
            paths.append(arg.partition("=")[2])
    return paths


def holds_key(path: str, keys: list[str]) -> bool:
    """Whether the YAML file at ``path`` holds the nested key ``keys`` (False where it cannot be read; read as the
    command read it, aliases bounded: :func:`loopq.config_yaml.checked_yaml_load`)."""
    import yaml

    from loopq.config_yaml import checked_yaml_load

    try:
        with open(path, encoding="utf-8") as fh:
            node: Any = checked_yaml_load(fh.read())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def call(component: Any, config: Namespace) -> Any:
    """``component`` (or the subcommand ``config`` names, of a list or a name -> function dict) called with the
    parsed ``config``."""
    config.pop("config", None)
    if isinstance(component, list | dict):
        name = config.pop("subcommand")
        named = component if isinstance(component, dict) else {c.__name__: c for c in component}
        component, config = named[name], config[name]
        config.pop("config", None)
    return component(**config)


def prepare_argv(argv: list[str], parser: ArgumentParser, renames: Renames) -> list[str]:
    """``argv`` with old spellings renamed (:func:`rename`) and the shell forms rewritten (:func:`shell_forms`)."""
    return shell_forms(rename(argv, renames, parser.prog), option_kinds(parser, argv))


def rename(argv: list[str], renames: Renames, prog: str) -> list[str]:
    """``argv`` with each old option of ``renames`` (``--old`` or ``--old=value``) spelt the new way, each with a
    one-line notice on stderr."""
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        if name in renames:
            notice = f"{prog}: {name} is deprecated, use {renames[name]} (the old spelling goes in the next release)"
            print(notice, file=sys.stderr)
            arg = f"{renames[name]}{eq}{value}"
        out.append(arg)
    return out


def actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options of ``parser`` and of its subcommands."""
    found = []
    for action in parser._actions:
        subcommands = isinstance(action, argparse._SubParsersAction)
        found += [a for sub in action.choices.values() for a in actions(sub)] if subcommands else [action]
    return found


def option_kinds(parser: ArgumentParser, argv: list[str]) -> dict[str, str]:
    """``--name`` -> :data:`BOOL` or :data:`LIST` for the options of ``parser`` (and of the subcommand ``argv``
    names) that take a boolean or a list (jsonargparse's type of the option; its ``--name+`` spelling is left
    alone)."""
    kinds: dict[str, str] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = [word for word in argv if word in action.choices][:1]
            kinds |= option_kinds(action.choices[chosen[0]], argv) if chosen else {}
        elif kind := type_kind(getattr(action, "_typehint", None)):
            kinds |= {name: kind for name in action.option_strings if not name.endswith("+")}
    return kinds


def type_kind(hint: Any) -> str | None:
    """:data:`BOOL` for ``bool``, :data:`LIST` for a list or tuple of words (strings, numbers, paths), either of them
    possibly ``| None``; None for anything else (a list of classes keeps jsonargparse's own syntax)."""
    args = [a for a in get_args(hint) if a is not type(None)] if get_origin(hint) in (Union, UnionType) else [hint]
    if len(args) != 1:
        return None
    if args[0] is bool:
        return BOOL
    words = get_origin(args[0]) in (list, tuple) and {a for a in get_args(args[0]) if a is not Ellipsis}
    return LIST if words and all(isinstance(a, type) and issubclass(a, WORDS) for a in words) else None


def shell_forms(argv: list[str], kinds: Mapping[str, str]) -> list[str]:
    """``argv`` with bare booleans given ``true`` and list options' words (none or several) made a JSON list."""
    out: list[str] = []
    argv = [part for arg in argv for part in split_value(arg, kinds)]
    i = 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        kind, words = kinds.get(arg), []
        while kind == LIST and i < len(argv) and not argv[i].startswith("--"):
            words, i = [*words, argv[i]], i + 1
        if kind == BOOL:
            given = i < len(argv) and argv[i].lower() in BOOLEANS
            words, i = ([argv[i]], i + 1) if given else (["true"], i)
        elif kind == LIST and not (len(words) == 1 and (words[0].lstrip()[:1] in "[{" or words[0] == "null")):
            words = [json.dumps(words)]
        out += [arg, *words]
    return out


def split_value(arg: str, kinds: Mapping[str, str]) -> list[str]:
    """``--name=value`` of a boolean or list option as ``--name value`` (other arguments as they are)."""
    name, eq, value = arg.partition("=")
    return [name, value] if eq and name in kinds and not value.startswith("-") else [arg]
