"""FedAvg (`atd rounds`) and swarm start from a shared base's extractor, as centralized and
local do (VGS-ATD §4.4: "the baselines start from the same pretrained weights"):
round 0's global model is the base's extractor and the head a campaign of that seed draws;
swarm's first training is `train_model(init=base, init_part="extractor")`; a
`base = "public"` scenario listing them runs them from W_p without a "from scratch" note,
and a `base = "msd"` one runs each listed baseline again from the MSD base (`<method>-msd`)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.netsim_tiny import TINY


def _tiny(phases: int = 1, **scenario) -> dict:
    raw = json.loads(json.dumps(TINY))
    raw["scenario"].update(scenario)
    raw["cohorts"] = raw["cohorts"][:phases]
    raw["baselines"] = {"rounds": 1}
    return raw


def _fresh(scn, seed: int, classes: int = 3) -> torch.nn.Module:
    """A fresh model of the scenario's config built after torch.manual_seed(seed)."""
    from atdnode.learning import build_model
    from netsim.learn import model_config

    torch.manual_seed(seed)
    return build_model(model_config(scn.model, classes))


def _base(scn) -> dict[str, torch.Tensor]:
    """A stand-in for W_p: the extractor of a model of the scenario's config built from a seed
    no run of the scenario uses (not trained: only where training starts matters here)."""
    from atdnode.learning import extractor_state

    return extractor_state(_fresh(scn, 987_654))


def _distance(state: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> float:
    """Relative L2 distance of `state`'s extractor tensors from `base`."""
    diff = sum(float((state[k].float() - v.float()).pow(2).sum()) for k, v in base.items())
    return (diff / sum(float(v.float().pow(2).sum()) for v in base.values())) ** 0.5


def _scenario(raw: dict):
    from netsim.nodedata import load_scenario_data
    from netsim.scenario import scenario_from_dict

    scn = scenario_from_dict(raw)
    return scn, load_scenario_data(scn)


@pytest.mark.parametrize("method", ["fedavg", "fat-fedwavg"])  # every `atd rounds` method shares the start
def test_rounds_round_zero_is_the_base_extractor_and_a_campaign_head(method: str, monkeypatch) -> None:
    import netsim.baselines as baselines
    import netsim.fat as fat

    scn, data = _scenario(_tiny())
    base = _base(scn)
    campaigns: list[dict] = []
    real = fat.run_rounds_memnet

    def spy(*a, **kw):
        rr = real(*a, **kw)
        campaigns.append({"init": kw["init_state"], "seed": kw["seed"], "final": rr.state})
        return rr

    monkeypatch.setattr(fat, "run_rounds_memnet", spy)
    (res,) = baselines.run_baseline(method, scn, data, log=lambda _m: None, base=base)
    (c,) = campaigns
    init = c["init"]
    assert init is not None and all(torch.equal(init[k], v) for k, v in base.items())
    fresh = _fresh(scn, c["seed"], len(data.classes_at(1))).state_dict()  # a campaign from scratch's round 0
    head = [k for k in fresh if k not in base]
    assert head and all(torch.equal(init[k], fresh[k]) for k in head)
    # the daemons' final global model (one round of local training, averaged) stays near the
    # base, far nearer than another random init is (LayerNorm's ones and zeros are shared)
    assert _distance(c["final"], base) < 0.25 * _distance(fresh, base)  # measured: 0.018 vs 0.51
    assert res.overall["accuracy"] is not None and all(o == "global model" for o in res.outcomes.values())


def test_swarm_first_training_starts_from_the_base_extractor_later_ones_from_the_model(monkeypatch) -> None:
    import netsim.baselines as baselines

    scn, data = _scenario(_tiny(phases=2))
    base = _base(scn)
    calls: list[tuple[dict | None, str, dict]] = []  # (init, init_part, trained state)
    real = baselines.train_model

    def spy(*a, **kw):
        t = real(*a, **kw)
        calls.append((kw.get("init"), kw.get("init_part"), baselines.full_state(t.model)))
        return t

    monkeypatch.setattr(baselines, "train_model", spy)
    out = baselines.run_baseline("swarm", scn, data, log=lambda _m: None, base=base)
    assert [r.phase for r in out] == [1, 2] and len(calls) == 5  # a1, a2; then a1, a2, b1
    (init, part, _), *later = calls
    assert part == "extractor" and init is base
    assert [p for _i, p, _s in later] == ["full"] * 4
    for (_i, _p, before), (after, _q, _s) in zip(calls, later):  # each continues the travelling model
        assert all(torch.equal(after[k], v) for k, v in before.items() if k in base)  # (phase 2: head widened)
    # a1 trained from the base (measured 0.040), not from a random init (0.51)
    assert _distance(calls[0][2], base) < 0.25 * _distance(_fresh(scn, scn.seed).state_dict(), base)


def _starts(monkeypatch) -> list[tuple[str, dict | None]]:
    """Records, in order, where every FedAvg campaign ("fedavg", its round-0 state) and every
    in-process training ("swarm <init_part>", its init) of a run starts."""
    import netsim.baselines as baselines
    import netsim.fat as fat

    starts: list[tuple[str, dict | None]] = []
    real_rounds, real_train = fat.run_rounds_memnet, baselines.train_model
    monkeypatch.setattr(fat, "run_rounds_memnet",
                        lambda *a, **kw: starts.append(("fedavg", kw["init_state"])) or real_rounds(*a, **kw))
    monkeypatch.setattr(baselines, "train_model",
                        lambda *a, **kw: starts.append(("swarm " + kw["init_part"], kw["init"])) or real_train(*a, **kw))
    return starts


def test_base_public_scenario_runs_fedavg_and_swarm_from_w_p(short_tmp: Path, monkeypatch) -> None:
    from netsim.publicbase import load_extractor
    from netsim.run import run_scenario
    from netsim.scenario import scenario_from_dict

    raw = _tiny(methods=["fedavg", "swarm"], base="public")
    raw["datasets"] = [{"name": "digits", "spec": "digits-jitter?public=0.3"}]
    raw["public"] = {"spec": "digits-jitter?variants=2&public=0.3&part=public", "epochs": 1, "lr": 3e-3,
                     "finetune_lr": 1e-3, "finetune_epochs": 1}
    raw["train"]["probe_epochs"] = 1
    starts = _starts(monkeypatch)
    rep = run_scenario(scenario_from_dict(raw), keep_homes=short_tmp)
    (work,) = [p for p in short_tmp.iterdir() if p.is_dir()]
    wp = load_extractor(work / "public" / "base" / "wp.safetensors")
    assert [m for m, _s in starts] == ["fedavg", "swarm extractor", "swarm full"]
    for _m, s in starts[:2]:  # fedavg's round 0 and swarm's first training: W_p's extractor
        assert s is not None and all(torch.equal(s[k], v) for k, v in wp.items())
    assert set(rep["methods"]) == {"fedavg", "swarm"}
    assert all(rep["methods"][m][0]["overall"]["accuracy"] is not None for m in ("fedavg", "swarm"))
    assert not [n for n in rep["notes"] if "from scratch" in n]
    assert any("every baseline start from W_p" in n for n in rep["notes"])
    assert [n for n in rep["notes"] if "without the LP-FT probe" in n] == [
        "base public: fedavg's round 0 starts from the base's extractor and a seeded head, without the LP-FT "
        "probe the other methods run (netsim.baselines)"]


def test_base_msd_scenario_runs_each_listed_baseline_again_from_the_base(short_tmp: Path, monkeypatch) -> None:
    from netsim.publicbase import load_extractor
    from netsim.run import run_scenario
    from netsim.scenario import scenario_from_dict

    raw = _tiny(methods=["fedavg", "swarm"], base="msd")
    raw["msd"] = {"steps": 8, "batch_size": 64, "finetune_lr": 2e-3}
    starts = _starts(monkeypatch)
    rep = run_scenario(scenario_from_dict(raw), keep_homes=short_tmp)
    (work,) = [p for p in short_tmp.iterdir() if p.is_dir()]
    base = load_extractor(work / "msd" / "base" / "a1.safetensors")
    # as listed, from scratch; then each again from the base
    assert [m for m, _s in starts] == ["fedavg", "swarm full", "swarm full", "fedavg", "swarm extractor", "swarm full"]
    assert starts[0][1] is None and starts[1][1] is None
    for _m, s in starts[3:5]:
        assert s is not None and all(torch.equal(s[k], v) for k, v in base.items())
    assert set(rep["methods"]) == {"fedavg", "swarm", "fedavg-msd", "swarm-msd"}
    assert [p["method"] for p in rep["methods"]["swarm-msd"]] == ["swarm-msd"]
    assert all(rep["methods"][m][0]["overall"]["accuracy"] is not None for m in rep["methods"])
