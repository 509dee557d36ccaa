"""Re-export (see callbacks/__init__.py): the code is in :mod:`loopq.callbacks.line_progress`."""

from loopq.callbacks.line_progress import LineProgress

__all__ = ["LineProgress"]
