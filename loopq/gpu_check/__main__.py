"""``python -m loopq.gpu_check``: :func:`loopq.gpu_check.cli.main`, its result the exit status, with one-line errors
(:func:`loopq.errors.run_cli`)."""

from loopq.errors import run_cli
from loopq.gpu_check.cli import main


def _exit_with_status() -> None:
    raise SystemExit(main())


if __name__ == "__main__":
    run_cli(_exit_with_status)
