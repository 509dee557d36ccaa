"""Re-export (see callbacks/__init__.py): the code is in :mod:`loopq.callbacks.stop_on_signal`."""

from loopq.callbacks.stop_on_signal import StopOnSignal, exit_status

__all__ = ["StopOnSignal", "exit_status"]
