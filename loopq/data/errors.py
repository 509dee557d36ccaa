"""The one error type of the data layer (its own module so that every reader can raise it without import cycles)."""


class DataError(ValueError):
    """Bad data input; the message names the file or key and what to do."""
