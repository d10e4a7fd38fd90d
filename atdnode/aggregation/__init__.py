"""One-time aggregation (VGS-ATD): modes, weightings, verification and the keep decision."""
from __future__ import annotations

from atdnode.face import lazy_face

# The names other rooms, the CLI and netsim import from here (atdnode/face.py).
_FACE = {"AggregateError": "aggregate", "average_blobs": "aggregate", "register_global": "aggregate", "own_model": "aggregate",
         "result_meta": "aggregate", "check_recorded_cosines": "check", "check_recorded_weights": "check",
         "check_result": "check", "EnsembleOptions": "ensemble",
         "REFERENCES": "ensemble_refs", "fit_reference": "ensemble_refs", "fit_own_raw": "ensemble_refs",
         "reference_features": "ensemble_refs",
         "FeaturesError": "features_share", "announced_key": "features_share", "recipient_keys": "features_share",
         "share_features": "features_share", "GroupSpec": "hierarchical",
         "check_arguments": "modes", "default_weighting": "modes", "run_aggregate": "modes:aggregate",
         "verify_aggregate": "verify", "verify_entry": "verify",
         "use_of": "keep", "keep_policy": "keep", "SELECT_BY": "keep", "short_class": "keep",
         "MIN_VAL_PER_CLASS": "keep", "TEST_WARNING": "candidates",
         "judge_with": "candidates"}
__all__ = [*_FACE]
__getattr__, __dir__ = lazy_face(__name__, _FACE)
