"""`digits-jitter`: scikit-learn's real 8x8 digits, each placed in a larger canvas the way
acquisition varies between scans (a setting in which learned features can matter).

Every digit is rendered (bilinear) at a random size (`SIZE` px, about 12-22 of the 32 px
canvas), rotated by a small random angle (+-`ROTATE` deg), put at a random offset that keeps
it inside the canvas, and then "acquired": a random contrast and background level, plus
gaussian noise. Raw-pixel classifiers lose the alignment the 8x8 originals have (a stroke
lands on other pixels in every image), while a translation-tolerant learned extractor (patch
tokens, mean pooled) need not.

The rendering is a pure function of `RENDER_SEED` and the sample index, so the data set is
one fixed set of 1797 images (like `digits`), whatever the run's seed: the seed of a run
picks the 80/20 split and the partition, as for every source. Pixels are uint8 (0..255).

`digits-jitter?variants=K` renders every source digit K times (variant j with render seed
`RENDER_SEED + j`; variant 0 is the K = 1 data set), so a node gets K times the images of
the same 1797 digits. The K variants of one digit form a split group (`Catalog.groups`):
all of them land on the same side of the train/test split, so no test image is a
re-rendering of a training digit.

`digits-jitter?public=F` reserves a fixed fraction F of the source digits (per class, chosen
by `PUBLIC_SEED`, not by a run's seed: like a published data set, the pool is the same in
every run) as a PUBLIC labelled pool, the analog of VGS-ATD §3.2's "large-scale, publicly
available" data set a designated client pretrains W_p on. The source then holds only the
other, private digits (what the hospitals partition and test on); `part=public` gives the
pool instead. No source digit is on both sides, so no rendering of a private or test digit
is ever in the pool, whatever `variants` each side uses. The pool's own 80/20 split is by
source digit as well.
"""
from __future__ import annotations

import functools

import numpy as np

from atdnode.data.intensity import Scaling
from atdnode.data.layout import Catalog

CANVAS = 32  # px, square
SIZE = (12.0, 22.0)  # rendered digit side, px (uniform)
ROTATE = 15.0  # max |angle|, degrees
CONTRAST = (0.5, 1.0)  # ink intensity over the background
BACKGROUND = (0.0, 0.25)
NOISE = 0.06  # std of the gaussian pixel noise, in [0, 1] intensity units
RENDER_SEED = 20231  # fixed: the data set, not a run, decides the rendering
PUBLIC_SEED = 20232  # fixed: the data set, not a run, decides which digits are public


def render(digits: np.ndarray, seed: int = RENDER_SEED) -> np.ndarray:
    """(N, 8, 8) digits in 0..16 -> (N, CANVAS, CANVAS) uint8, deterministic in `seed`."""
    import torch
    import torch.nn.functional as F

    n = len(digits)
    rng = np.random.default_rng(seed)
    size = rng.uniform(*SIZE, n)
    angle = np.deg2rad(rng.uniform(-ROTATE, ROTATE, n))
    room = 1.0 - size / CANVAS  # the digit's centre may move this far (normalised coords)
    shift = rng.uniform(-1.0, 1.0, (n, 2)) * room[:, None]
    contrast = rng.uniform(*CONTRAST, n)
    background = rng.uniform(*BACKGROUND, n)
    noise = rng.normal(0.0, NOISE, (n, CANVAS, CANVAS))
    # output (canvas) coords p -> input (digit) coords q = (CANVAS/size) * R^T (p - shift)
    k = CANVAS / size
    cos, sin = np.cos(angle), np.sin(angle)
    theta = np.empty((n, 2, 3))
    theta[:, 0, 0], theta[:, 0, 1] = k * cos, k * sin
    theta[:, 1, 0], theta[:, 1, 1] = -k * sin, k * cos
    theta[:, :, 2] = -np.einsum("nij,nj->ni", theta[:, :, :2], shift)
    src = torch.from_numpy(digits.astype(np.float32) / 16.0).unsqueeze(1)
    grid = F.affine_grid(torch.from_numpy(theta).float(), [n, 1, CANVAS, CANVAS], align_corners=False)
    ink = F.grid_sample(src, grid, mode="bilinear", padding_mode="zeros", align_corners=False)[:, 0].numpy()
    img = background[:, None, None] + contrast[:, None, None] * ink + noise
    return np.round(np.clip(img, 0.0, 1.0) * 255.0).astype(np.uint8)


@functools.lru_cache(maxsize=2)
def _images(variants: int) -> np.ndarray:
    """The rendered data set (read-only; cached: a train and a test load render it once)."""
    from sklearn.datasets import load_digits

    d = load_digits().images
    out = np.concatenate([render(d, RENDER_SEED + j) for j in range(variants)])
    out.setflags(write=False)
    return out


def public_digits(targets: np.ndarray, fraction: float) -> np.ndarray:
    """Boolean mask over the source digits: the public pool, round(fraction * n_c) digits of
    each class c, drawn with the fixed `PUBLIC_SEED` (nested: a larger fraction keeps every
    digit a smaller one chose)."""
    rng = np.random.default_rng(PUBLIC_SEED)
    mask = np.zeros(len(targets), dtype=bool)
    for c in np.unique(targets):
        idx = np.flatnonzero(targets == c)
        mask[idx[rng.permutation(len(idx))[: int(round(fraction * len(idx)))]]] = True
    return mask


def digits_jitter_catalog(variants: int = 1, public: float | None = None, part: str = "private") -> Catalog:
    """The catalog of `digits-jitter` with `variants` renderings per source digit: sample
    `j * 1797 + i` is variant j of digit i; group i holds digit i's variants (one split side).
    With `public`, only the source digits of `part` ("private": not in `public_digits`,
    "public": in it), each still its own group."""
    from sklearn.datasets import load_digits

    from atdnode.data.arrays import _array_reader

    d = load_digits()
    n = len(d.target)
    src = np.tile(np.arange(n), variants)  # source digit of each rendering
    rows = np.arange(n * variants)
    if public is not None:
        mask = public_digits(d.target, public)
        rows = rows[mask[src] == (part == "public")]
    images = _images(variants)[rows] if public is not None else _images(variants)
    keys = d.target[src[rows]].astype(np.int64).astype(str)
    groups = src[rows] if variants > 1 or public is not None else None
    how = f"digits-jitter, {CANVAS} px canvas, fixed 0..255"
    return Catalog(keys=keys, sides=np.full(len(keys), "all"), ids=True, uniform=True, groups=groups,
                   read=_array_reader(images, Scaling(window=(0.0, 255.0), how=how)),
                   names={str(i): str(i) for i in range(10)}, where=[""] * len(keys))
