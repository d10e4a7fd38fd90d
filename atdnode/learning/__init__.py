"""Learning on a node: the ViT, training, evaluation, features, classify and predict."""
from __future__ import annotations

from atdnode.face import lazy_face

# The names other rooms, the CLI and netsim import from here (atdnode/face.py).
_FACE = {"predict_names": "classify", "score_record": "classify", "run_classify": "classify:classify",
         "check_nproc": "ddp", "torchrun_argv": "ddp", "ddp": "ddp:", "DeviceError": "device", "ENV": "device",
         "apply_device": "device", "configured_device": "device", "parse_device": "device",
         "resolve_device": "device", "extract_features": "features", "predict_classes": "features",
         "classification_metrics": "metrics", "save_confusion_png": "metrics",
         "paired_balanced_accuracy_se": "metrics", "jeffreys_paired_balanced_accuracy_se": "metrics",
         "ModelConfig": "model", "ModelConfigError": "model", "build_model": "model", "export_part": "model",
         "extractor_state": "model", "freeze_blocks": "model", "load_part": "model", "part_spec": "model",
         "resolve_config": "model", "ClassifyError": "predict", "pixel_features": "predict", "run_predict": "predict:predict",
         "probe_head": "probe", "AdversarialTransform": "train_options", "FINETUNE_LR": "train_options",
         "SCRATCH_LR_192": "train_options", "TrainOptions": "train_options", "Trainer": "trainer",
         "OPTIMIZERS": "train_options",
         "train": "training", "save_curves_png": "trainlog",
         "save_reliability_png": "metrics", "interval_text": "metrics", "wilson": "metrics", "named_metrics": "metrics", "auroc_summary": "metrics", "softmax_probabilities": "evaluation", "class_probabilities": "predict", "STORED": "metrics", "choose_size": "autosize"}
__all__ = [*_FACE]
__getattr__, __dir__ = lazy_face(__name__, _FACE)
