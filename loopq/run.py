"""``python -m loopq.run``: the command is :mod:`loopq.commands.run` (this file is its entry point only)."""

from loopq.commands.run import main
from loopq.errors import run_cli

if __name__ == "__main__":
    run_cli(main)
