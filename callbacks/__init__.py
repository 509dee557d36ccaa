"""Thin re-exports so that configs written as ``class_path: callbacks.<module>.<Class>`` keep working from a
checkout. Nothing lives here: the method's schedules are in :mod:`loopq.calib` (``loopq.calib.mu.AdaptiveMu``,
``loopq.calib.reselection.SharingGapReselection``), the optional ones (diagnostics, line progress, clean stop) beside
them in :mod:`loopq.calib`. This folder is not installed as a package; new configs name the ``loopq.`` paths."""
