"""lm-eval's command line with the ``loopq`` model registered and LoopQ's offline tasks on the include path::

    python -m loopq.eval --model loopq --model_args pretrained=<model dir>,num_loops=4 --tasks loopq_paper

Any lm-eval flag works; ``--include_path`` defaults to ``loopq/metrics/tasks`` (lm-eval's own tasks stay available) and
``--device`` to cuda when PyTorch sees a GPU, else cpu (:mod:`loopq.devices`).
A ``model_args`` key the ``loopq`` model does not take, or a ``pretrained`` directory that holds no model (a teacher,
a student written by ``python -m loopq.fit`` or an export), is refused before lm-eval indexes its tasks, and an unknown
task name ends with one ``error:`` line naming ``--tasks``.
"""

from __future__ import annotations

import sys

from lm_eval.__main__ import cli_evaluate
from lm_eval.utils import simple_parse_args_string

from loopq.artifacts import read_artifact_meta
from loopq.devices import resolve_device
from loopq.errors import UsageError
from loopq.metrics.lm import check_model_args  # importing it registers the "loopq" model
from loopq.metrics.tasks import TASKS_DIR

#: how lm-eval words an unknown ``--tasks`` name (a plain ValueError)
TASKS_NOT_FOUND = "Tasks not found"


def option(args: list[str], name: str) -> str | None:
    """The value of ``--name value`` or ``--name=value`` in ``args``."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
    return None


def check_loopq_args(args: list[str]) -> None:
    """``--model loopq --model_args pretrained=<dir>,...``: every key is one the model takes, and the directory holds
    a model: a teacher (config.json), a student or an export (their checked descriptions; nothing is loaded)."""
    if option(args, "--model") != "loopq":
        return
    pairs = simple_parse_args_string(option(args, "--model_args") or "")
    check_model_args(pairs)
    if "pretrained" in pairs:
        read_artifact_meta(str(pairs["pretrained"]))


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if args and not {"-h", "--help"} & set(args):
        check_loopq_args(args)
        if "--include_path" not in args:
            args += ["--include_path", str(TASKS_DIR)]
        if option(args, "--device") is None:  # lm-eval's own default is cuda:0 whatever the machine has
            args += ["--device", str(resolve_device())]
    sys.argv = [sys.argv[0], *args]
    try:
        cli_evaluate()
    except ValueError as err:
        if not str(err).startswith(TASKS_NOT_FOUND):
            raise
        raise UsageError(f"--tasks: {err}; `--tasks list` shows the known tasks") from err
