"""The split server's update rules, hand-computed: Algorithm 1's body step on the per-task
client-averaged gradient (FESTA l.12, p-FESTA l.14), the step barrier, and the uniform
(default) or sample-weighted averaging of heads / tails."""
from __future__ import annotations

import copy
import itertools

import pytest
import torch

from protocols.festa import FestaServer
from protocols.split_parts import TaskSpec, split_config
from protocols.split_server import StepBarrier

CFG = split_config(img_size=8, patch_size=4, in_chans=1, embed_dim=8, depth=1, num_heads=2, mlp_ratio=1.0)
T1 = TaskSpec("t1", "classification", 3, loss_weight=1.0)
T2 = TaskSpec("t2", "regression", 1, loss_weight=0.5)
CLIENTS = {"a1": "t1", "a2": "t1", "b1": "t2"}  # task t1 has two clients, t2 one
LR = 0.1


def _server() -> FestaServer:
    srv = FestaServer(CFG, [T1, T2], seed=4)
    srv.opt = torch.optim.SGD(srv.body.parameters(), lr=LR)  # plain SGD: the update is lr * gradient
    for c, t in CLIENTS.items():
        srv.join(c, t)
    srv.begin_round(1, deadline=float("inf"))
    return srv


def _messages() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    shape = (2, CFG.num_patches, CFG.embed_dim)
    return {c: (torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)) for c in CLIENTS}


def _manual(srv: FestaServer, msgs) -> dict[str, torch.Tensor]:
    """theta - lr * (1.0 * (g_a1 + g_a2) / 2 + 0.5 * g_b1), g_c = d<body(x_c), g_out_c>/d theta."""
    body = copy.deepcopy(srv.body)
    grads = {}
    for c, (x, gout) in msgs.items():
        gs = torch.autograd.grad((body(x) * gout).sum(), list(body.parameters()))
        grads[c] = gs
    total = [1.0 * (a + b) / 2 + 0.5 * c for a, b, c in zip(grads["a1"], grads["a2"], grads["b1"])]
    return {n: (p - LR * g).detach() for (n, p), g in zip(body.named_parameters(), total)}


def test_one_body_step_on_task_averaged_gradients_whatever_the_order():
    msgs = _messages()
    want = _manual(_server(), msgs)
    results = []
    for order in itertools.permutations(CLIENTS):
        srv = _server()
        for c in order:  # forwards interleaved with backwards in arrival order
            srv.forward(c, CLIENTS[c], msgs[c][0])
        for i, c in enumerate(order):
            assert srv.version == 0, "no body step before every client's gradient is in"
            srv.backward(c, msgs[c][1])
            assert srv.version == (1 if i == len(order) - 1 else 0)
        got = {n: p.detach().clone() for n, p in srv.body.named_parameters()}
        for n in want:
            assert torch.allclose(got[n], want[n], atol=1e-6), n
        results.append(got)
    for other in results[1:]:  # bit-identical whatever the arrival order
        assert all(torch.equal(results[0][n], other[n]) for n in want)


def test_step_barrier_holds_early_clients_and_a_drop_releases_it():
    msgs = _messages()
    srv = _server()
    for c in ("a1", "a2"):
        srv.forward(c, CLIENTS[c], msgs[c][0])
        srv.backward(c, msgs[c][1])
    assert not srv.can_forward("a1") and srv.step_waiting_for() == ["b1"]
    with pytest.raises(StepBarrier, match="b1"):
        srv.forward("a1", "t1", msgs["a1"][0])
    before = [p.detach().clone() for p in srv.body.parameters()]
    srv.drop_client("b1", "missed the round 1 deadline")  # the step goes on without it: t1 only
    assert srv.version == 1 and srv.can_forward("a1")
    body = copy.deepcopy(srv.body)
    with torch.no_grad():
        for p, p0 in zip(body.parameters(), before):
            p.copy_(p0)
    g = [torch.autograd.grad((body(msgs[c][0]) * msgs[c][1]).sum(), list(body.parameters())) for c in ("a1", "a2")]
    for p, p0, ga, gb in zip(srv.body.parameters(), before, *g):
        assert torch.allclose(p, p0 - LR * (ga + gb) / 2, atol=1e-6)


def test_frozen_body_and_zero_weight_take_no_step():
    msgs = _messages()
    srv = FestaServer(CFG, [T1, TaskSpec("t2", "regression", 1, loss_weight=0.0)], seed=4)
    srv.join("b1", "t2")
    srv.begin_round(1, deadline=float("inf"))
    before = [p.detach().clone() for p in srv.body.parameters()]
    srv.forward("b1", "t2", msgs["b1"][0])
    assert srv.backward("b1", msgs["b1"][1]).shape == msgs["b1"][0].shape  # the client still gets its gradient
    assert srv.version == 0 and all(torch.equal(p, q) for p, q in zip(srv.body.parameters(), before))
    assert srv.can_forward("b1")  # the (empty) step closed


def _states(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    srv = FestaServer(CFG, [T1], seed=0)
    tmpl = srv._templates["t1"]
    g = torch.Generator().manual_seed(seed)
    return {c: {k: torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone() for k, v in tmpl.items()}
            for c in ("a1", "a2")}


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_heads_and_tails_average_uniformly_by_default(weighting):
    states = _states(3)
    kw = {} if weighting == "uniform" else {"part_weighting": "samples"}
    srv = FestaServer(CFG, [T1], seed=0, **kw)
    assert srv.part_weighting == weighting
    for c, n in (("a2", 300), ("a1", 100)):
        srv.join(c, "t1")
        srv.submit_state(c, states[c], n)
    avg = srv.unify("t1")
    wa = 0.5 if weighting == "uniform" else 0.25
    for k, v in avg.items():
        if not v.is_floating_point():
            continue
        assert torch.allclose(v, wa * states["a1"][k] + (1 - wa) * states["a2"][k], atol=1e-6), k
    assert srv.events[-1]["weighting"] == weighting and srv.events[-1]["clients"] == ["a1", "a2"]
    with pytest.raises(ValueError, match="part_weighting"):
        FestaServer(CFG, [T1], part_weighting="median")
