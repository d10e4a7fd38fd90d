"""The error every aggregation rule raises (its own module so rule modules share it)."""

from __future__ import annotations


class AggregationError(ValueError):
    """Bad aggregation input. ``index``/``name``/``key`` locate it when known."""

    def __init__(self, message: str, *, index: int | None = None,
                 name: str | None = None, key: str | None = None) -> None:
        where = []
        if index is not None:
            where.append(f"input {index}" + (f" ({name})" if name else ""))
        if key is not None:
            where.append(f"key {key!r}")
        super().__init__(": ".join([", ".join(where), message]) if where else message)
        self.index, self.name, self.key = index, name, key
