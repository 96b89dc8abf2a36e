"""Errors a stage raises for bad input. The CLI prints their message (written for the user) and exits 1."""


class StageError(RuntimeError):
    """A stage refused its input; the message names the file, key, column or rows, with a few examples."""
