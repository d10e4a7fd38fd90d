"""Labeled image data for a node, as hospitals store it.

A data spec is `SOURCE[?opt=val&...]` with SOURCE one of

    digits          scikit-learn's bundled 8x8 handwritten digits (real data, no download)
    digits-jitter   the same digits at random size / angle / offset in a 32 px canvas, with
                    random contrast, background and noise (`jitter.py`; seeded, fixed)
    npz:PATH        MedMNIST layout (train_/val_/test_ images and labels, optional `classes`)
    folder:PATH     PNG / JPEG / TIFF / BMP, 8-bit, 16-bit or float, one sub-folder per class
                    (or PATH/train, PATH/test [, PATH/val]; or labels=FILE.csv)
    dicom:PATH      DICOM files (pydicom), laid out like folder:
    nifti:PATH      2-D slices of 3-D NIfTI volumes (nibabel), a class per volume

Options (`spec.py`): classes=a,b | classes=FILE.json|csv, shard=i/n, limit=N, seed=S,
window=lo,hi|auto|minmax, val=val|train, labels=FILE.csv, frame=K, axis=A, slices=...

Images become float32 (N, C, H, W), resized to the model's size and normalised with mean
0.5 / std 0.5 (timm's ViT default). Intensity scaling is explained in `intensity.py`. The
label space is the ordered list of class names; its fingerprint is sha256 over its
canonical JSON. Unusable files are skipped and reported (`LabeledImages.report`); bad
data (labels, sizes, formats that cannot be decoded) raises `DataError` naming the file.

Modules: spec (grammar), layout (file listing, Catalog), images / dicom / nifti / arrays
(sources), intensity, labels (label space), select (split, selection, tensors), loader,
report, inspect (`atd data inspect`).
"""
from __future__ import annotations

from atdnode.face import lazy_face

# The names other rooms, the CLI and netsim import from here (atdnode/face.py).
_FACE = {"IMAGE_EXTS": "images", "contact_sheet": "inspect", "inspect_data": "inspect", "LabeledImages": "labeled",
         "label_fingerprint": "labeled", "SPLITS": "spec", "ALL": "spec", "load_dataset": "loader", "training_window": "loader",
         "source_kind": "public_spec", "public_data_spec": "public_spec:public_spec", "DataReport": "report",
         "caution_for": "sanity", "caution_of": "sanity", "metric_text": "sanity", "require_classes": "sanity",
         "MEAN": "select", "STD": "select", "split_indices": "select", "DataSpec": "spec", "did_you_mean": "spec",
         "UnlabelledReader": "unlabelled",
         "declared_splits": "loader", "peek": "loader", "DataSource": "loader", "resolve_data": "loader", "without_val": "spec"}
__all__ = [*_FACE]
__getattr__, __dir__ = lazy_face(__name__, _FACE)
