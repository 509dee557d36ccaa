"""One command-line stack for every command (issue 40): each ``python -m loopq.<name>`` entry point's command module
has a ``build_parser()`` returning a jsonargparse parser whose options all have help text, reads ``--config``, and
still reads the option spellings this release renamed (with a one-line notice) and the shell forms of booleans and
lists (:mod:`loopq.commands.cli`)."""

import importlib
import re
import shlex
from pathlib import Path

import pytest
from jsonargparse import ArgumentParser

from loopq.commands import export, testbed
from loopq.commands.cli import actions, prepare_argv
from loopq.paths import REPO_ROOT

#: ``loopq.eval`` is lm-eval's own command line (its options are lm-eval's), with LoopQ's model registered
LM_EVAL_PASSTHROUGH = {"loopq.commands.harness"}
#: commands run as ``python -m loopq.commands...`` (tools, and the GPU check's stage runner)
INNER = ["loopq.commands.make_fingerprints", "loopq.commands.gpu_check.stage", "loopq.commands.gpu_check.carry"]


def entry_points() -> dict[str, str]:
    """``<name>`` -> the command module of every ``loopq/<name>.py`` that ends in ``run_cli(...)``."""
    found = {}
    for path in sorted((REPO_ROOT / "loopq").glob("*.py")):
        text = path.read_text()
        match = re.search(r"^from (loopq\.commands[\w.]*) import", text, re.M)
        if "run_cli(" in text and '__name__ == "__main__"' in text and match:
            found[path.stem] = match.group(1)
    return found


COMMANDS = sorted({*entry_points().values(), *INNER} - LM_EVAL_PASSTHROUGH)


def test_every_entry_point_is_found():
    assert len(entry_points()) >= 12 and "loopq.commands.run" in COMMANDS and "loopq.commands.examine" in COMMANDS


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_parses_with_jsonargparse_and_documents_every_option(name):
    parser = importlib.import_module(name).build_parser()
    assert isinstance(parser, ArgumentParser)
    assert any("--config" in action.option_strings for action in parser._actions)
    undocumented = [a.option_strings or a.dest for a in actions(parser) if not (a.help or "").strip()]
    assert not undocumented, f"{name}: no help for {undocumented}"


@pytest.mark.parametrize("architecture", ["loopformer", "parcae"])
def test_pretrain_documents_every_option_of_every_architecture(architecture):
    from jsonargparse import capture_parser

    from loopq.commands import pretrain

    model_class = pretrain.pretrainer_class(["--architecture", architecture])
    parser = capture_parser(lambda: pretrain.fit_resumable(pretrain.PretrainCLI, model_class, []))
    undocumented = [a.option_strings or a.dest for a in actions(parser) if not (a.help or "").strip()]
    assert not undocumented, f"{architecture}: no help for {undocumented}"


@pytest.mark.parametrize(
    ("module", "argv", "key", "value", "notice"),
    [
        (export, ["--ckpt", "s", "--out", "o", "--fp-dtype", "float16"], "fp_dtype", "float16", "--fp-dtype"),
        (export, ["--ckpt", "s", "--out", "o", "--fp-dtype=float32"], "fp_dtype", "float32", "--fp-dtype"),
        (testbed, ["--model", "m", "--outliers-out", "x"], "outliers_out", Path("x"), "--outliers-out"),
    ],
)
def test_old_spellings_still_parse_with_a_one_line_notice(module, argv, key, value, notice, capsys):
    parser = module.build_parser()
    config = parser.parse_args(prepare_argv(argv, parser, module.COMMAND.renames))
    assert config[key] == value
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and notice in lines[0] and "deprecated" in lines[0] and key in lines[0]


def test_run_reads_its_tasks_bare_as_a_list_and_as_json():
    from loopq.commands import run

    parser = run.build_parser()
    base = ["--model.teacher", "t", "--tasks"]
    assert parser.parse_args(prepare_argv([*base, "--limit", "full"], parser, {})).tasks == ()
    assert parser.parse_args(prepare_argv([*base, "[]"], parser, {})).tasks == ()
    assert parser.parse_args(prepare_argv([*base, "a", "b"], parser, {})).tasks == ("a", "b")
    config = parser.parse_args(prepare_argv([*base[:2], "--force", "--eval_exported", "false"], parser, {}))
    assert config.force is True and config.eval_exported is False and config.tasks == ("loopq_paper",)


def test_function_commands_read_shell_lists_booleans_and_config_files(tmp_path):
    from loopq.commands import evaluate, generate
    from loopq.commands.report import write_report

    parser = write_report.build_parser()
    config = parser.parse_args(prepare_argv(["--results", "a.json", "b.json", "--out", "r"], parser, {}))
    assert config.results == ("a.json", "b.json") and config.runs == ()
    parser = evaluate.build_parser()
    assert parser.parse_args(prepare_argv(["--tasks", "--out", "x"], parser, {})).tasks == []
    assert parser.parse_args(prepare_argv(["--tasks", "[]"], parser, {})).tasks == []
    assert parser.parse_args(prepare_argv(["--tasks=a"], parser, {})).tasks == ["a"]
    settings = tmp_path / "generate.yaml"
    settings.write_text("model: loopq/assets/tiny-ouro\nprompt: The loop\nno_cache: true\n")
    parser = generate.build_parser()
    config = parser.parse_args(prepare_argv(["--config", str(settings), "--max_new_tokens", "3"], parser, {}))
    assert config.no_cache is True and config.max_new_tokens == 3 and config.prompt == "The loop"


def test_the_gpu_checks_stage_runner_reads_the_drivers_command_line():
    from loopq.commands.gpu_check import stage

    parser = stage.build_parser()
    argv = ["loopq.commands.gpu_check.registry", "e2e", "--workdir", "w", "--progress", "p", "--seconds", "9.5"]
    config = parser.parse_args(prepare_argv([*argv, "--full"], parser, {}))
    assert (config.name, config.workdir, config.seconds, config.full) == ("e2e", Path("w"), 9.5, True)


def documented_command_lines() -> list[tuple[str, list[str]]]:
    """Every ``python -m loopq.<command> ...`` line of the README and docs/ without placeholders (``<dir>``,
    ``[--option]``, ``...``): its command module and arguments (continued lines joined, comments dropped)."""
    modules = {stem: module for stem, module in entry_points().items() if module not in LM_EVAL_PASSTHROUGH}
    found = []
    for doc in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]:
        for line in re.sub(r"\\\n\s*", " ", doc.read_text()).splitlines():
            match = re.match(r"\s*python -m loopq\.(\w+) (.*)", line)
            if match and match.group(1) in modules and not re.search(r"<\w|\[--|\[\w+ |\.\.\.|`", match.group(2)):
                found.append((modules[match.group(1)], shlex.split(match.group(2), comments=True)))
    return found


DOCUMENTED = documented_command_lines()


@pytest.mark.parametrize(("name", "argv"), DOCUMENTED, ids=[f"{n[15:]} {' '.join(a)}"[:70] for n, a in DOCUMENTED])
def test_every_documented_command_line_parses(name, argv):
    module = importlib.import_module(name)
    parser = module.build_parser()
    parser.parse_args(prepare_argv(argv, parser, getattr(getattr(module, "COMMAND", None), "renames", {})))
