"""Optional calibration callbacks: per-loop diagnostics and plain-line progress. The method's own schedules
(adaptive mu_t, sharing-gap reselection) live in :mod:`loopq.calib` and are installed by the calibration module."""

from loopq.callbacks.diagnostics import PerLoopDiagnostics
from loopq.callbacks.line_progress import LineProgress

__all__ = ["LineProgress", "PerLoopDiagnostics"]
