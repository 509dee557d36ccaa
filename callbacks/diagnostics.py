"""Re-export (see callbacks/__init__.py): the code is in :mod:`loopq.calib.diagnostics`."""

from loopq.calib.diagnostics import PerLoopDiagnostics, layer_loop_errors

__all__ = ["PerLoopDiagnostics", "layer_loop_errors"]
