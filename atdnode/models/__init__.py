"""The node's models: the registry, weights as blobs, publishing and garbage collection."""
from __future__ import annotations

from atdnode.face import lazy_face

# The names other rooms, the CLI and netsim import from here (atdnode/face.py).
_FACE = {"enforce_limit": "gc", "register_model": "gc", "remove_model": "gc", "size_limit": "gc",
         "part_blob": "publish", "publish_weights": "publish", "weights_body": "publish", "ModelRecord": "registry",
         "ModelRegistry": "registry", "RAW_PIXELS": "registry", "is_raw_pixels": "registry", "answer_classes": "registry",
         "RunCheckpoint": "registry", "made_by": "registry",
         "extractor_blob_of": "registry", "PARTS": "weights",
         "WeightsBlobError": "weights", "load_weights": "weights", "read_meta": "weights",
         "save_weights": "weights", "load_ensemble": "weights", "save_ensemble": "weights",
         "InUse": "in_use", "model_in_use": "in_use", "default_model": "in_use", "resolve_model": "in_use",
         "chosen_on_test": "in_use", "learned_model_in_use": "in_use"}
__all__ = [*_FACE]
__getattr__, __dir__ = lazy_face(__name__, _FACE)
