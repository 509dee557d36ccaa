"""``python -m loopq.testbed``: the command is :mod:`loopq.commands.testbed` (this file is its entry point only)."""

from loopq.commands.testbed import main
from loopq.errors import run_cli

if __name__ == "__main__":
    run_cli(main)
