"""p-FESTA's ablation switches (p-FESTA paper, ablation study): a fixed vs a learnable head,
with vs without position embedding. Each switch must change what is trained and sent."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as Fn

from protocols.comm_cost import compare
from protocols.pfesta import LEARNABLE_TRAIN_KINDS, TRAIN_KINDS, PFestaClient, PFestaServer, run_pfesta_inprocess
from protocols.split_parts import TaskSpec, build_plain_embedder, digits_images, split_config
from protocols.split_state import SplitProtocolError

CFG = split_config(img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=2, num_heads=2)
CLS = TaskSpec("digit", "classification", 10)


@pytest.fixture(scope="module")
def digits():
    x, y = digits_images(16)
    return x[:200], y[:200]


def _run(digits, head: str, pos_embed: bool = True):
    torch.set_num_threads(1)
    x, y = digits
    emb = build_plain_embedder(CFG, seed=0)
    shared = {k: v.clone() for k, v in emb.state_dict().items()}
    srv = PFestaServer(CFG, [CLS], batch_size=16, lr=3e-3, head=head)
    cl = [PFestaClient(cid, CFG, CLS, x[lo:lo + 80], y[lo:lo + 80], emb, lr=3e-3, seed=i, head=head,
                       pos_embed=pos_embed) for i, (cid, lo) in enumerate((("a", 0), ("b", 80)))]
    res = run_pfesta_inprocess(srv, cl, rounds=2, steps_per_round=2, unifying_rounds=1,
                               test_data={c.client_id: (x[160:], y[160:]) for c in cl})
    assert all(torch.equal(v, emb.state_dict()[k]) for k, v in shared.items())  # the shared one never moves
    return res, srv, cl, shared


def test_fixed_head_is_never_updated_and_uploads_once(digits):
    res, srv, cl, shared = _run(digits, "fixed")
    for c in cl:
        assert all(torch.equal(v, shared[k]) for k, v in c.embedder.state_dict().items())
        assert not any(p.requires_grad for p in c.embedder.parameters())
    assert res.train_kinds == TRAIN_KINDS and set(res.counter.kinds()) >= {"upload"}
    assert not {"forward", "grad_in", "batch"} & set(res.counter.kinds())
    assert srv.store.complete("a")


def test_learnable_head_is_trained_per_client_and_never_sent(digits):
    res, srv, cl, shared = _run(digits, "learnable")
    for c in cl:  # each client's own copy moved, projection and position table
        st = c.embedder.state_dict()
        for k in ("vit.patch_embed.proj.weight", "vit.pos_embed"):
            assert not torch.equal(st[k], shared[k]), k
    a, b = (c.embedder.state_dict()["vit.patch_embed.proj.weight"] for c in cl)
    assert not torch.equal(a, b)  # heads are not averaged: they stay with their clients
    kinds = set(res.counter.kinds())
    assert "upload" not in kinds and {"batch", "forward", "grad_in"} <= kinds
    assert res.train_kinds == LEARNABLE_TRAIN_KINDS and not srv.store.features
    # per step the client sends embeddings and gets dLoss/d embeddings back: 2 clients x 4 steps
    assert res.counter.messages(kinds=["forward"]) == res.counter.messages(kinds=["grad_in"]) == 8
    for r in compare(res.counter, res.params, "pfesta_learnable_head", LEARNABLE_TRAIN_KINDS):
        assert abs(r["rel_error"]) < 0.05, r  # 2BR(F+G) + 2R Pt/n
    fixed, *_ = _run(digits, "fixed")
    assert res.counter.total("a", kinds=LEARNABLE_TRAIN_KINDS) > fixed.counter.total("a", kinds=TRAIN_KINDS)
    # a fixed-head server refuses per-step features and a learnable one uploads / index-only forwards
    with pytest.raises(SplitProtocolError, match="fixed head"):
        PFestaServer(CFG, [CLS], head="fixed").forward_features("a", torch.zeros(1, 16, 32))
    lsrv = PFestaServer(CFG, [CLS], head="learnable")
    lsrv.join("a", "digit", 10)
    with pytest.raises(SplitProtocolError, match="nothing is uploaded"):
        lsrv.receive_features("a", 0, torch.zeros(1, 16, 32))
    with pytest.raises(SplitProtocolError, match="learnable heads"):
        lsrv.forward("a", [0])
    with pytest.raises(ValueError, match="head must be one of"):
        PFestaServer(CFG, [CLS], head="frozen")


def test_learnable_server_survives_save_and_load(digits, tmp_path):
    _, srv, _, _ = _run(digits, "learnable")
    srv.save(tmp_path / "s")
    back = PFestaServer.load(tmp_path / "s")
    assert back.head == "learnable" and back.sizes == {"a": 80, "b": 80}
    assert back.next_indices("a") and not back.store.features


def _shuffle_patches(x: torch.Tensor, p: int, perm: torch.Tensor) -> torch.Tensor:
    """The same image with its p x p patches moved to other places (rows of timm's order)."""
    b, c, h, w = x.shape
    cols = Fn.unfold(x, p, stride=p)  # (B, C*p*p, N)
    return Fn.fold(cols[:, :, perm], (h, w), p, stride=p)


def test_without_pos_embed_the_embedder_adds_no_position_table(digits):
    x, y = digits
    emb = build_plain_embedder(CFG, seed=0)
    with_pos = PFestaClient("a", CFG, CLS, x[:8], y[:8], emb)
    no_pos = PFestaClient("a", CFG, CLS, x[:8], y[:8], emb, pos_embed=False)
    assert torch.count_nonzero(no_pos.embedder.vit.pos_embed) == 0
    assert torch.count_nonzero(emb.vit.pos_embed) > 0  # the shared secret keeps its table
    with torch.no_grad():
        proj = no_pos.embedder.vit.patch_embed(x[:8])  # (B, N, D): the patch projection alone
        assert torch.equal(no_pos.embedder(x[:8]), proj)
        assert not torch.allclose(with_pos.embedder(x[:8]), proj)
        # moving patches around only reorders the tokens: a bag of patches, the same to the
        # (permutation-equivariant) body and mean-pooling tail, unless the position table says where
        perm = torch.randperm(CFG.num_patches, generator=torch.Generator().manual_seed(3))
        moved = _shuffle_patches(x[:8], CFG.patch_size, perm)
        assert torch.allclose(no_pos.embedder(moved), no_pos.embedder(x[:8])[:, perm], atol=1e-6)
        assert not torch.allclose(with_pos.embedder(moved), with_pos.embedder(x[:8])[:, perm], atol=1e-3)


def test_learnable_head_without_pos_embed_keeps_the_table_at_zero(digits):
    res, _, cl, shared = _run(digits, "learnable", pos_embed=False)
    for c in cl:
        assert torch.count_nonzero(c.embedder.vit.pos_embed) == 0
        assert not torch.equal(c.embedder.state_dict()["vit.patch_embed.proj.weight"],
                               shared["vit.patch_embed.proj.weight"])
    assert set(res.metrics) == {"a", "b"}
