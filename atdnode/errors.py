"""Typed errors of the node layer. All derive from `cli.errors.CliError`-compatible `AtdError`."""
from __future__ import annotations


class AtdError(Exception):
    """Base of every node-layer error; the message is meant for a human, one line."""

    exit_code = 1


class BlobError(AtdError):
    """A blob is missing, truncated, or does not hash to the name it claims."""


class WeightsError(AtdError):
    """A weight set fails a check: keys, shapes, dtypes, finiteness or model config."""


class DataError(AtdError):
    """Input data is unusable; the message names the file or spec at fault."""


class ConfigError(AtdError):
    """A node home or config is missing, malformed, or would be overwritten."""


class DaemonError(AtdError):
    """A command needs a running daemon that is not there, or the daemon refused."""
