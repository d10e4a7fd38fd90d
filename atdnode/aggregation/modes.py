"""The one dispatch of `atd aggregate --mode MODE` onto the mode modules, used by the CLI
(`cli/commands/aggregate.py`) and netsim (`netsim.vgs_ops.NodeOps.aggregate`) alike.

`aggregate(home, mode, ...)` checks that the arguments fit the mode (AggregateError, one
line) and calls `atdnode.aggregation.horizontal.aggregate_horizontal`, `atdnode.aggregation.vertical.aggregate_vertical`
or `atdnode.aggregation.hierarchical.aggregate_hierarchical`. A weighting left as None is the
mode's default (`protocols.vgs.MODES`: the paper's uniform average, Eq. 2; hierarchical
groups combine with sqrt-classes, Eq. 11). `mode_help` and `weighting_help` are the CLI's help
texts, read from the registries (`protocols.vgs.MODES`, `protocols.weightings`).
"""
from __future__ import annotations

from collections.abc import Sequence

from atdnode.aggregation.aggregate import AggregateError, AggregateResult
from atdnode.node import NodeHome
from atdnode.aggregation.ensemble import CLASSIFIERS, EnsembleOptions
from protocols.weightings import MODES, weightings


def default_weighting(mode: str, weighting: str | None = None) -> str:
    """`weighting`, or the mode's default."""
    return weighting or MODES[mode].default_weighting


def check_arguments(mode: str, *, inputs: Sequence[str] | None = None, groups: Sequence = (),
                    classifier: str = "ensemble", data_spec: str | None = None,
                    features: Sequence[str] | None = None, strict: bool = False,
                    weighting: str | None = None) -> None:
    """AggregateError (one line, naming the CLI option) where an argument does not fit `mode`."""
    if mode not in MODES:
        raise AggregateError(f"--mode {mode!r}: choose from {', '.join(MODES)}")
    if weighting is not None and weighting not in weightings(MODES[mode].weightings):
        raise AggregateError(f"--weighting {weighting} does not apply to --mode {mode}: choose from "
                             f"{', '.join(weightings(MODES[mode].weightings))}")
    if groups and mode != "hierarchical":
        raise AggregateError("--group applies to --mode hierarchical only")
    if mode == "hierarchical" and inputs:
        raise AggregateError("hierarchical mode takes its inputs from --group NAME=ENTRY_ID,...")
    if classifier not in CLASSIFIERS:
        raise AggregateError(f"--classifier {classifier!r}: choose {' or '.join(CLASSIFIERS)}")
    if classifier != "ensemble" and mode != "horizontal":
        raise AggregateError("--classifier applies to --mode horizontal only")
    if mode == "horizontal" and classifier == "head" and (features or data_spec):
        raise AggregateError("--features / --data need the ensemble (not --classifier head)")
    if strict and mode != "hierarchical":
        raise AggregateError("--strict applies to --mode hierarchical only")


def aggregate(home: NodeHome, mode: str, *, weighting: str | None = None, inputs: list[str] | None = None,
              groups: Sequence = (), group_weighting: str = "uniform", q: float = 1.0,
              classifier: str = "ensemble", data_spec: str | None = None, features: list[str] | None = None,
              options: EnsembleOptions = EnsembleOptions(), strict: bool = False) -> AggregateResult:
    """One-time aggregation of `mode` (module doc). `inputs`: weights entry ids (horizontal,
    vertical); `groups`: `atdnode.aggregation.hierarchical.GroupSpec`s (hierarchical)."""
    check_arguments(mode, inputs=inputs, groups=groups, classifier=classifier, data_spec=data_spec,
                    features=features, strict=strict)
    weighting = default_weighting(mode, weighting)
    if mode == "horizontal":
        from atdnode.aggregation.horizontal import aggregate_horizontal

        return aggregate_horizontal(home, weighting=weighting, inputs=inputs, q=q, classifier=classifier,
                                    data_spec=data_spec, features=features, options=options)
    if mode == "vertical":
        from atdnode.aggregation.vertical import aggregate_vertical

        return aggregate_vertical(home, weighting=weighting, inputs=inputs, q=q, data_spec=data_spec,
                                  features=features, options=options)
    from atdnode.aggregation.hierarchical import aggregate_hierarchical

    return aggregate_hierarchical(home, list(groups), weighting=weighting, group_weighting=group_weighting, q=q,
                                  data_spec=data_spec, features=features, options=options, strict=strict)
