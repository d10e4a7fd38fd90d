"""dicom:PATH — rescale, VOI window / LUT / SIGMOID, MONOCHROME1, frames, compression, skips,
no header leaving the loader; acceptance: a CT-like tree trains one epoch and equals 16-bit PNGs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from atdnode.data import load_dataset
from atdnode.errors import DataError
from tests.medimg import SECRET, ct_slice, damaged, outcomes_of, write_dicom, write_png16

torch.set_num_threads(1)
SLOPE, INTERCEPT, WINDOW = 0.5, -1024.0, (40.0, 400.0)  # stored = (HU + 1024) * 2; soft-tissue window
# DICOM PS3.3 C.11.2.1.2.1 linear window -> lo..hi in HU
LO, HI = WINDOW[0] - 0.5 - (WINDOW[1] - 1) / 2, WINDOW[0] - 0.5 + (WINDOW[1] - 1) / 2


def _stored(hu: np.ndarray) -> np.ndarray:
    return ((np.round(hu) - INTERCEPT) / SLOPE).astype(np.uint16)


def _ct_tree(tmp_path, size=24, per_class=8):
    """dicom/{normal,lesion}/NN.dcm (one MONOCHROME1 twin, one truncated file) and the same
    stored pixels as 16-bit PNGs under png/ (the MONOCHROME1 twin as its MONOCHROME2 original)."""
    rng = np.random.default_rng(0)
    root, png = tmp_path / "dicom", tmp_path / "png"
    for cls in ("normal", "lesion"):
        for i in range(per_class):
            hu = np.round(ct_slice(rng, size, lesion=cls == "lesion"))
            name = f"{i:02d}"
            write_png16(png / cls / f"{name}.png", _stored(hu))
            if cls == "lesion" and i == 3:  # MONOCHROME1: stored so that inverted display == the original
                write_dicom(root / cls / f"{name}.dcm", _stored(79.0 - hu), slope=SLOPE, intercept=INTERCEPT,
                            window=WINDOW, photometric="MONOCHROME1")
            else:
                write_dicom(root / cls / f"{name}.dcm", _stored(hu), slope=SLOPE, intercept=INTERCEPT, window=WINDOW)
    good = (root / "normal" / "00.dcm").read_bytes()
    (root / "normal" / "99.dcm").write_bytes(good[: len(good) // 2])  # truncated: DICM preamble, no pixels
    (png / "normal" / "99.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    return root, png


def test_acceptance_dicom_tree_trains_one_epoch_and_equals_16bit_png(tmp_path):
    from atdnode.node import NodeHome, init_home
    from atdnode.learning import TrainOptions, resolve_config, train

    root, png = _ct_tree(tmp_path)
    spec = f"dicom:{root}"
    # the same stored pixels as 16-bit PNG, windowed in stored units, give the same tensors
    raw_window = f"window={(LO - INTERCEPT) / SLOPE:.6f},{(HI - INTERCEPT) / SLOPE:.6f}"
    for split in ("train", "val", "test"):  # val: carved from training (the tree has no val split)
        d = load_dataset(spec, 16, 1, split)
        p = load_dataset(f"folder:{png}?{raw_window}", 16, 1, split)
        assert d.classes == p.classes == ["lesion", "normal"] and torch.equal(d.labels, p.labels)
        assert torch.allclose(d.images, p.images, atol=1e-5)
        # per-image min-max ignores the header window: equal to the PNG's default
        assert torch.allclose(load_dataset(spec + "?window=minmax", 16, 1, split).images,
                              load_dataset(f"folder:{png}", 16, 1, split).images, atol=1e-5)
    reports = [load_dataset(spec, 16, 1, s).report for s in ("train", "val", "test")]
    skipped = [f for r in reports for f, _ in r.skipped]
    assert skipped == ["normal/99.dcm"], skipped
    assert sum(r.scaling.get("DICOM window (header), MONOCHROME1 inverted", 0) for r in reports) == 1
    assert sum(r.scaling.get("DICOM window (header)", 0) for r in reports) == 15

    home = NodeHome.at(tmp_path / "node")
    init_home(home, consortium="demo")
    logs: list[str] = []
    cfg = resolve_config("vit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2,
                          in_chans=1)
    rec = train(home, spec, cfg, TrainOptions(epochs=1, batch_size=8, lr=1e-3, seed=0, log=logs.append, plots=False))
    assert rec.labels == ["lesion", "normal"] and rec.samples == len(load_dataset(spec, 16, 1, "train"))
    assert len(rec.metrics["history"]) == 1 and rec.metrics["n"] == len(load_dataset(spec, 16, 1, "test"))
    text = "\n".join(logs)
    assert "DICOM window (header)" in text and "skipped 1 file(s): normal/99.dcm" in text


def test_rescale_window_and_monochrome1_values(tmp_path):
    hu = np.array([[-1000, LO, 40, HI], [HI + 200, 0, 100, -100]], dtype=np.float64)  # (2, 4)
    hu = np.round(np.repeat(np.repeat(hu, 4, 0), 2, 1))  # (8, 8)
    write_dicom(tmp_path / "a" / "x.dcm", _stored(hu), slope=SLOPE, intercept=INTERCEPT, window=WINDOW)
    write_dicom(tmp_path / "b" / "y.dcm", _stored(hu), slope=SLOPE, intercept=INTERCEPT, window=WINDOW,
                photometric="MONOCHROME1")
    d = load_dataset(f"dicom:{tmp_path}?val=train", 8, 1, "train")
    assert d.classes == ["a", "b"] and d.labels.tolist() == [0, 1]
    expect = ((np.clip((hu - LO) / (HI - LO), 0, 1) - 0.5) / 0.5).astype(np.float32)
    assert np.allclose(d.images[0, 0].numpy(), expect, atol=1e-5)
    assert torch.allclose(d.images[1], -d.images[0], atol=1e-6)  # MONOCHROME1 inverted
    w = load_dataset(f"dicom:{tmp_path}?window=-100,100", 8, 1, "train")  # window= overrides the header (HU)
    assert np.allclose(w.images[0, 0].numpy(), (np.clip((hu + 100) / 200, 0, 1) - 0.5) / 0.5, atol=1e-5)
    assert w.report.scaling == {"window -100..100": 2} and torch.allclose(w.images[1], -w.images[0], atol=1e-6)
    assert w.report.value_range == (-1000.0, float(hu.max()))  # Hounsfield units after rescale
    assert w.report.dtypes == {"uint16": 2}  # the stored type, not the rescaled one


def test_voi_lut_sigmoid_linear_exact_and_no_window(tmp_path):
    stored = np.arange(64, dtype=np.uint16).reshape(8, 8) * 10  # 0..630
    table = (np.arange(100) * 655).astype(np.uint16)  # a 16-bit VOI LUT over stored 200..299
    write_dicom(tmp_path / "lut" / "x.dcm", stored, voi_lut=(200, table, 16))
    write_dicom(tmp_path / "sig" / "x.dcm", stored, window=(300, 200), voi_function="SIGMOID")
    write_dicom(tmp_path / "exact" / "x.dcm", stored, window=(300, 200), voi_function="LINEAR_EXACT")
    write_dicom(tmp_path / "none" / "x.dcm", stored)
    d = load_dataset(f"dicom:{tmp_path}?val=train", 8, 1, "train")
    got = {c: (d.images[i, 0].numpy().astype(np.float64) * 0.5 + 0.5) for i, c in enumerate(d.classes)}
    x = stored.astype(np.float64)
    assert np.allclose(got["lut"], table[np.clip(x - 200, 0, 99).astype(int)] / 65535.0, atol=1e-6)
    assert np.allclose(got["sig"], 1 / (1 + np.exp(-4 * (x - 300) / 200)), atol=1e-6)
    assert np.allclose(got["exact"], np.clip((x - 200) / 200, 0, 1), atol=1e-6)
    assert np.allclose(got["none"], x / x.max(), atol=1e-6)
    assert set(d.report.scaling) == {"DICOM VOI LUT (header)", "DICOM window (header, SIGMOID)",
                                     "DICOM window (header, LINEAR_EXACT)", "DICOM, min-max per image (no VOI in header)"}


def _j2k_bytes(px: np.ndarray) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(px).save(buf, format="JPEG2000", no_jp2=True, irreversible=False)
    return buf.getvalue()


def _recompress(path, transfer_syntax: str, frame: bytes) -> None:
    """Re-encapsulate a file's pixel data as one compressed frame under `transfer_syntax`."""
    import pydicom
    from pydicom.encaps import encapsulate

    ds = pydicom.dcmread(path)
    ds.file_meta.TransferSyntaxUID = transfer_syntax
    ds.PixelData = encapsulate([frame])
    ds["PixelData"].VR = "OB"
    ds.save_as(path, enforce_file_format=True)


def test_multiframe_needs_frame_and_compressed_syntaxes(tmp_path):
    from pydicom.uid import RLELossless

    frames = np.stack([np.full((8, 8), v, np.uint16) for v in (0, 100, 200)])
    frames[:, 0, 0], frames[:, 0, 1] = 1000, 0  # so that min-max leaves each frame's level visible
    mf = write_dicom(tmp_path / "mf" / "a" / "cine.dcm", frames, frames=3)
    with pytest.raises(DataError, match=r"cine.dcm: multi-frame DICOM \(3 frames\); choose one with frame=K"):
        load_dataset(f"dicom:{mf.parents[1]}", 8, 1)
    one = load_dataset(f"dicom:{mf.parents[1]}?frame=1", 8, 1).images[0, 0] * 0.5 + 0.5
    assert torch.allclose(one[1:, 1:], torch.full((7, 7), 0.1), atol=1e-6)
    write_dicom(mf.parents[1] / "b" / "single.dcm", frames[0])
    mixed = load_dataset(f"dicom:{mf.parents[1]}?frame=2", 8, 1)  # frame beyond a file's frames: skipped, named
    assert len(mixed) == 1 and mixed.report.skipped == [("b/single.dcm", "has 1 frame, frame=2 asked")]
    # RLE Lossless (decoded by pydicom itself) gives the very same tensor as the uncompressed file
    px = (np.arange(64, dtype=np.uint16).reshape(8, 8) * 997) % 4096
    write_dicom(tmp_path / "rle" / "a" / "plain.dcm", px)
    write_dicom(tmp_path / "rle" / "b" / "rle.dcm", px, transfer_syntax=RLELossless)
    j2k = write_dicom(tmp_path / "rle" / "c" / "j2k.dcm", px)  # JPEG 2000 lossless, decoded through Pillow
    _recompress(j2k, "1.2.840.10008.1.2.4.90", _j2k_bytes(px))
    r = load_dataset(f"dicom:{tmp_path / 'rle'}?val=train", 8, 1)
    assert r.classes == ["a", "b", "c"] and torch.equal(r.images[0], r.images[1]) and torch.equal(r.images[0], r.images[2])
    # a transfer syntax no installed decoder handles: one line naming the file
    path = write_dicom(tmp_path / "mpeg" / "a" / "video.dcm", px)
    _recompress(path, "1.2.840.10008.1.2.4.100", b"\x00\x00\x01\xb3 not decodable")  # MPEG2 Main Profile
    with pytest.raises(DataError, match=r"video.dcm: compressed transfer syntax .*MPEG2.* no installed decoder") as ei:
        load_dataset(f"dicom:{tmp_path / 'mpeg'}", 8, 1)
    assert "\n" not in str(ei.value)


def test_labels_csv_skips_named_and_no_header_leaves_the_loader(tmp_path):
    import json

    rng = np.random.default_rng(1)
    root = tmp_path / "export"
    for i in range(6):  # nested like a PACS export, no extensions
        write_dicom(root / f"P{i}" / "ST1" / "SE1" / "IM1", _stored(ct_slice(rng, 8, lesion=i % 2 == 1)),
                    slope=SLOPE, intercept=INTERCEPT)
    (root / "P0" / "notes.txt").write_text("not dicom")
    (root / "labels.csv").write_text("file,label,split\n" + "".join(
        f"P{i},{'lesion' if i % 2 else 'normal'},{'test' if i >= 4 else 'train'}\n" for i in range(6)) + "P9,normal,train\n")
    calls: list[tuple[int, int]] = []
    d = load_dataset(f"dicom:{root}?labels=labels.csv", 8, 1, "train", progress=lambda *a: calls.append(a))
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]  # a progress bar can follow the reading
    t = load_dataset(f"dicom:{root}?labels=labels.csv", 8, 1, "test")
    assert (len(d), len(t)) == (4, 2) and d.classes == ["lesion", "normal"] and t.labels.tolist() == [1, 0]
    assert dict(d.report.skipped) == {"P0/notes.txt": "not a DICOM file (no DICM preamble)",
                                      "P9": "listed in labels.csv but missing"}
    blob = json.dumps(d.report.to_dict()) + repr(d) + d.report.summary()
    assert "SECRET" not in blob and "0042" not in blob and "P0/notes.txt" in blob  # paths yes, header no
    # .dcm files in a folder: data set are skipped with a hint, never silently
    f = tmp_path / "pngs"
    write_png16(f / "a" / "x.png", np.arange(16, dtype=np.uint16).reshape(4, 4))
    (f / "a" / "y.dcm").write_bytes((root / "P0" / "ST1" / "SE1" / "IM1").read_bytes())
    assert load_dataset(f"folder:{f}", 4, 1).report.skipped == [("a/y.dcm", "not an image (DICOM: use dicom:PATH)")]


def test_damaged_files_are_skipped_quietly_without_quoting_the_header(tmp_path, capfd):
    """Truncated and bit-flipped files: read, skipped or refused — never another exception,
    and nothing of the header (pydicom's warnings quote it) on stderr or in the reasons."""
    from atdnode.data.dicom import read_dicom

    good = write_dicom(tmp_path / "x.dcm", np.arange(64, dtype=np.uint16).reshape(8, 8), window=(30, 20)).read_bytes()
    cases = damaged(good, np.random.default_rng(0), keep=132, step=23, flips=60)
    outcomes = outcomes_of(lambda q: read_dicom(q, None, str(q)), tmp_path / "y.dcm", cases)
    assert "Skip" in outcomes and "ok" in outcomes
    err = capfd.readouterr().err
    assert "SECRET" not in err and "Warning" not in err
