"""`atd classify` on plain models (label spaces matched by name), its errors, and
`atd train --adversarial` reporting clean and robust accuracy."""
from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from atdnode.learning import ClassifyError
from atdnode.errors import ConfigError, DataError
from atdnode.node import NodeHome, init_home
from cli.app import app
from cli.errors import CliError
from tests.factories import cli_json as cli
from tests.vgs_homes import CFG, copy_homes, latest

runner = CliRunner()


@pytest.fixture
def trio(vgs_template, tmp_path):
    template = vgs_template("disjoint")
    return copy_homes(template, tmp_path / "homes")


def test_classify_matches_training_metrics_on_the_same_split(trio):
    a = trio[0]
    rec = latest(a)
    out = cli("classify", "--home", str(a.root), "--data", rec.provenance["data"])
    assert out["kind"] == "model" and out["model"] == rec.id and out["classes"] == ["0", "1", "2"]
    for k in ("accuracy", "precision", "sensitivity", "f1"):
        assert out[k] == pytest.approx(rec.metrics[k if k != "sensitivity" else "recall"], abs=1e-12), k
    assert out["confusion"] == rec.metrics["confusion"] and out["n"] == rec.metrics["n"]


def test_classes_the_model_does_not_know_count_as_errors(trio, tmp_path):
    a = trio[0]
    png = tmp_path / "cm.png"
    out = cli("classify", "--home", str(a.root), "--data", "digits", "--out", str(png))
    assert out["unknown_classes"] == [str(i) for i in range(3, 10)] and out["classes"] == [str(i) for i in range(10)]
    assert len(out["confusion"]) == 10 and sum(map(sum, out["confusion"])) == out["n"] == 359
    # only rows 0-2 can have correct predictions; columns 3-9 stay empty (the model has no such class)
    assert all(out["confusion"][r][c] == 0 for r in range(10) for c in range(3, 10))
    assert out["accuracy"] <= 108 / 359 and png.read_bytes()[:4] == b"\x89PNG" and out["png"] == str(png)
    r = runner.invoke(app, ["classify", "--home", str(a.root), "--data", "digits"])
    assert r.exit_code == 0 and "sensitivity" in r.stdout and "does not know: 3, 4" in r.stdout
    assert (a.root / "classify").is_dir()


@pytest.mark.parametrize("args, error, why", [
    (["--data", "digits?classes=7,8"], ClassifyError, "none of the data's"),
    (["--data", "digits?classes=x"], DataError, "unknown classes"),
    (["--data", "digits", "--model", "nope"], ConfigError, "not found"),
    (["--data", "digits?val=train", "--split", "val"], DataError, "no val split"),
])
def test_classify_errors(trio, args, error, why):
    r = runner.invoke(app, ["classify", "--home", str(trio[0].root), *args])
    assert isinstance(r.exception, error) and why in str(r.exception), r.exception


def test_train_adversarial_reports_clean_and_robust_accuracy(tmp_path):
    """Adversarial training is judged against a plainly trained model of the same seed, data and
    recipe, under the same PGD attack on the same split: it must be clearly more robust (a no-op
    --adversarial trains the very same weights, and ties)."""
    data = "digits?classes=0,1&limit=120"
    attack = ["--pgd-steps", "3", "--pgd-eps", "16/255", "--pgd-step", "6/255"]
    tiny = ["--model", "vit_tiny_patch16_224", "--img-size", str(CFG["img_size"]), "--patch-size",
            str(CFG["patch_size"]), "--embed-dim", "32", "--depth", "1", "--heads", "2", "--epochs", "4",
            "--batch-size", "16", "--no-augment", "--seed", "0", "--device", "cpu"]
    homes = {}
    for kind in ("adversarial", "plain"):
        homes[kind] = NodeHome.at(tmp_path / kind)
        init_home(homes[kind], consortium="demo")
    home = homes["adversarial"]
    args = ["train", "--home", str(home.root), "--data", data, *tiny, "--adversarial", "--adv-ratio", "0.5", *attack]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, (r.output, r.exception)
    assert "robust accuracy (PGD)" in r.stdout and "test split" in r.stdout
    m = latest(home).metrics
    assert latest(home).provenance["options"]["transform"]["adversarial"] == "pgd"
    # `atd classify --robust` runs the same attack on the same split: the same number
    out = cli("classify", "--home", str(home.root), "--data", data, "--robust", *attack)
    assert out["accuracy"] == m["accuracy"] and out["robust_accuracy"] == pytest.approx(m["robust_accuracy"])
    r = runner.invoke(app, ["train", "--home", str(homes["plain"].root), "--data", data, *tiny])
    assert r.exit_code == 0, (r.output, r.exception)
    plain = cli("classify", "--home", str(homes["plain"].root), "--data", data, "--robust", *attack)
    print(f"robust accuracy: adversarially trained {m['robust_accuracy']:.3f} (clean {m['accuracy']:.3f}), "
          f"plainly trained {plain['robust_accuracy']:.3f} (clean {plain['accuracy']:.3f})")
    assert m["robust_accuracy"] <= m["accuracy"] and m["accuracy"] > 0.75  # two balanced classes: chance 0.5
    assert m["robust_accuracy"] >= plain["robust_accuracy"] + 0.05  # clearly more robust under the same attack
    r = runner.invoke(app, ["classify", "--home", str(home.root), "--data", "digits", "--robust", "--pgd-eps", "-1"])
    assert isinstance(r.exception, CliError) and "eps" in str(r.exception)
    r = runner.invoke(app, [*args[:args.index("--adversarial")], "--adversarial", "--adv-ratio", "2"])
    assert isinstance(r.exception, CliError) and "ratio" in str(r.exception)


def _digit_pngs(root, classes, per_class: int) -> None:
    """`per_class` real digit images of each class as 8-bit PNGs, one folder per class."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    d = load_digits()
    for c in classes:
        (root / c).mkdir(parents=True)
        for i, img in enumerate(d.images[d.target == int(c)][:per_class]):
            Image.fromarray((img * 255 / 16).astype(np.uint8)).save(root / c / f"{i}.png")


def test_classify_scores_every_image_of_a_folder_and_says_so(trio, tmp_path):
    a = trio[0]
    tree = tmp_path / "labelled"
    _digit_pngs(tree, ["0", "1", "2"], 67)  # 201 images, no split of their own
    r = runner.invoke(app, ["classify", "--home", str(a.root), "--data", f"folder:{tree}"])
    assert r.exit_code == 0, (r.output, r.exception)
    assert "scored: all split, n=201" in r.stdout and "declares no splits" in r.stdout
    for c in ("0", "1", "2"):  # n per class, each recall with its interval
        assert re.search(rf"^  {c}\s+67  \d\.\d{{3}} \[\d\.\d{{3}}, \d\.\d{{3}}\]$", r.stdout, re.M), r.stdout
    assert re.search(r"accuracy +\d\.\d{3} \[\d\.\d{3}, \d\.\d{3}\]  n=201", r.stdout)
    assert "calibration error (ECE" in r.stdout and "reliability plot" in r.stdout
    out = cli("classify", "--home", str(a.root), "--data", f"folder:{tree}", "--split", "test")
    assert out["split"] == "test" and out["n"] < 60  # the seeded 20 % only when asked
    # a folder holding only test/ is a test split, not a class named "test"
    only = tmp_path / "only-test"
    _digit_pngs(only / "test", ["0", "1"], 20)
    out = cli("classify", "--home", str(a.root), "--data", f"folder:{only}")
    assert out["split"] == "test" and out["n"] == 40 and out["classes"][:2] == ["0", "1"]
    assert "binary" not in out and out["calibration"]["n"] == 40  # the model also knows "2": three labels
    assert set(out["per_class"]) == {"0", "1"}
