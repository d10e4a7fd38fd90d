"""`LabeledImages` (a loaded split, ready for a model) and the label-space fingerprint."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from atdnode.errors import DataError

if TYPE_CHECKING:
    from atdnode.data.report import DataReport


def label_fingerprint(classes: list[str]) -> str:
    """sha256 of the canonical JSON of the ordered class-name list."""
    canon = json.dumps([str(c) for c in classes], separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode()).hexdigest()


@dataclass
class LabeledImages:
    """A split of a data source, ready for a model."""

    images: torch.Tensor  # (N, C, H, W) float32, normalised
    labels: torch.Tensor  # (N,) int64 in [0, len(classes))
    classes: list[str]
    spec: str = ""
    report: "DataReport | None" = None  # what the loader did (set by load_dataset)

    def __post_init__(self) -> None:
        if self.images.shape[0] != self.labels.shape[0]:
            raise DataError(f"{self.spec}: {self.images.shape[0]} images but {self.labels.shape[0]} labels")

    @property
    def label_fp(self) -> str:
        return label_fingerprint(self.classes)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def content_fp(self) -> str:
        """sha256 over the loaded tensors (images as float32, labels as int64) and the class names:
        a fingerprint of exactly what a model saw, that names no file and shows no pixel."""
        h = hashlib.sha256(self.label_fp.encode())
        h.update(self.labels.to(torch.int64).contiguous().numpy().tobytes())
        h.update(self.images.to(torch.float32).contiguous().numpy().tobytes())
        return h.hexdigest()

    def class_counts(self) -> list[int]:
        return torch.bincount(self.labels, minlength=len(self.classes)).tolist()
