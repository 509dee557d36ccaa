"""Re-export (see callbacks/__init__.py): the code is in :mod:`loopq.calib.stop_on_signal`."""

from loopq.calib.stop_on_signal import StopOnSignal, exit_status

__all__ = ["StopOnSignal", "exit_status"]
