"""The models layer's one error class, on its own so that every module of :mod:`loopq.models` can raise it (the
checkpoint layout in :mod:`loopq.models.shards` as well as the interface in :mod:`loopq.models.base`, which
re-exports it)."""

from __future__ import annotations

from loopq.errors import LoopQError


class LoopLMError(LoopQError):
    """Bad model input (config, checkpoint, arguments): the message names the file or key and the fix."""
