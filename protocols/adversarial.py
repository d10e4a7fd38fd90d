"""Federated adversarial training pieces: PGD, adversarial batch mixing, robust accuracy.

Inputs are *normalised* tensors, ``x = (pixel - mean) / std`` per channel (dim
1), as the models see them. ``eps`` and ``step`` are in pixel units (8/255 and
2/255 on [0, 1] images by default, as in FedWAvg / Madry et al.), so in
normalised space channel c uses ``eps / std[c]``; the result is kept inside
the valid pixel range ``clamp`` (also in pixel units). PGD is an L-infinity
attack: ``steps`` signed-gradient ascent steps on the cross-entropy, each
projected back into the eps-ball around ``x`` and into the pixel range, from a
uniform random start in the ball.

The attack runs the model in eval mode (no dropout, no BatchNorm statistic
updates) and restores its mode afterwards; it never touches parameter
``.grad``. Pass a ``torch.Generator`` for reproducible random starts and
batch selection.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PGDConfig", "AdversarialError", "RobustReport", "pgd_attack", "adversarial_batch",
           "robust_accuracy"]


class AdversarialError(ValueError):
    """Bad attack parameters or inputs."""


@dataclass(frozen=True)
class PGDConfig:
    """The attack settings (``atd train --adversarial --pgd-eps E --pgd-steps S``).
    ``pgd_attack(model, x, y, **cfg.attack_kwargs())`` uses them."""

    eps: float = 8 / 255
    step: float = 2 / 255
    steps: int = 7
    random_start: bool = True
    clamp: tuple[float, float] = (0.0, 1.0)
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    ratio: float = 0.5  # share of each training batch replaced by adversarial examples

    def __post_init__(self) -> None:
        _check(self.eps, self.step, self.steps, self.clamp, self.std)
        if not 0.0 <= self.ratio <= 1.0:
            raise AdversarialError(f"ratio must be in [0, 1], got {self.ratio}")

    def attack_kwargs(self) -> dict:
        d = asdict(self)
        d.pop("ratio")
        return d


@dataclass(frozen=True)
class RobustReport:
    clean: float  # accuracy on the inputs as given
    robust: float  # accuracy on PGD examples of the same inputs
    n: int


def _check(eps: float, step: float, steps: int, clamp: Sequence[float], std: Sequence[float] | float) -> None:
    if not eps >= 0 or not step >= 0:
        raise AdversarialError(f"eps and step must be >= 0, got {eps}, {step}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise AdversarialError(f"steps must be an integer >= 0, got {steps!r}")
    if len(clamp) != 2 or not clamp[0] < clamp[1]:
        raise AdversarialError(f"clamp must be (lo, hi) with lo < hi, got {clamp!r}")
    if any(not s > 0 for s in torch.as_tensor(std, dtype=torch.float64).reshape(-1).tolist()):
        raise AdversarialError(f"std must be > 0, got {std!r}")


def _per_channel(v: Sequence[float] | float, x: torch.Tensor) -> torch.Tensor:
    """Broadcastable (1, C, 1, ...) tensor of a scalar or per-channel value."""
    t = torch.as_tensor(v, dtype=x.dtype, device=x.device).reshape(-1)
    if t.numel() == 1:
        return t.reshape((1,) * x.dim())
    if x.dim() < 2 or x.shape[1] != t.numel():
        raise AdversarialError(f"{t.numel()} per-channel values for input of shape {tuple(x.shape)}")
    return t.reshape((1, -1) + (1,) * (x.dim() - 2))


def pgd_attack(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, eps: float = 8 / 255,
               step: float = 2 / 255, steps: int = 7, random_start: bool = True,
               clamp: tuple[float, float] = (0.0, 1.0), mean: Sequence[float] | float = 0.0,
               std: Sequence[float] | float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """L-inf PGD examples for normalised inputs ``x`` (N, C, ...) with labels ``y`` (N,).

    Returns a new detached tensor like ``x`` with ``|adv - x| <= eps / std``
    per channel and ``adv * std + mean`` inside ``clamp``.
    """
    _check(eps, step, steps, clamp, std)
    if x.dim() < 2 or y.shape != (x.shape[0],):
        raise AdversarialError(f"x must be (N, ...) and y (N,), got {tuple(x.shape)} and {tuple(y.shape)}")
    x = x.detach()
    mu, sigma = _per_channel(mean, x), _per_channel(std, x)
    lo, hi = (clamp[0] - mu) / sigma, (clamp[1] - mu) / sigma  # pixel range in normalised space
    eps_n, step_n = eps / sigma, step / sigma
    lower, upper = torch.maximum(x - eps_n, lo), torch.minimum(x + eps_n, hi)
    adv = x.clone()
    if random_start and eps > 0:  # uniform start inside the ball (and the pixel range)
        noise = torch.rand(x.shape, generator=generator, dtype=x.dtype).to(x.device)
        adv = torch.clamp(x + (2 * noise - 1) * eps_n, lower, upper)
    was_training = model.training
    model.eval()
    try:
        for _ in range(steps):
            adv.requires_grad_(True)
            loss = F.cross_entropy(model(adv), y)
            (grad,) = torch.autograd.grad(loss, adv)
            adv = torch.clamp(adv.detach() + step_n * grad.sign(), lower, upper)
    finally:
        model.train(was_training)
    return adv.detach()


def adversarial_batch(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, ratio: float = 0.5,
                      generator: torch.Generator | None = None, **pgd: object) -> torch.Tensor:
    """A copy of the batch with ``round(ratio * N)`` randomly chosen rows replaced
    by their PGD examples (labels unchanged); ``pgd`` goes to :func:`pgd_attack`."""
    if not 0.0 <= ratio <= 1.0:
        raise AdversarialError(f"ratio must be in [0, 1], got {ratio}")
    k = int(round(ratio * x.shape[0]))
    out = x.detach().clone()
    if k == 0:
        return out
    idx = torch.randperm(x.shape[0], generator=generator)[:k].to(x.device)
    out[idx] = pgd_attack(model, x[idx], y[idx], generator=generator, **pgd)
    return out


def robust_accuracy(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor] | Iterable[tuple[torch.Tensor, torch.Tensor]],
                    *, batch_size: int = 256, generator: torch.Generator | None = None,
                    **pgd: object) -> RobustReport:
    """Clean and PGD accuracy over ``(x, y)`` tensors or an iterable of batches
    (e.g. a DataLoader). The model is evaluated in eval mode."""
    if isinstance(data, tuple) and len(data) == 2 and isinstance(data[0], torch.Tensor):
        x, y = data
        batches: Iterable = ((x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, len(x), batch_size))
    else:
        batches = data
    clean = robust = n = 0
    was_training = model.training
    model.eval()
    try:
        for xb, yb in batches:
            with torch.no_grad():
                clean += int((model(xb).argmax(1) == yb).sum())
            adv = pgd_attack(model, xb, yb, generator=generator, **pgd)
            with torch.no_grad():
                robust += int((model(adv).argmax(1) == yb).sum())
            n += len(yb)
    finally:
        model.train(was_training)
    if n == 0:
        raise AdversarialError("no samples to evaluate")
    return RobustReport(clean=clean / n, robust=robust / n, n=n)
