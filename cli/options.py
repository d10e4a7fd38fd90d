"""Options shared by every `atd` command.

`HOME_OPT` is the one `--home` option: when it is absent the home comes from the
ATD_HOME environment variable, so `export ATD_HOME=/srv/atd/node1` once is enough.
Every command taking a node home uses it (`test_cli_errors` checks that), and opens the node
with `node_home` (one prologue: the home must have been made by `atd init`), e.g.

    def cmd(home: Path = HOME_OPT) -> None:
        h = node_home(home)

`node_home` returns a `NodeHandle` (atdnode.node.handle): the command passes it down, so its config,
ledger, blob store and model registry are opened once per command; its ledger closes when the
command ends (`closing_nodes`).
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import typer

from cli.choices import choice
from protocols.vit_config import STEMS

if TYPE_CHECKING:
    from atdnode.node import NodeHandle

HOME_ENV = "ATD_HOME"

HOME_HELP = "Node home directory (made by `atd init`)."

HOME_OPT = typer.Option(..., "--home", envvar=HOME_ENV, show_envvar=True, help=HOME_HELP)


_OPENED: list["NodeHandle"] = []  # the nodes the running command opened (`closing_nodes` closes them)


def node_home(home: Path) -> "NodeHandle":
    """The node at `home`, which `atd init` made (ConfigError, one line, otherwise), opened once for
    the running command (closed when it ends: `closing_nodes`)."""
    from atdnode.node import open_node

    node = open_node(home)
    _OPENED.append(node)
    return node


@contextmanager
def closing_nodes() -> Iterator[None]:
    """Close, when the command ends (however it ends), the nodes it opened with `node_home`; the
    app holds it around every command (`cli.app`)."""
    try:
        yield
    finally:
        while _OPENED:
            _OPENED.pop().close()


def home_option(help: str = HOME_HELP) -> typer.models.OptionInfo:
    """The shared --home option with a command-specific help text (same flag, same env var)."""
    return typer.Option(..., "--home", envvar=HOME_ENV, show_envvar=True, help=help)


DEVICE_HELP = ("Device that runs the model: cpu, cuda or cuda:N (default: [compute] device in "
               "config.toml, else cuda when present).")

DEVICE_OPT = typer.Option(None, "--device", help=DEVICE_HELP)


# --- model options: one definition for every command that builds a ViT (`atd train`, `atd rounds`) ---

MODEL_OPT = typer.Option("vit_tiny_patch16_224", "--model", help="timm ViT name (vit_*).")
IMG_SIZE_OPT = typer.Option(None, "--img-size", min=1, help="Image size (default: the model's).")
PATCH_SIZE_OPT = typer.Option(None, "--patch-size", min=1, help="Patch size (default: the model's).")
EMBED_DIM_OPT = typer.Option(None, "--embed-dim", min=1, help="Embedding width (default: the model's).")
DEPTH_OPT = typer.Option(None, "--depth", min=1, help="Number of blocks (default: the model's).")
HEADS_OPT = typer.Option(None, "--heads", min=1, help="Attention heads (default: the model's).")
IN_CHANS_OPT = typer.Option(None, "--in-chans", min=1, help="Input channels (default: the model's, 3).")
MLP_RATIO_OPT = typer.Option(None, "--mlp-ratio", help="MLP width / embedding width (default: the model's, 4).")
Stem = choice("Stem", STEMS)
STEM_OPT = typer.Option(None, "--stem", help="Image to tokens: patch (timm's patch embedding) or conv (a small "
                        "convolutional stem, Xiao et al. 2021; needs a power-of-two patch size). Default: patch.")


def model_config(model: str, *, img_size: int | None, patch_size: int | None, embed_dim: int | None,
                 depth: int | None, heads: int | None, in_chans: int | None, mlp_ratio: float | None,
                 stem: str | None = None):
    """The `ModelConfig` the model options above describe (None: timm's default for `model`)."""
    from atdnode.learning import resolve_config

    return resolve_config(model, img_size=img_size, patch_size=patch_size, embed_dim=embed_dim, depth=depth,
                           num_heads=heads, in_chans=in_chans, mlp_ratio=mlp_ratio,
                           stem=None if stem is None else str(stem))


# --- federated adversarial training (PGD) options, shared by `atd train` and `atd rounds` ---

ADVERSARIAL_HELP = "Federated adversarial training: mix PGD examples into each batch; also reports robust accuracy."
ADV_RATIO_OPT = typer.Option(0.5, "--adv-ratio", help="Share of each batch replaced by PGD examples.")
PGD_EPS_OPT = typer.Option("8/255", "--pgd-eps", help="PGD L-inf radius in pixel units (a number or a fraction).")
PGD_STEP_OPT = typer.Option("2/255", "--pgd-step", help="PGD step size in pixel units.")
PGD_STEPS_OPT = typer.Option(7, "--pgd-steps", min=0, help="PGD steps.")


def fraction(text: str) -> float:
    """'8/255' or '0.03' -> float; CliError otherwise."""
    from cli.errors import CliError

    try:
        num, _, den = text.partition("/")
        return float(num) / float(den) if den else float(num)
    except (ValueError, ZeroDivisionError):
        raise CliError(f"not a number or fraction: {text!r}") from None


def pgd_transform(*, adv_ratio: float, pgd_eps: str, pgd_step: str, pgd_steps: int, in_chans: int):
    """The `AdversarialTransform` the PGD options describe (the data's normalisation per channel)."""
    from atdnode.data import MEAN, STD
    from atdnode.learning import AdversarialTransform
    from cli.errors import CliError
    from protocols.adversarial import AdversarialError, PGDConfig

    try:
        return AdversarialTransform(PGDConfig(eps=fraction(pgd_eps), step=fraction(pgd_step), steps=pgd_steps,
                                              ratio=adv_ratio, mean=(MEAN,) * in_chans, std=(STD,) * in_chans))
    except AdversarialError as exc:
        raise CliError(f"--adversarial: {exc}") from None
