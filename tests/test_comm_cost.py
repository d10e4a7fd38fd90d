"""Communication accounting: formulas, counters, and measured bytes against the formulas."""
from __future__ import annotations

import pytest
import torch

from protocols import festa, pfesta
from protocols.comm_cost import (ByteCounter, CostParams, InProcessChannel, compare, formulas, msd_vs_fl_ssl,
                                 t_festa, t_fl, t_fl_ssl, t_msd, t_pfesta, t_sl, tensor_bytes)
from protocols.split_parts import TaskSpec, build_plain_embedder, digits_images, digits_targets, split_config
from protocols.tensor_frames import LENGTH_PREFIX_BYTES, encode_frame

CFG = split_config(img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=2, num_heads=2)
TASKS = [TaskSpec("digit", "classification", 10), TaskSpec("ink", "segmentation", 1, 0.5)]


def test_formulas_known_answers():
    p = CostParams(D=100, B=20, R=6, n=3, F=10, G=5, Ph=1000, Pb=5000, Pt=200)
    assert t_fl(p) == 2 * 6 / 3 * 6200 == 24800
    assert t_sl(p) == 2 * 20 * 6 * 15 == 3600
    assert t_festa(p) == 3600 + 2 * 6 / 3 * 1200 == 8400
    assert t_pfesta(p) == 100 * 10 + 20 * 6 * 15 + 2 * 6 * 200 / 3 == 3600
    assert t_msd(p) == 100 * 10 + 5000 == 6000  # MSD Eq. 9: D F + Pb, one round
    assert formulas(p) == {"fl": 24800, "sl": 3600, "festa": 8400, "pfesta": 3600, "msd": 6000, "fl_ssl": 49600}


def test_msd_eq8_federated_ssl_cost_and_the_ratio_to_msd():
    """MSD Eq. 8: T_FL = 4 (R/r) P -- teacher and student, up and down, R/r times."""
    p = CostParams(D=100, B=20, R=6, n=3, F=10, G=5, Ph=1000, Pb=5000, Pt=200)
    assert t_fl_ssl(p) == 4 * (6 / 3) * (1000 + 5000 + 200) == 49600
    assert t_fl_ssl(p) == 2 * t_fl(p)  # two networks where supervised FL moves one
    assert t_fl_ssl(CostParams(D=0, B=0, R=50, n=1, F=0, G=0, Ph=0, Pb=7, Pt=0)) == 4 * 50 * 7
    r = msd_vs_fl_ssl(p, p, measured_msd=6100, measured_fl_ssl=50000)
    assert r["T_MSD"] == 6000 and r["T_FL_SSL"] == 49600 and r["ratio"] == 6000 / 49600
    assert r["measured_ratio"] == 6100 / 50000
    assert msd_vs_fl_ssl(p, p)["measured_ratio"] is None


def test_cost_params_validation():
    with pytest.raises(ValueError, match="n \\(unifying period"):
        CostParams(D=1, B=1, R=1, n=0, F=1, G=1, Ph=0, Pb=0, Pt=0)
    with pytest.raises(ValueError, match="F must be a non-negative int"):
        CostParams(D=1, B=1, R=1, n=1, F=-1, G=1, Ph=0, Pb=0, Pt=0)
    with pytest.raises(ValueError, match="unknown protocol"):
        compare(ByteCounter(), {}, "carrier-pigeon")


def test_channel_counts_wire_and_payload_and_counter_roundtrips():
    ch = InProcessChannel()
    t = {"x": torch.randn(4, 8)}
    got = ch.send("a", "up", "forward", t, {"step": 1})
    assert torch.equal(got.tensors["x"], t["x"]) and got.meta == {"kind": "forward", "step": 1}
    wire = len(encode_frame(t, {"kind": "forward", "step": 1})) + LENGTH_PREFIX_BYTES
    assert ch.counter.total("a", "up") == wire and ch.counter.total("a", payload=True) == 128
    ch.send("a", "down", "body_out", t)
    ch.send("b", "up", "forward", t, {"step": 1})
    c = ch.counter
    assert c.clients() == ["a", "b"] and c.messages("a") == 2 and c.total(kinds=["forward"]) == 2 * wire
    back = ByteCounter.from_dict(c.to_dict())
    assert back.to_dict() == c.to_dict()
    merged = ByteCounter()
    merged.merge(c)
    merged.merge(back)
    assert merged.total() == 2 * c.total()
    with pytest.raises(ValueError, match="not a ByteCounter"):
        ByteCounter.from_dict({"rows": [{"client": "a"}]})
    with pytest.raises(ValueError, match="direction"):
        c.record("a", "sideways", "x", wire_bytes=1, payload_bytes=1)
    assert tensor_bytes(t) == 128


@pytest.fixture(scope="module")
def runs():
    """FESTA and p-FESTA on the same setting: 2 clients x 2 tasks, 120 samples each."""
    torch.set_num_threads(1)
    x, y = digits_images(16)
    data = {cid: (t, x[lo:lo + 120], digits_targets(t, x[lo:lo + 120], y[lo:lo + 120], 4))
            for cid, t, lo in (("a", TASKS[0], 0), ("c", TASKS[1], 120))}
    setting = dict(rounds=4, steps_per_round=3, unifying_rounds=2)
    f_srv = festa.FestaServer(CFG, TASKS, lr=3e-3)
    f_cl = [festa.FestaClient(cid, CFG, t, xs, ys, batch_size=16, seed=i) for i, (cid, (t, xs, ys)) in
            enumerate(data.items())]
    f_res = festa.run_festa_inprocess(f_srv, f_cl, **setting)
    emb = build_plain_embedder(CFG, seed=0)
    p_srv = pfesta.PFestaServer(CFG, TASKS, batch_size=16, lr=3e-3)
    p_cl = [pfesta.PFestaClient(cid, CFG, t, xs, ys, emb, seed=i) for i, (cid, (t, xs, ys)) in
            enumerate(data.items())]
    p_res = pfesta.run_pfesta_inprocess(p_srv, p_cl, upload_chunk=64, **setting)
    return f_res, p_res


def test_measured_bytes_match_formulas_within_5_percent(runs):
    f_res, p_res = runs
    for res, proto, kinds in ((f_res, "festa", festa.TRAIN_KINDS), (p_res, "pfesta", pfesta.TRAIN_KINDS)):
        rows = compare(res.counter, res.params, proto, kinds)
        assert [r["client"] for r in rows] == ["a", "c"]
        for r in rows:
            assert abs(r["rel_error"]) < 0.05, (proto, r)
            assert r["measured_wire"] >= r["formula"]  # headers only ever add
            assert r["measured_up"] + r["measured_down"] == r["measured_wire"]
            # the payload (raw tensor bytes) is what the formula counts, almost exactly
            assert abs(r["measured_payload"] - r["formula"]) / r["formula"] < 1e-9


def test_pfesta_is_cheaper_than_festa(runs):
    f_res, p_res = runs
    for cid in ("a", "c"):
        f_rows = compare(f_res.counter, f_res.params, "festa", festa.TRAIN_KINDS)
        p_rows = compare(p_res.counter, p_res.params, "pfesta", pfesta.TRAIN_KINDS)
        fm = next(r for r in f_rows if r["client"] == cid)
        pm = next(r for r in p_rows if r["client"] == cid)
        assert pm["measured_wire"] < fm["measured_wire"] and pm["formula"] < fm["formula"]
        # same symbols on both sides: one sample is N x D float32 tokens at the cut
        assert f_res.params[cid].F == p_res.params[cid].F == 16 * 32 * 4
        assert f_res.params[cid].B == p_res.params[cid].B == 48 and f_res.params[cid].R == 4


def test_split_report_puts_msd_next_to_eq8_and_eq9():
    """`atd split report`: an MSD record's measured bytes next to T_MSD (Eq. 9) and T_FL-SSL
    (Eq. 8) at the MSD paper's Table VII schedule (R = 50, r = 1), with both ratios."""
    from atdnode.split import render_report as render, report_row
    from atdnode.split.report import make_record

    p = CostParams(D=100, B=0, R=1, n=1, F=10, G=10, Ph=300, Pb=5000, Pt=0)
    counter = ByteCounter()
    counter.record("c1", "up", "upload", wire_bytes=1010, payload_bytes=1000)
    counter.record("c1", "down", "weights", wire_bytes=5020, payload_bytes=5000)
    rec = make_record(side="client", algorithm="msd", client="c1", server="s" * 52, task={"name": "digit"},
                      params=p, counter=counter.to_dict(), train_kinds=["upload", "weights"], rounds=[1])
    row = report_row(rec)
    fl = 4 * 50 * (300 + 5000)
    assert row["T_MSD"] == 6000 and row["T_FL_SSL"] == fl
    assert row["msd_ratio"] == 6000 / fl and row["measured_ratio"] == 6030 / fl
    text = render([row])
    assert "T_MSD (Eq. 9)" in text and "T_FL-SSL (Eq. 8, R=50, r=1)" in text and f"{6000 / fl:.3f}" in text
