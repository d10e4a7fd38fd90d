"""`atd demo`: its shipped public start W_p (hash-checked, a one-line error when missing or
changed), its headline (what the run measured, never more), and its claims against the
references measured in the same run: the consortium's learned features beat the same
ensemble on W_p's own features in the last phase by a margin, and in every phase both it and
the same ensemble on raw pixels, as the headline says. The demo run costs minutes of CPU, so
those claims are in the `claims` tier (`pytest --claims`)."""
from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest


def _demo():
    from netsim.scenario import load_scenario, shipped_scenario

    return load_scenario(shipped_scenario("demo"))


def test_shipped_w_p_matches_its_recipe_hash_and_a_missing_or_changed_file_is_refused(tmp_path: Path) -> None:
    from atdnode.errors import WeightsError
    from netsim.publicbase import file_sha256, load_extractor, shipped_public_base

    scn = _demo()
    f = shipped_public_base(scn)
    assert file_sha256(f) == scn.public.sha256 and f.stat().st_size < 1_000_000  # a small checked file
    wp = load_extractor(f)
    assert wp["patch_embed.proj.weight"].shape[0] == scn.model.embed_dim  # W_p of the demo's [model]
    changed = tmp_path / f.name
    data = bytearray(f.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    changed.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match=f"has sha256 {file_sha256(changed)}, not the scenario's"):
        shipped_public_base(scn.replace(public=replace(scn.public, file=str(changed))))
    with pytest.raises(WeightsError, match="is missing; rebuild it .*bench/public_base_build.py"):
        shipped_public_base(scn.replace(public=replace(scn.public, file=str(tmp_path / "gone.safetensors"))))


def test_demo_scenario_copied_without_its_w_p_is_refused_in_one_line_before_any_work(tmp_path: Path, capsys) -> None:
    from cli.app import run
    from netsim.scenario import shipped_scenario

    toml = tmp_path / "demo.toml"  # its [public] file is relative to the scenario: not next to the copy
    shutil.copyfile(shipped_scenario("demo"), toml)
    code = run(["netsim", "run", str(toml), "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert code != 0 and "Traceback" not in out + err
    assert err.count("\n") == 1 and err.startswith("error: ") and "public base file" in err and "is missing" in err, err
    assert not (tmp_path / "out" / "report.json").exists()


def _report(accs: dict[str, list[float]], **extra) -> dict:
    return {"methods": {m: [{"phase": p + 1, "overall": {"accuracy": a}} for p, a in enumerate(v)]
                        for m, v in accs.items()}, **extra}


def test_headline_says_what_the_run_measured_and_nothing_more() -> None:
    from netsim.references import headline

    win = headline(_report({"vgs-atd": [0.8, 0.7], "ensemble-raw": [0.6, 0.65], "ensemble-public": [0.75, 0.6],
                            "ensemble-untrained": [0.3, 0.2], "centralized": [0.82, 0.74]}))
    assert win == ("The consortium's learned features beat raw pixels in every phase (+20.0 / +5.0 points) and "
                   "beat the shared start W_p's features in every phase (+5.0 / +10.0 points); phase 2 (pooled test "
                   "set): VGS-ATD 0.700, raw pixels 0.650, start 0.600, centralized 0.740")
    mixed = headline(_report({"vgs-atd": [0.8, 0.6], "ensemble-raw": [0.9, 0.5], "ensemble-untrained": [0.85, 0.7]}))
    assert mixed.startswith("The consortium's learned features beat raw pixels in phase 2 only (-10.0 / +10.0 points) "
                            "and do NOT beat the shared start's (an untrained extractor's) features in any phase "
                            "(-5.0 / -10.0 points)")
    assert "centralized" not in mixed  # not run: not named
    msd = headline(_report({"vgs-atd": [0.8], "ensemble-raw": [0.6], "ensemble-untrained": [0.3]}, msd_base={}))
    assert "the start's own features were not scored in this run (no claim about them)" in msd
    assert headline(_report({"centralized": [0.9], "ensemble-raw": [0.5]})) is None  # no VGS-ATD: no headline


# how far (points of overall accuracy, same run) the learned features must beat each
# reference: in the demo's last phase, where every hospital is in the consortium, and (raw
# pixels) in its first
MARGIN_RAW, MARGIN_START = 2.0, 2.0


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> dict:
    """`atd demo`'s scenario on the in-memory back-end (the same daemons, one process)."""
    import torch

    from netsim.run import run_scenario

    torch.set_num_threads(1)
    return run_scenario(_demo().replace(backend="memory"), tmp_path_factory.mktemp("demo") / "out")


def _at(rep: dict, phase: int | None = None) -> tuple[float, float, float]:
    """VGS-ATD, raw pixels and W_p alone in `phase` (None: the last phase)."""
    acc = {m: {ph["phase"]: ph["overall"]["accuracy"] for ph in v} for m, v in rep["methods"].items()}
    p = max(acc["vgs-atd"]) if phase is None else phase
    return tuple(acc[m][p] for m in ("vgs-atd", "ensemble-raw", "ensemble-public"))


@pytest.mark.claims
@pytest.mark.slow
@pytest.mark.timeout(1800)  # the demo run: ~130 s of CPU, 10 minutes at load 7
def test_demo_learned_features_beat_the_start_and_the_headline_says_what_was_measured(demo_run: dict) -> None:
    vgs, raw, start = _at(demo_run)
    assert 100 * (vgs - start) >= MARGIN_START, (vgs, start)
    assert "centralized" in demo_run["methods"]
    assert demo_run["public_base"]["sha256"] == _demo().public.sha256  # the shipped W_p, checked
    h = demo_run["headline"]
    assert "beat the shared start W_p's features in " in h and f"VGS-ATD {vgs:.3f}" in h
    assert f"{100 * (vgs - raw):+.1f} points)" in h and f"{100 * (vgs - start):+.1f} points)" in h
    assert ("do NOT beat raw pixels" in h) == all(  # the raw-pixel verdict is the run's, phase by phase
        ph["overall"]["accuracy"] <= r["overall"]["accuracy"]
        for ph, r in zip(demo_run["methods"]["vgs-atd"], demo_run["methods"]["ensemble-raw"]))


@pytest.mark.claims
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_demo_learned_features_beat_raw_pixels_on_the_founders_digits(demo_run: dict) -> None:
    vgs, raw, _ = _at(demo_run, 1)
    assert 100 * (vgs - raw) >= MARGIN_RAW, (vgs, raw)


@pytest.mark.claims
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_demo_learned_features_beat_raw_pixels_and_the_start_in_every_phase(demo_run: dict) -> None:
    for phase in sorted({ph["phase"] for ph in demo_run["methods"]["vgs-atd"]}):
        vgs, raw, start = _at(demo_run, phase)
        assert 100 * (vgs - raw) >= MARGIN_RAW and vgs > start, (phase, vgs, raw, start)
    assert demo_run["headline"].startswith("The consortium's learned features beat raw pixels in every phase (")
    assert "beat the shared start W_p's features in every phase (" in demo_run["headline"]
