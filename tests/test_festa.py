"""FESTA: split-learning correctness, multi-task learning, unification, phase 2, faults, restarts."""
from __future__ import annotations

import copy

import pytest
import torch

from protocols.festa import TRAIN_KINDS, FestaClient, FestaServer, run_festa_inprocess
from protocols.split_parts import TaskSpec, digits_images, digits_targets, split_config, task_loss
from protocols.split_state import ClientDropped, SplitProtocolError, SplitStateError

CFG = split_config(img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=2, num_heads=2)
CLS = TaskSpec("digit", "classification", 10)
SEG = TaskSpec("ink", "segmentation", 1, loss_weight=0.5)


@pytest.fixture(scope="module")
def digits():
    torch.manual_seed(0)
    x, y = digits_images(16)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return x[perm], y[perm]


def _client(digits, cid, task, lo, hi, seed, batch=16, lr=3e-3):
    x, y = digits
    return FestaClient(cid, CFG, task, x[lo:hi], digits_targets(task, x[lo:hi], y[lo:hi], CFG.patch_size),
                       batch_size=batch, lr=lr, seed=seed)


def _test(digits, task):
    x, y = digits
    return x[1400:], digits_targets(task, x[1400:], y[1400:], CFG.patch_size)


def test_split_gradients_equal_monolithic_autograd(digits):
    """One FESTA step hands the head exactly the gradient a single model would compute."""
    torch.set_num_threads(1)
    srv = FestaServer(CFG, [CLS], lr=0.0)
    c = _client(digits, "a", CLS, 0, 64, seed=1)
    srv.join("a", "digit")
    head0, body0, tail0 = copy.deepcopy(c.head), copy.deepcopy(srv.body), copy.deepcopy(c.tail)
    y = srv.forward("a", "digit", c.head_forward())
    g, loss = c.tail_step(y)
    gin = srv.backward("a", g)
    c._feats.backward(gin)  # what head_backward does, minus the optimizer step
    ref = task_loss(CLS, tail0(body0(head0(c.images[c._batch_idx]))), c._batch_targets)
    ref.backward()
    assert loss == pytest.approx(float(ref.detach()), rel=1e-6)
    for (n, p), p0 in zip(c.head.named_parameters(), head0.parameters()):
        assert torch.allclose(p.grad, p0.grad, atol=1e-6), n
    for p, p0 in zip(c.tail.parameters(), tail0.parameters()):
        assert torch.allclose(p.grad, p0.grad, atol=1e-6)


def test_multitask_run_learns_unifies_and_counts(digits):
    torch.set_num_threads(1)
    srv = FestaServer(CFG, [CLS, SEG], lr=3e-3)
    clients = [_client(digits, "a", CLS, 0, 200, 1), _client(digits, "b", CLS, 200, 400, 2),
               _client(digits, "c", SEG, 400, 600, 3)]
    # Algorithm 1: one body step per synchronous step of all three clients (40 in all)
    res = run_festa_inprocess(srv, clients, rounds=4, steps_per_round=10, unifying_rounds=2,
                              test_data={c.client_id: _test(digits, c.task) for c in clients})
    assert srv.version == 4 * 10
    for cid, losses in res.losses.items():
        assert len(losses) == 4 and losses[-1] < losses[0], cid
    assert res.metrics["a"]["accuracy"] > 2.5 * 0.1  # ten digit classes: chance 0.1
    # per-patch ink mask: above predicting the majority patch value (~0.52 here) by 0.3
    assert res.metrics["c"]["patch_accuracy"] > res.metrics["c"]["patch_majority"] + 0.3
    # the last round was a unifying round: clients of one task hold identical head and tail
    sa, sb = clients[0].part_state(), clients[1].part_state()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["head.vit.pos_embed"], clients[2].part_state()["head.vit.pos_embed"])
    for cid in "abc":
        for kind in ("forward", "body_out", "grad_out", "grad_in"):
            assert res.counter.messages(cid, [kind]) == 4 * 10
        assert res.counter.messages(cid, ["state_up"]) == res.counter.messages(cid, ["state_down"]) == 2
    assert set(res.counter.kinds()) == set(TRAIN_KINDS) | {"eval_forward", "eval_out"}
    assert [e["task"] for e in srv.events if e["event"] == "unify"] == ["digit", "ink"] * 2


def test_phase2_freezes_body_but_trains_heads(digits):
    srv = FestaServer(CFG, [CLS], lr=3e-3)
    c = _client(digits, "a", CLS, 0, 100, 1)
    body0 = {k: v.clone() for k, v in srv.body.state_dict().items()}
    head0 = {k: v.clone() for k, v in c.head.state_dict().items()}
    run_festa_inprocess(srv, [c], rounds=0, phase2_rounds=2, steps_per_round=2, unifying_rounds=1)
    assert srv.frozen and all(torch.equal(v, body0[k]) for k, v in srv.body.state_dict().items())
    assert any(not torch.equal(v, head0[k]) for k, v in c.head.state_dict().items())


def test_task_loss_weight_zero_leaves_body_untouched(digits):
    zero = TaskSpec("digit", "classification", 10, loss_weight=0.0)
    for task, changed in ((zero, False), (CLS, True)):
        srv = FestaServer(CFG, [task], lr=1e-2)
        c = _client(digits, "a", task, 0, 64, 1)
        body0 = {k: v.clone() for k, v in srv.body.state_dict().items()}
        run_festa_inprocess(srv, [c], rounds=1, steps_per_round=1, unifying_rounds=1)
        moved = any(not torch.equal(v, body0[k]) for k, v in srv.body.state_dict().items())
        assert moved is changed


def test_interleaved_clients_recompute_stale_forward(digits):
    srv = FestaServer(CFG, [CLS], lr=1e-2)
    a, b = _client(digits, "a", CLS, 0, 64, 1), _client(digits, "b", CLS, 64, 128, 2)
    srv.join("a", "digit")
    srv.join("b", "digit")
    ya = srv.forward("a", "digit", a.head_forward())
    fb = b.head_forward()
    yb = srv.forward("b", "digit", fb)
    a.head_backward(srv.backward("a", a.tail_step(ya)[0]))  # body changes under b's pending step
    gb, _ = b.tail_step(yb)
    ref_body = copy.deepcopy(srv.body)
    x = fb.clone().requires_grad_(True)
    ref_body(x).backward(gb)
    gin = srv.backward("b", gb)  # recomputed at the current weights, no autograd error
    assert torch.allclose(gin, x.grad, atol=1e-6) and srv.version == 2


def test_vanished_client_is_dropped_and_others_finish(digits):
    srv = FestaServer(CFG, [CLS], lr=3e-3)
    clients = [_client(digits, "a", CLS, 0, 100, 1), _client(digits, "b", CLS, 100, 200, 2)]
    res = run_festa_inprocess(srv, clients, rounds=3, steps_per_round=2, unifying_rounds=1,
                              vanish={"b": (2, 0)})
    assert res.dropped["b"]["round"] == 2 and "deadline" in res.dropped["b"]["reason"]
    assert len(res.losses["a"]) == 3 and list(res.params) == ["a"]
    assert "b" not in srv._pending  # its in-flight step was discarded
    unify = [e for e in srv.events if e["event"] == "unify"]
    assert [e["clients"] for e in unify] == [["a", "b"], ["a"], ["a"]]
    with pytest.raises(ClientDropped, match="dropped in round 2"):
        srv.forward("b", "digit", torch.zeros(2, 16, 32))
    srv.join("b", "digit")  # an explicit re-join readmits it
    srv.forward("b", "digit", torch.zeros(2, 16, 32))


def test_protocol_errors_are_typed(digits):
    srv = FestaServer(CFG, [CLS], max_batch=8)
    with pytest.raises(SplitProtocolError, match="has not joined"):
        srv.forward("x", "digit", torch.zeros(2, 16, 32))
    with pytest.raises(SplitProtocolError, match="unknown task"):
        srv.join("x", "nope")
    srv.join("x", "digit")
    with pytest.raises(SplitProtocolError, match="sent 'other'"):
        srv.forward("x", "other", torch.zeros(2, 16, 32))
    with pytest.raises(SplitProtocolError, match=r"shape \(2, 17, 32\)"):
        srv.forward("x", "digit", torch.zeros(2, 17, 32))
    with pytest.raises(SplitProtocolError, match="batch of 9"):
        srv.forward("x", "digit", torch.zeros(9, 16, 32))
    with pytest.raises(SplitProtocolError, match="dtype"):
        srv.forward("x", "digit", torch.zeros(2, 16, 32, dtype=torch.float64))
    with pytest.raises(SplitProtocolError, match="NaN"):
        srv.forward("x", "digit", torch.full((2, 16, 32), float("nan")))
    with pytest.raises(SplitProtocolError, match="without a pending forward"):
        srv.backward("x", torch.zeros(2, 16, 32))
    srv.forward("x", "digit", torch.zeros(2, 16, 32))
    with pytest.raises(SplitProtocolError, match="previous step is pending"):
        srv.forward("x", "digit", torch.zeros(2, 16, 32))
    with pytest.raises(SplitProtocolError, match="batch 3"):
        srv.backward("x", torch.zeros(3, 16, 32))
    c = _client(digits, "x", CLS, 0, 32, 1)
    state = c.part_state()
    with pytest.raises(SplitProtocolError, match="missing"):
        srv.submit_state("x", {k: v for k, v in state.items() if k != "tail.head.bias"}, 32)
    with pytest.raises(SplitProtocolError, match="tail.head.bias"):
        srv.submit_state("x", {**state, "tail.head.bias": torch.zeros(3)}, 32)
    with pytest.raises(SplitProtocolError, match="samples"):
        srv.submit_state("x", state, 0)


def test_save_load_resumes_identically(digits, tmp_path):
    srv = FestaServer(CFG, [CLS, SEG], lr=3e-3)
    clients = [_client(digits, "a", CLS, 0, 100, 1), _client(digits, "c", SEG, 100, 200, 3)]
    run_festa_inprocess(srv, clients, rounds=2, steps_per_round=2, unifying_rounds=1, vanish={"c": (2, 1)})
    srv.save(tmp_path / "srv")
    back = FestaServer.load(tmp_path / "srv")
    assert back.version == srv.version and back.clients == srv.clients == {"a": "digit"}
    assert back.dropped == srv.dropped and back.events == srv.events and back.rounds.round == 2
    for k, v in srv.body.state_dict().items():
        assert torch.equal(v, back.body.state_dict()[k])
    feats = clients[0].head_forward()
    g = torch.randn(feats.shape, generator=torch.Generator().manual_seed(5))
    outs = []
    for s in (srv, back):  # the same next step on the original and the restored server
        s.forward("a", "digit", feats)
        outs.append((s.backward("a", g), [p.detach().clone() for p in s.body.parameters()]))
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(p, q) for p, q in zip(outs[0][1], outs[1][1]))  # Adam moments restored too


def test_load_rejects_missing_torn_or_foreign_state(tmp_path):
    with pytest.raises(SplitStateError, match="missing"):
        FestaServer.load(tmp_path / "none")
    srv = FestaServer(CFG, [CLS])
    srv.save(tmp_path / "s")
    raw = bytearray((tmp_path / "s" / "tensors.safetensors").read_bytes())
    raw[-1] ^= 1
    (tmp_path / "s" / "tensors.safetensors").write_bytes(bytes(raw))
    with pytest.raises(SplitStateError, match="torn or altered"):
        FestaServer.load(tmp_path / "s")
    from protocols.pfesta import PFestaServer
    PFestaServer(CFG, [CLS]).save(tmp_path / "p")
    with pytest.raises(SplitStateError, match="'pfesta' server"):
        FestaServer.load(tmp_path / "p")


def test_conv_head_is_selectable_trains_and_unifies(digits):
    """FESTA §4's setting: a task-specific CNN head in front of the shared body. Two clients
    with conv heads learn the digits well above chance through the split protocol, and the
    unification hands both the same head; a conv head with a class token is refused."""
    torch.set_num_threads(1)
    x, y = digits
    srv = FestaServer(CFG, [CLS], lr=3e-3, head="conv")
    clients = [FestaClient(cid, CFG, CLS, x[lo:lo + 200], y[lo:lo + 200], batch_size=16, lr=3e-3, seed=i, head="conv")
               for i, (cid, lo) in enumerate((("a", 0), ("b", 200)))]
    assert clients[0].head(x[:2]).shape == (2, CFG.num_patches, CFG.embed_dim)
    assert any(k.startswith("head.convs.") for k in clients[0].part_state())
    res = run_festa_inprocess(srv, clients, rounds=4, steps_per_round=10, unifying_rounds=2,
                              test_data={c.client_id: (x[1400:], y[1400:]) for c in clients})
    assert all(res.metrics[c]["accuracy"] > 0.3 for c in ("a", "b")), res.metrics  # 3x chance
    a, b = clients[0].part_state(), clients[1].part_state()
    assert all(torch.equal(a[k], b[k]) for k in a if k.startswith("head."))
    with pytest.raises(ValueError, match="conv head has no class token"):
        FestaClient("c", CFG, CLS, x[:4], y[:4], head="conv", class_token=True)


def test_one_round_plan_for_the_drivers_the_campaign_and_its_clients():
    """protocols.split_rounds.RoundPlan: what the [split] settings plan, the offer announces and
    the in-process drivers follow, written once."""
    import pytest

    from atdnode.split import SplitSettings
    from protocols.split_rounds import RoundPlan
    from protocols.split_state import SplitProtocolError

    s = SplitSettings(rounds=3, phase2_rounds=2, steps_per_round=3, unifying_rounds=2)
    plan = s.plan("festa")
    assert plan == RoundPlan(3, 3, 2, 2) == RoundPlan.from_offer(s.offer("festa"))
    assert plan.total == s.total_rounds("festa") == 5
    assert [r for r in range(1, 6) if plan.freezes_at(r)] == [4]
    assert [r for r in range(1, 6) if plan.unifies(r)] == [2, 4]
    assert [(r, k) for r in (1, 2) for k in range(3) if plan.unifies_after(r, k)] == [(2, 2)]
    assert s.plan("pfesta") == RoundPlan(3, 3, 2) and not any(s.plan("pfesta").freezes_at(r) for r in range(9))
    with pytest.raises(SplitProtocolError, match="round plan"):
        RoundPlan.from_offer({"rounds": 2, "steps_per_round": "x", "unifying_rounds": 1})
    with pytest.raises(ValueError):
        RoundPlan(2, 0, 1)
