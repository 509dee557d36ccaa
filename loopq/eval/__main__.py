"""lm-eval's command line with the ``loopq`` model registered and LoopQ's offline tasks on the include path::

    python -m loopq.eval --model loopq --model_args pretrained=<model dir>,num_loops=4 --tasks loopq_paper

Any lm-eval flag works; ``--include_path`` defaults to ``loopq/eval/tasks`` (lm-eval's own tasks stay available).
"""

from __future__ import annotations

import sys

from lm_eval.__main__ import cli_evaluate

import loopq.eval.lm  # noqa: F401  (registers the "loopq" model)
from loopq.errors import run_cli
from loopq.eval.tasks import TASKS_DIR


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if args and "--include_path" not in args and not {"-h", "--help"} & set(args):
        args += ["--include_path", str(TASKS_DIR)]
    sys.argv = [sys.argv[0], *args]
    cli_evaluate()


if __name__ == "__main__":
    run_cli(main)
