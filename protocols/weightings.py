"""The weightings and the VGS-ATD modes, registered once: a weighting's name, what it counts
per input, its rule, one line of help and where it applies; a mode's name, help, default
weighting and which weightings apply to it; the choices of the ensemble a mode fits
(`CLASSIFIERS`, `PRIORS`). Every list of weighting names (the CLI's choices and help, each mode's
check, netsim's scenario keys) is read from here; nothing switches on a weighting's name but
`protocols.aggregation.compute_weights` and `protocols.rounds.round_weights`.

Each rule returns a float64 probability vector, one weight per input:

=================  ==========================================================
``uniform``        w_i = 1 / N                                  (the papers' average, Eq. 2)
``samples``        w_i = n_i / sum_j n_j              (n_i = training samples)
``sqrt-classes``   alpha_i = sqrt(C_i) / sum_j sqrt(C_j)        VGS-ATD Eq. 11
``model-count``    beta_i = n_i / sum_j n_j  (n_i = base models in group i)   Eq. 12
``fedwavg``        w_i = softmax_i(q * cos(L_ref, L_i))         FedWAvg Eq. 3 (:mod:`protocols.fedwavg`)
``fedavg``         w_i = 1 / K over a round's K members          (`atd rounds`)
=================  ==========================================================

Where each applies (`uses`): ``average`` -- the weights of a horizontal or vertical
aggregate and of a new hierarchical group; ``group`` -- combining hierarchical groups;
``round`` -- `atd rounds`. The round aggregators' names and help (`ROUND_AGGREGATORS`) are
listed here too; their rules live in `protocols.rounds`. The CLI reads this module at start-up for its choices and help, so
it loads nothing beyond the standard library: numpy is imported when a rule runs; the fedwavg
rule, which needs torch, is computed by `protocols.aggregation.compute_weights`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


class AggregationError(ValueError):
    """Bad aggregation input, raised by every aggregation rule (defined here, at their floor).
    ``index``/``name``/``key`` locate it when known."""

    def __init__(self, message: str, *, index: int | None = None,
                 name: str | None = None, key: str | None = None) -> None:
        where = []
        if index is not None:
            where.append(f"input {index}" + (f" ({name})" if name else ""))
        if key is not None:
            where.append(f"key {key!r}")
        super().__init__(": ".join([", ".join(where), message]) if where else message)
        self.index, self.name, self.key = index, name, key


def _counts(values: Sequence[float], what: str) -> np.ndarray:
    import numpy as np

    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise AggregationError(f"{what} must be numbers: {e}") from None
    if arr.ndim != 1 or arr.size == 0:
        raise AggregationError(f"{what} must be a non-empty 1-D sequence")
    if not np.all(np.isfinite(arr)):
        raise AggregationError(f"{what} must be finite, got {arr.tolist()}")
    if np.any(arr < 0):
        raise AggregationError(f"{what} must be >= 0, got {arr.tolist()}")
    if arr.sum() <= 0:
        raise AggregationError(f"{what} must not all be zero")
    return arr


def uniform_weights(n: int) -> np.ndarray:
    """``1/n`` each."""
    import numpy as np

    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise AggregationError(f"uniform weighting needs n >= 1 inputs, got {n!r}")
    return np.full(int(n), 1.0 / n, dtype=np.float64)


def sample_weights(samples: Sequence[float]) -> np.ndarray:
    """``n_i / sum_j n_j`` for the inputs' sample counts."""
    import numpy as np

    arr = _counts(samples, "sample counts")
    return arr / arr.sum()


def sqrt_class_weights(classes: Sequence[float]) -> np.ndarray:
    """VGS-ATD Eq. 11: ``sqrt(C_i) / sum_j sqrt(C_j)`` for class counts C_i."""
    import numpy as np

    arr = np.sqrt(_counts(classes, "class counts"))
    return arr / arr.sum()


def model_count_weights(models: Sequence[float]) -> np.ndarray:
    """VGS-ATD Eq. 12: ``n_i / sum_j n_j`` for the number of base models per group."""
    arr = _counts(models, "model counts")
    return arr / arr.sum()


@dataclass(frozen=True)
class Weighting:
    """One registered weighting. `counts`: the quantity its `rule` takes per input ("samples",
    "classes", "models"), None for one that needs only the number of inputs (uniform, fedavg)
    or the layers (fedwavg)."""

    name: str
    help: str
    uses: tuple[str, ...]
    counts: str | None = None
    rule: Callable[[Sequence[float]], np.ndarray] | None = None


REGISTRY: dict[str, Weighting] = {}  # every weighting, by name, in registration order


def register(w: Weighting) -> Weighting:
    if w.name in REGISTRY:
        raise ValueError(f"weighting {w.name!r} is registered twice")
    REGISTRY[w.name] = w
    return w


register(Weighting("uniform", "1/N each (the papers' average)", ("average",)))
register(Weighting("samples", "by training samples", ("average",), "samples", sample_weights))
register(Weighting("sqrt-classes", "by sqrt of class counts (VGS-ATD Eq. 11)", ("average", "group"), "classes",
                   sqrt_class_weights))
register(Weighting("model-count", "by base models per group (VGS-ATD Eq. 12)", ("group",), "models",
                   model_count_weights))
register(Weighting("fedavg", "1/K over the round's members (FedAvg)", ("round",)))
register(Weighting("fedwavg", "softmax of q * last-layer cosine to the reference (FedWAvg Eq. 3)",
                   ("average", "round")))


def weightings(use: str) -> tuple[str, ...]:
    """The names registered for `use` ("average", "group", "round"), in registration order."""
    return tuple(n for n, w in REGISTRY.items() if use in w.uses)


def help_for(use: str) -> str:
    """`name (help) | ...` for `use`: the text of a CLI option's help."""
    return " | ".join(f"{n} ({REGISTRY[n].help})" for n in weightings(use))


@dataclass(frozen=True)
class Mode:
    """One VGS-ATD aggregation mode: `weightings` names the use whose registered weightings
    apply to it, `default_weighting` the one taken when none is given."""

    name: str
    help: str
    default_weighting: str
    weightings: str


MODES: dict[str, Mode] = {m.name: m for m in (  # the VGS-ATD modes, by name
    Mode("horizontal", "average compatible weight sets (heads too over the same labels), then the ensemble",
         "uniform", "average"),
    Mode("vertical", "average extractors, then one ensemble over this node's and peers' sealed features (§3.2)",
         "uniform", "average"),
    Mode("hierarchical", "average each --group, then combine the groups (§3.3), then the ensemble",
         "sqrt-classes", "group"),
)}


def mode_help() -> str:
    """`name (help) | ...` over the modes."""
    return " | ".join(f"{m.name} ({m.help})" for m in MODES.values())


ROUND_AGGREGATORS: dict[str, str] = {  # `atd rounds --aggregator`: name -> one line of help
    "fedavg": "FedAvg: the plain mean (every member weighs 1/K)",
    "fedwavg": "FedWAvg: mean weighted by softmax(q * cosine) of the last layers (Eq. 3)",
    "median": "coordinate-wise median (Yin et al. 2018)",
    "trimmed-mean": "coordinate-wise mean without the f largest and f smallest values (Yin et al. 2018)",
    "krum": "Krum: the input closest to its n-f-2 nearest others (Blanchard et al. 2017)",
    "multi-krum": "Multi-Krum: the mean of the n-f inputs Krum scores best (Blanchard et al. 2017)",
}  # their rules: protocols.rounds.AGGREGATORS (torch), which takes its names and help from here


CLASSIFIERS: dict[str, str] = {  # what predicts for a horizontal aggregate: name -> one line of help
    "ensemble": "the paper's default: fused extractor -> CLS -> PCA -> MLP + RF + SVM",
    "head": "the averaged-head model predicts directly",
}

PRIORS: dict[str, str] = {  # the ensemble's class-prior correction (protocols.ensemble): name -> help
    "none": "no correction",
    "balanced": "uniform class prior",
    "node": "this node's class proportions",
}


def choices_help(registry: dict[str, str]) -> str:
    """`name (help) | ...` over a registry of names and one-line helps."""
    return " | ".join(f"{name} ({text})" for name, text in registry.items())


def weighting_help_by_mode() -> str:
    """For each mode, the weightings that apply and its default (the CLI's --weighting help)."""
    return "; ".join(f"{m.name}: {' | '.join(weightings(m.weightings))} (default {m.default_weighting})"
                     for m in MODES.values())
