"""The command lines of LoopQ (layer 6): they parse, check their inputs before any work, and call the library below.

Each ``python -m loopq.<name>`` is a three-line entry point in ``loopq/<name>.py`` that runs ``main`` of the module
here with one-line errors (:func:`loopq.errors.run_cli`); ``docs/architecture.md`` lists them. Every command parses
with one stack, jsonargparse (:mod:`loopq.commands.cli`). The library never imports from this package
(``tests/test_layers.py``).
"""
