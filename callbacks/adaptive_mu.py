"""Re-export (see callbacks/__init__.py): the code is in :mod:`loopq.calib.mu`."""

from loopq.calib.mu import AdaptiveMu

__all__ = ["AdaptiveMu"]
