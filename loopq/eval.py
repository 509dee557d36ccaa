"""``python -m loopq.eval``: the command is :mod:`loopq.commands.harness` (this file is its entry point only)."""

from loopq.commands.harness import main
from loopq.errors import run_cli

if __name__ == "__main__":
    run_cli(main)
