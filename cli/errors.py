"""Errors the CLI prints as one line (no traceback) with a non-zero exit code."""
from __future__ import annotations


from atdnode.errors import AtdError


class CliError(AtdError):
    """A user-facing failure: the message is the whole story."""

    exit_code = 1

    def __init__(self, message: str, *, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code
