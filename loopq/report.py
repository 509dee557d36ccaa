"""``python -m loopq.report``: :func:`loopq.report.main` with one-line errors (:func:`loopq.errors.run_cli`)."""

from loopq.commands.report.write_report import main
from loopq.errors import run_cli

if __name__ == "__main__":
    run_cli(main)
