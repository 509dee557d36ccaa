"""``python -m loopq.pretrain``: the command is :mod:`loopq.commands.pretrain` (this file is its entry point only)."""

from loopq.commands.pretrain import main
from loopq.errors import run_cli

if __name__ == "__main__":
    run_cli(main)
