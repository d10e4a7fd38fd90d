"""NIfTI slices, class maps, label validation, decompression bombs, spec options, `atd data inspect`."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from atdnode.data import DataSpec, load_dataset
from atdnode.errors import DataError
from cli.app import app
from tests.medimg import write_nifti, write_png16

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]


# --- NIfTI ----------------------------------------------------------------------------------

def _volume(v: int, n: int = 6) -> np.ndarray:
    x, y, z = np.meshgrid(np.arange(n), np.arange(n), np.arange(n), indexing="ij")
    return (1000.0 * v + 100 * z + 10 * x + y).astype(np.float32)  # slice (v, z) is identifiable


def _ids(d) -> list[tuple[int, int]]:
    """(volume, slice) of each loaded axis-2 slice, read back from its pixels (window 0..10000)."""
    base = (d.images[:, 0, 0, 0] * 0.5 + 0.5) * 10000
    return [(int(round(b)) // 1000, int(round(b)) % 1000 // 100) for b in base.tolist()]


def test_nifti_volume_yields_the_expected_slices(tmp_path):
    root = tmp_path / "vols"
    for v in range(6):
        write_nifti(root / f"vol{v}.nii.gz", _volume(v))
    (root / "labels.csv").write_text("".join(f"vol{v}.nii.gz,{'a' if v < 3 else 'b'}\n" for v in range(6)))
    write_nifti(root / "time.nii", np.zeros((6, 6, 6, 3), np.float32))
    (root / "readme.txt").write_text("x")
    spec = f"nifti:{root}?labels=labels.csv&window=0,10000"
    tr, te = load_dataset(spec, 6, 1, "train"), load_dataset(spec, 6, 1, "test")
    got = _ids(tr) + _ids(te)
    assert sorted(got) == [(v, k) for v in range(6) for k in range(6)]  # every slice once
    assert not {v for v, _ in _ids(tr)} & {v for v, _ in _ids(te)}  # a volume never straddles the split
    assert len({v for v, _ in _ids(te)}) == 2 and tr.classes == ["a", "b"]
    shards = [{v for v, _ in _ids(load_dataset(f"{spec}&shard={i}/2", 6, 1, "train"))} for i in (1, 2)]
    assert not shards[0] & shards[1] and shards[0] | shards[1] == {v for v, _ in _ids(tr)}  # whole volumes per node
    v, k = _ids(tr)[0]
    assert np.allclose((tr.images[0, 0] * 0.5 + 0.5).numpy() * 10000, _volume(v).take(k, axis=2), atol=1e-2)
    assert tr.labels.tolist() == [0 if v < 3 else 1 for v, _ in _ids(tr)]
    assert dict(tr.report.skipped) == {}  # time.nii / readme.txt are not listed in labels.csv
    # slice options
    sel = lambda opt: sorted({k for _, k in _ids(load_dataset(f"{spec}&{opt}&val=train", 6, 1, "train"))})  # noqa: E731
    assert sel("slices=1:5:2") == [1, 3] and sel("slices=mid") == [3] and sel("slices=0.5:1.0") == [3, 4, 5]
    ax = load_dataset(f"{spec}&axis=0&slices=4:5", 6, 1, "train")
    v = int(round(float(ax.images[0, 0, 0, 0]) * 0.5 * 10000 + 5000)) // 1000
    assert np.allclose((ax.images[0, 0] * 0.5 + 0.5).numpy() * 10000, _volume(v).take(4, axis=0), atol=1e-2)
    # class folders + a 4-D volume and a stray file: skipped and named; default min-max per slice
    for v in range(2):
        write_nifti(tmp_path / "cls" / f"c{v}" / f"v{v}.nii", _volume(v))
    write_nifti(tmp_path / "cls" / "c0" / "time.nii", np.zeros((6, 6, 6, 3), np.float32))
    (tmp_path / "cls" / "c1" / "readme.txt").write_text("x")
    d = load_dataset(f"nifti:{tmp_path / 'cls'}", 6, 1, "train")
    assert dict(d.report.skipped) == {"c0/time.nii": "4-D volume (6, 6, 6, 3); only 3-D volumes (or 2-D images) are read",
                                      "c1/readme.txt": "not a NIfTI file (.nii / .nii.gz)"}
    assert d.report.scaling == {"NIfTI slice, min-max per slice": len(d)} and float(d.images.min()) == -1.0


# --- class maps and label validation --------------------------------------------------------

def test_class_maps_for_every_source(tmp_path):
    (tmp_path / "names.json").write_text(json.dumps(["zero", "one", "two"]))
    with pytest.raises(DataError, match=r"label ids 3, 4, 5, 6, 7 and 2 more are not in the classes file \(3 classes\)"):
        load_dataset(f"digits?classes={tmp_path / 'names.json'}", 8, 1)
    (tmp_path / "digits.csv").write_text("id,name\n" + "".join(f"{i},d{i}\n" for i in range(10)))
    d = load_dataset(f"digits?classes={tmp_path / 'digits.csv'}&classes=d7,d3", 8, 1)
    assert d.classes == ["d3", "d7"] and set(d.labels.tolist()) == {0, 1}
    # npz: a map names ids and allows a class without samples (explicit list)
    np.savez(tmp_path / "m.npz", train_images=np.zeros((4, 4, 4), np.uint8), train_labels=np.array([0, 2, 0, 2]),
             test_images=np.zeros((2, 4, 4), np.uint8), test_labels=np.array([0, 2]))
    (tmp_path / "m.json").write_text(json.dumps({"0": "normal", "1": "benign", "2": "malignant"}))
    n = load_dataset(f"npz:{tmp_path / 'm.npz'}?classes={tmp_path / 'm.json'}", 4, 1)
    assert n.classes == ["normal", "benign", "malignant"] and n.class_counts() == [2, 0, 2]
    assert n.report.counts == {"train": {"normal": 2, "benign": 0, "malignant": 2},
                               "test": {"normal": 1, "benign": 0, "malignant": 1}}
    with pytest.raises(DataError, match="label ids are not dense"):
        load_dataset(f"npz:{tmp_path / 'm.npz'}", 4, 1)
    # folder: keys are folder names
    for c in ("cat", "dog"):
        write_png16(tmp_path / "f" / c / "x.png", np.arange(16).reshape(4, 4))
    (tmp_path / "f.csv").write_text("dog,Canis\ncat,Felis\n")
    f = load_dataset(f"folder:{tmp_path / 'f'}?classes={tmp_path / 'f.csv'}", 4, 1)
    assert f.classes == ["Canis", "Felis"] and f.labels.tolist() == [1, 0]
    (tmp_path / "short.csv").write_text("cat,Felis\n")
    with pytest.raises(DataError, match=r"label ids dog are not in the classes file \(1 classes\)"):
        load_dataset(f"folder:{tmp_path / 'f'}?classes={tmp_path / 'short.csv'}", 4, 1)
    (tmp_path / "dup.json").write_text(json.dumps({"cat": "x", "dog": "x"}))
    with pytest.raises(DataError, match="not unique"):
        load_dataset(f"folder:{tmp_path / 'f'}?classes={tmp_path / 'dup.json'}", 4, 1)
    with pytest.raises(DataError, match="classes file not found"):
        load_dataset(f"digits?classes={tmp_path / 'none.json'}", 4, 1)


def test_labels_must_be_dense_and_bounded(tmp_path):
    np.savez(tmp_path / "big.npz", train_images=np.zeros((3, 4, 4), np.uint8), train_labels=np.array([0, 1, 10**9]))
    with pytest.raises(DataError, match=r"big.npz: label ids out of range: must be 0..K-1 with K <= the number of samples \(3\)"):
        load_dataset(f"npz:{tmp_path / 'big.npz'}", 4, 1)  # used to build 10^9 class names
    (tmp_path / "3.json").write_text(json.dumps(["a", "b", "c"]))
    with pytest.raises(DataError, match=r"label ids 1000000000 are not in the classes file"):
        load_dataset(f"npz:{tmp_path / 'big.npz'}?classes={tmp_path / '3.json'}", 4, 1)


def _npz_claiming(path: Path, shape: tuple[int, ...]) -> None:
    """An .npz whose train_images header announces `shape` but holds almost nothing."""
    import io
    import zipfile

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "|u1", "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("train_images.npy", buf.getvalue() + b"\0" * 16)
        lab = io.BytesIO()
        np.save(lab, np.zeros(2, np.int64))
        zf.writestr("train_labels.npy", lab.getvalue())


def _bomb_png(path: Path, side: int = 40000) -> None:
    """A PNG whose header claims side x side pixels (a decompression bomb's header)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 4096))
                     + chunk(b"IEND", b""))


@pytest.mark.slow  # an atd process
def test_image_size_limits_are_one_line_data_errors(tmp_path, monkeypatch):
    _bomb_png(tmp_path / "f" / "a" / "bomb.png")
    write_png16(tmp_path / "f" / "a" / "ok.png", np.arange(16).reshape(4, 4))
    with pytest.raises(DataError, match=r"bomb.png: refused, Image size \(1600000000 pixels\) exceeds limit") as ei:
        load_dataset(f"folder:{tmp_path / 'f'}?val=train", 4, 1)
    assert "\n" not in str(ei.value)
    # the warning band (between the limit and twice it) is refused too
    small = tmp_path / "g" / "a"
    small.mkdir(parents=True)
    Image.new("L", (12, 12)).save(small / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(DataError, match="big.png: refused"):
        load_dataset(f"folder:{tmp_path / 'g'}", 4, 1)
    monkeypatch.undo()
    vol = write_nifti(tmp_path / "n" / "a" / "v.nii", np.zeros((2, 2, 2), np.float32))
    raw = bytearray(vol.read_bytes())
    struct.pack_into("<hhhh", raw, 40, 3, 9000, 9000, 5)  # header dims only: each slice is under the limit
    vol.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"v.nii \(volume / 4\): image of 101250000 pixels exceeds"):
        load_dataset(f"nifti:{tmp_path / 'n'}", 4, 1)
    _npz_claiming(tmp_path / "huge.npz", (10**6, 10**4, 10**4))
    with pytest.raises(DataError, match=r"huge.npz: arrays need \d+\.\d GiB"):
        load_dataset(f"npz:{tmp_path / 'huge.npz'}", 4, 1)
    # through the CLI: one line on stderr, no traceback
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "cli.app", "data", "inspect", f"folder:{tmp_path / 'f'}",
                        "--out", str(tmp_path / "s.png")], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr + r.stdout
    assert len(r.stderr.strip().splitlines()) == 1 and "bomb.png: refused" in r.stderr


# --- spec options ---------------------------------------------------------------------------

def test_spec_options_parse_and_are_checked_per_source(tmp_path):
    s = DataSpec.parse("dicom:/d?labels=l.csv&window=-1000,400&frame=2&val=train&classes=m.json&classes=a,b")
    assert (s.labels, s.window, s.frame, s.val, s.class_map, s.classes) == ("l.csv", (-1000.0, 400.0), 2, "train", "m.json", ("a", "b"))
    n = DataSpec.parse("nifti:/v?axis=0&slices=0.25:0.75&window=auto")
    assert (n.axis, n.slices, n.window) == (0, ("frac", 0.25, 0.75), "auto")
    assert DataSpec.parse("nifti:/v?slices=2:10:3").slices == ("idx", 2, 10, 3)
    for bad, why in [("digits?axis=1", "does not apply to digits"), ("folder:/x?slices=mid", "does not apply"),
                     ("npz:/x?labels=a.csv", "does not apply"), ("digits?window=5,1", "lo < hi"),
                     ("digits?window=1", ""), ("digits?val=none", "val=none: expected"), ("nifti:/v?axis=3", "out of range"),
                     ("nifti:/v?slices=1:2:0", "step"), ("nifti:/v?slices=0.5:0.2", "fractions"),
                     ("digits?classes=a.json&classes=b.json", "twice"), ("digits?limit=3&limit=4", "twice")]:
        with pytest.raises(DataError, match="bad data spec.*" + why):
            DataSpec.parse(bad)


# --- atd data inspect -----------------------------------------------------------------------

def test_data_inspect_prints_counts_scaling_skips_and_writes_a_contact_sheet(tmp_path):
    root = tmp_path / "xr"
    for c, n in (("normal", 5), ("pneumonia", 4)):
        for i in range(n):
            write_png16(root / c / f"{i}.png", np.arange(64).reshape(8, 8) * (i + 1) * 100)
    (root / "normal" / "scan.dcm").write_bytes(b"x")
    out = tmp_path / "sheet.png"
    r = CliRunner().invoke(app, ["data", "inspect", f"folder:{root}", "--out", str(out), "--per-class", "3",
                                 "--img-size", "16"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[1] == "  classes (2): normal, pneumonia"
    assert lines[3].split() == ["train", "3", "2", "5"] and lines[4].split() == ["val", "1", "1", "2"]  # val: carved
    assert lines[5].split() == ["test", "1", "1", "2"]
    assert "native shapes: 8x8 x9; dtypes: uint16 x9" in r.stdout and "uint16, min-max per image x9" in r.stdout
    assert "skipped (1):" in r.stdout and "normal/scan.dcm: not an image (DICOM: use dicom:PATH)" in r.stdout
    with Image.open(out) as im:
        assert im.size == (140 + 3 * 68, 2 * 68)
    r = CliRunner().invoke(app, ["data", "inspect", f"folder:{root}", "--out", str(out), "--json"])
    d = json.loads(r.stdout)
    assert d["counts"]["train"] == {"normal": 3, "pneumonia": 2} and d["skipped"] == [["normal/scan.dcm", "not an image (DICOM: use dicom:PATH)"]]


def test_training_evaluates_the_val_split_each_epoch(tmp_path):
    from sklearn.datasets import load_digits

    from atdnode.node import NodeHome, init_home
    from atdnode.learning import ModelConfig, TrainOptions, resolve_config, train

    d = load_digits()
    x, y = (d.images * 15).astype(np.uint8)[:300], d.target[:300]
    np.savez(tmp_path / "m.npz", train_images=x[:200], train_labels=y[:200], val_images=x[200:250],
             val_labels=y[200:250], test_images=x[250:], test_labels=y[250:])
    home = NodeHome.at(tmp_path / "node")
    init_home(home, consortium="demo")
    logs: list[str] = []
    cfg = resolve_config("vit_tiny_patch16_224", img_size=8, patch_size=4, embed_dim=32, depth=1, num_heads=2,
                          in_chans=1)
    rec = train(home, f"npz:{tmp_path / 'm.npz'}", cfg,
                TrainOptions(epochs=2, batch_size=32, lr=1e-3, log=logs.append, plots=False))
    assert rec.samples == 200 and rec.metrics["n"] == 50  # val is neither trained on nor the test set
    hist = rec.metrics["history"]
    assert len(hist) == 2
    # the last epoch's held-out numbers are the final model's on the val split (not on test)
    from atdnode.blobs import BlobStore
    from atdnode.learning import build_model, load_part, part_spec
    from atdnode.learning.training import heldout_loss_accuracy
    from atdnode.models import load_weights

    model = build_model(ModelConfig.from_dict(rec.model))
    load_part(model, load_weights(BlobStore(home.blobs_dir), rec.blobs["full"], expect=part_spec(model, "full"))[0], "full")
    spec = f"npz:{tmp_path / 'm.npz'}"
    on_val = heldout_loss_accuracy(model, load_dataset(spec, 8, 1, "val"))
    on_test = heldout_loss_accuracy(model, load_dataset(spec, 8, 1, "test"))
    assert hist[-1]["val_loss"] == pytest.approx(on_val["val_loss"], rel=1e-5) and on_val["val_loss"] != on_test["val_loss"]
    assert hist[-1]["val_accuracy"] == pytest.approx(on_val["val_accuracy"])  # the recorded number is recomputable
    assert any("val_acc=" in line for line in logs) and any(line.startswith("data npz:") and "[val]: 50 images" in line for line in logs)


def test_folder_labels_csv_with_splits_directories_and_errors(tmp_path):
    root = tmp_path / "imgs"
    for i in range(4):
        write_png16(root / "flat" / f"{i}.png", np.full((4, 4), i * 1000) + np.eye(4, dtype=np.int64))
    write_png16(root / "series" / "s1" / "a.png", np.eye(4) * 7)
    write_png16(root / "series" / "s1" / "b.png", np.eye(4) * 9)
    (root / "labels.csv").write_text("path,class\n" + "flat/0.png,ok\nflat/1.png,ok\nflat/2.png,bad\n"
                                     "flat/3.png,bad\nseries/s1,bad\n")  # a row may name a folder
    tr = load_dataset(f"folder:{root}?labels=labels.csv&val=train", 4, 1, "train")  # no split column: seeded 80/20
    te = load_dataset(f"folder:{root}?labels=labels.csv", 4, 1, "test")
    assert tr.classes == ["bad", "ok"] and tr.class_counts() == [3, 2] and te.class_counts() == [1, 0]
    (root / "split.csv").write_text("flat/0.png,ok,train\nflat/1.png,ok,test\nflat/2.png,bad,train\nflat/3.png,bad,val\n")
    spec = f"folder:{root}?labels=split.csv"
    assert [len(load_dataset(spec, 4, 1, s)) for s in ("train", "val", "test")] == [2, 1, 1]
    (root / "mixed.csv").write_text("flat/0.png,ok,train\nflat/1.png,ok\n")
    with pytest.raises(DataError, match="give a split for every row or for none"):
        load_dataset(f"folder:{root}?labels=mixed.csv", 4, 1)
    (root / "badsplit.csv").write_text("flat/0.png,ok,holdout\n")
    with pytest.raises(DataError, match="split 'holdout' is not train, val or test"):
        load_dataset(f"folder:{root}?labels=badsplit.csv", 4, 1)
    with pytest.raises(DataError, match="labels file .*nope.csv not found"):
        load_dataset(f"folder:{root}?labels=nope.csv", 4, 1)
