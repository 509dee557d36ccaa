"""Re-export (see callbacks/__init__.py): the code is in :mod:`loopq.calib.line_progress`."""

from loopq.calib.line_progress import LineProgress

__all__ = ["LineProgress"]
