"""The one error type of the data layer (its own module so that every reader can raise it without import cycles)."""

from loopq.errors import LoopQError


class DataError(LoopQError):
    """Bad data input; the message names the file or key and what to do."""
