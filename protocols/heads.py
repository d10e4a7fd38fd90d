"""When classifier heads may be averaged (VGS-ATD horizontal mode, `protocols.vgs`).

Its own module so that averaging weight sets (`atdnode.aggregation.aggregate`, every `atd rounds` and
`atd aggregate` process) does not import scikit-learn through `protocols.vgs`'s ensemble.
"""
from __future__ import annotations

from collections.abc import Sequence


def heads_comparable(label_spaces: Sequence[Sequence[str]]) -> bool:
    """True when all inputs list the same class names in the same order."""
    first = list(label_spaces[0]) if label_spaces else None
    return first is not None and all(list(ls) == first for ls in label_spaces)
