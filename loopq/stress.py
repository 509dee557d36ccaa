"""``python -m loopq.stress``: the command is :mod:`loopq.commands.stress` (this file is its entry point only)."""

from loopq.commands.stress import main
from loopq.errors import run_cli

if __name__ == "__main__":
    run_cli(main)
