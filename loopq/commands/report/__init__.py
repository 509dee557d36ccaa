"""Collect evaluation results and calibration runs into a markdown report with the paper's tables and figures.

``python -m loopq.report`` (:mod:`loopq.commands.report.write_report`, which documents the command) reads with
:mod:`~loopq.commands.report.inputs` (result JSONs, calibration directories), formats with
:mod:`~loopq.commands.report.tables` (markdown), plots with :mod:`~loopq.commands.report.figures` (matplotlib, imported
only there) and writes ``report.md`` with :mod:`~loopq.commands.report.build`.
"""
