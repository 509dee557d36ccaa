"""Re-export (see callbacks/__init__.py): the code is in :mod:`loopq.calib.reselection`."""

from loopq.calib.reselection import SharingGapReselection

__all__ = ["SharingGapReselection"]
