"""`atd predict` on unlabelled PNG and DICOM folders and single files: one CSV row per image,
probabilities that sum to 1, the argmax as the prediction, the model id, the training
readers' intensity rules — and the same predictions as `atd classify` scores."""
from __future__ import annotations

import csv
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from atdnode.learning import TrainOptions, resolve_config, run_classify as classify, run_predict as predict, train
from atdnode.node import NodeHome, init_home
from cli.app import run
from tests.medimg import write_dicom

torch.set_num_threads(1)
CLASSES = ("bright", "dark", "stripes")
SIZE = 16


def _image(rng: np.random.Generator, cls: str) -> np.ndarray:
    """(SIZE, SIZE) uint8: bright or dark noise, or vertical stripes."""
    if cls == "stripes":
        x = np.tile(np.where(np.arange(SIZE) % 4 < 2, 30.0, 220.0), (SIZE, 1))
    else:
        x = np.full((SIZE, SIZE), 200.0 if cls == "bright" else 55.0)
    return np.clip(x + rng.normal(0, 25, x.shape), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A node with a tiny 1-channel ViT trained on pngs/{train,test}/CLASS/*.png."""
    base = tmp_path_factory.mktemp("predict")
    rng = np.random.default_rng(0)
    root = base / "pngs"
    for split, n in (("train", 24), ("test", 8)):
        for c in CLASSES:
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                Image.fromarray(_image(rng, c)).save(root / split / c / f"{c}{i:02d}.png")
    home = NodeHome.at(base / "node")
    init_home(home, consortium="demo")
    cfg = resolve_config("vit_tiny_patch16_224", img_size=SIZE, patch_size=4, embed_dim=32, depth=1,
                          num_heads=2, in_chans=1)
    rec = train(home, f"folder:{root}", cfg, TrainOptions(epochs=4, batch_size=16, lr=3e-3, augment=False,
                                                          epoch_eval=False, device="cpu", plots=False))
    return home, root, rec


def _rows(path: Path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        r = csv.DictReader(f)
        return list(r.fieldnames or []), list(r)


def _check_csv(path: Path, n: int, model_id: str, classes: list[str]) -> list[dict]:
    header, rows = _rows(path)
    assert header == ["file", "predicted", "probability", *(f"p:{c}" for c in classes), "model"]
    assert len(rows) == n
    for row in rows:
        p = np.array([float(row[f"p:{c}"]) for c in classes])
        assert abs(p.sum() - 1) < 1e-5 and (p >= 0).all()
        assert row["predicted"] == classes[int(p.argmax())] and float(row["probability"]) == pytest.approx(p.max())
        assert row["model"] == model_id
    return rows


def test_predict_unlabelled_png_folder_agrees_with_classify(trained, tmp_path, capsys):
    home, root, rec = trained
    # the model's score on the labelled test split, as `atd classify` computes it
    scored = classify(home, f"folder:{root}", split="test", out=tmp_path / "cm.png")
    labelled = predict(home, [f"folder:{root / 'test'}"], device="cpu")  # class folders are allowed, and ignored
    truth = [Path(f).parent.name for f in labelled.files]
    acc = float(np.mean([p == t for p, t in zip(labelled.predicted, truth)]))
    assert acc == pytest.approx(scored.metrics["accuracy"], abs=1e-12)  # the same predictions as classify
    assert acc >= 1 / 3 + 0.3, acc  # well above chance (and the majority rate, 1/3)

    # the same images, unlabelled: a flat folder, no class sub-folders
    flat = tmp_path / "new scans"
    flat.mkdir()
    for f in labelled.files:
        shutil.copy(f, flat / f"{Path(f).parent.name}-{Path(f).name}")
    (flat / "notes.txt").write_text("not an image")
    out = tmp_path / "predictions.csv"
    assert run(["predict", "--home", str(home.root), "--data", f"folder:{flat}", "--out", str(out)]) == 0
    text, err = capsys.readouterr()
    assert f"model {rec.id}" in text and str(out) in text and "notes.txt" in err
    rows = _check_csv(out, len(labelled.files), rec.id, list(rec.labels))
    seen: list[tuple[str, int, int]] = []  # the progress bar's updates: a total that holds
    small = predict(home, [f"folder:{flat}"], device="cpu", chunk=5,  # read 5 files at a time: the same result
                    progress=lambda stage, done, total: seen.append((stage, done, total)))
    assert len(seen) > 2 and len({t for _, _, t in seen}) == 1 and all(0 <= d <= t for _, d, t in seen)
    assert [d for _, d, _ in seen] == sorted(d for _, d, _ in seen) and seen[-1][1] == seen[-1][2]
    assert small.files == [r["file"] for r in rows] and small.skipped == [(str(flat / "notes.txt"), small.skipped[0][1])]
    assert np.allclose(small.probs, [[float(r[f"p:{c}"]) for c in rec.labels] for r in rows], atol=1e-6)
    by_file = dict(zip(labelled.files, labelled.predicted))
    for row in rows:
        name = Path(row["file"]).name
        cls, _, orig = name.partition("-")
        assert row["predicted"] == by_file[str(root / "test" / cls / orig)]


def test_predict_dicom_folder_and_single_files(trained, tmp_path, capsys):
    home, root, rec = trained
    pngs = sorted((root / "test").rglob("*.png"))[::3]
    dicoms = tmp_path / "dicom"
    for i, p in enumerate(pngs):  # the same pixels, stored 16-bit with a window that maps 0..255 onto 0..1
        stored = np.asarray(Image.open(p)).astype(np.uint16)
        write_dicom(dicoms / "patient" / f"{i:03d}.dcm", stored, window=(128.0, 256.0))
    (dicoms / "patient" / "readme.dcm").write_bytes(b"not dicom")
    out = tmp_path / "dicom.csv"
    argv = ["predict", "--home", str(home.root), "--data", f"dicom:{dicoms}", "--out", str(out), "--device", "cpu"]
    assert run(argv) == 0
    assert "readme.dcm" in capsys.readouterr().err
    rows = _check_csv(out, len(pngs), rec.id, list(rec.labels))
    # the DICOM header's window gives the PNGs' 8-bit scaling: the same probabilities
    from_png = predict(home, [str(p) for p in pngs], device="cpu")
    assert from_png.files == [str(p) for p in pngs]
    got = np.array([[float(r[f"p:{c}"]) for c in rec.labels] for r in rows])
    assert np.allclose(got, from_png.probs, atol=1e-5)
    # single files, mixed: one image, one DICOM
    mixed = predict(home, [str(pngs[0]), str(dicoms / "patient" / "000.dcm")], device="cpu")
    assert mixed.files == [str(pngs[0]), str(dicoms / "patient" / "000.dcm")]
    assert np.allclose(mixed.probs[0], mixed.probs[1], atol=1e-6)


def _one_line_error(capsys, argv: list[str]) -> str:
    assert run(argv) != 0
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in out + err, err
    return err


def test_predict_errors_are_one_line(trained, tmp_path, capsys):
    home, root, _ = trained
    base = ["predict", "--home", str(home.root), "--out", str(tmp_path / "p.csv"), "--data"]
    (tmp_path / "empty").mkdir()
    assert "atd predict reads folder:DIR" in _one_line_error(capsys, [*base, "digits"])
    assert "did you mean 'dicom'" in _one_line_error(capsys, [*base, f"dicm:{root}"])
    assert "no images found" in _one_line_error(capsys, [*base, f"folder:{tmp_path / 'empty'}"])
    assert "does not apply to prediction" in _one_line_error(capsys, [*base, f"folder:{root}?classes=dark"])
    assert f"give folder:{root}" in _one_line_error(capsys, [*base, str(root)])
    # a device this machine lacks is refused before any image is read (the folder does not exist)
    bad = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    err = _one_line_error(capsys, [*base, f"folder:{tmp_path / 'missing'}", "--device", bad])
    assert "device" in err and "missing" not in err
    assert not (tmp_path / "p.csv").exists()


def test_the_training_window_applies_to_new_images(trained, tmp_path):
    home, root, _ = trained
    cfg = resolve_config("vit_tiny_patch16_224", img_size=SIZE, patch_size=4, embed_dim=32, depth=1,
                          num_heads=2, in_chans=1)
    rec = train(home, f"folder:{root}?window=0,128", cfg, TrainOptions(epochs=1, batch_size=16, lr=3e-3, augment=False,
                                                                      epoch_eval=False, device="cpu", plots=False))
    new = [f"folder:{root / 'test' / 'bright'}"]
    inherited = predict(home, new, model=rec.id, device="cpu")
    assert inherited.scaling == {"window 0..128": len(inherited.files)}
    explicit = predict(home, [f"{new[0]}?window=0,128"], model=rec.id, device="cpu")
    assert np.array_equal(inherited.probs, explicit.probs)
    other = predict(home, [f"{new[0]}?window=0,255"], model=rec.id, device="cpu")  # a given window wins
    assert other.scaling == {"window 0..255": len(other.files)} and not np.allclose(other.probs, inherited.probs)


def test_training_window_auto_is_the_training_splits(trained, tmp_path):
    from atdnode.data import load_dataset
    from atdnode.data import training_window

    _, root, _ = trained
    spec = f"folder:{root}?window=auto"
    assert training_window(spec) == load_dataset(spec, SIZE, 1, "train").report.auto_window
    assert training_window(f"folder:{root}") is None and training_window(f"{spec[:-4]}minmax") == "minmax"
