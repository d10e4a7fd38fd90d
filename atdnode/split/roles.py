"""Client roles of one split session, one class per algorithm, around the pure roles of
`protocols` (FestaClient, PFestaClient, MSD fine-tuning). Each keeps its learning state
across re-connections: `session(ch, resume)` runs one stream (join -> welcome -> the
algorithm's messages -> evaluation -> bye) and may be called again on a new stream after
a transport error, with ``resume=True``, to continue where the server says.

Images arrive from `atdnode.data` normalised to [-1, 1]; the split models work on
[0, 1] pixels (as `protocols.split_parts.digits_images`), so they are mapped back.
Targets per task kind: the labels (classification), the standardised amount of ink as a
severity score (regression), a per-patch ink mask (segmentation) — `digits_targets`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import trio

from atdnode import progress
from atdnode.blobs import BlobStore
from atdnode.data import MEAN, STD, LabeledImages
from atdnode.learning import ModelConfig, resolve_device
from atdnode.split.session import SplitChannel, meta_int, tensor
from atdnode.models import load_weights, save_weights
from atdnode.errors import WeightsError
from protocols import festa, pfesta
from protocols.comm_cost import CostParams, tensor_bytes
from protocols.msd import evaluate_local, fine_tune
from protocols.split_parts import SplitBody, TaskSpec, build_plain_embedder, digits_targets, split_config
from protocols.split_rounds import RoundPlan
from protocols.split_state import SplitProtocolError

EVAL_BATCH = 64


@dataclass
class Task:
    """Everything a role needs besides the channel: identity, offer, task, data, options."""

    client: str
    offer: dict[str, Any]
    spec: TaskSpec
    x: torch.Tensor        # (D, C, H, W) in [0, 1]
    y: torch.Tensor        # targets of spec
    test: tuple[torch.Tensor, torch.Tensor] | None
    rounds: int | None = None
    seed: int = 0
    lr: float | None = None
    permute: bool = True
    store: BlobStore | None = None
    finetune_steps: int = 100
    finetune_lr: float = 2e-3
    compare_scratch: bool = False
    embedder_state: dict[str, torch.Tensor] | None = None  # p-FESTA / MSD: the campaign's secret
    device: torch.device | None = None  # where this client's parts run (atdnode.learning.device rule; None: its default)

    @property
    def cfg(self) -> ModelConfig:
        return split_config(self.offer["body"])

    def run_device(self) -> torch.device:
        """The device of every model step of this client: head / tail (FESTA), embedder / tail
        (p-FESTA), fine-tuning (MSD). What it sends is CPU tensors on any device."""
        return self.device or resolve_device(None)


def prepare(data: LabeledImages, spec: TaskSpec, patch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[0, 1] images and the task's targets; SplitProtocolError if the labels do not fit."""
    x = (data.images * STD + MEAN).clamp(0, 1)
    if spec.kind == "classification" and len(data.classes) > spec.num_outputs:
        raise SplitProtocolError(f"task {spec.name!r} has {spec.num_outputs} classes, the data {len(data.classes)}")
    return x, digits_targets(spec, x, data.labels, patch_size)


def _like(t: torch.Tensor, shape: tuple[int, ...] | torch.Size, what: str) -> torch.Tensor:
    """``t`` if it is a float32 tensor of ``shape``, else SplitProtocolError (a server's reply)."""
    if t.dtype != torch.float32 or tuple(t.shape) != tuple(shape):
        raise SplitProtocolError(f"{what}: {t.dtype} {tuple(t.shape)}, expected float32 {tuple(shape)}")
    return t


def _load_parts(client: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Adopt the task's averaged parts (``state_down``) if they fit this client's parts exactly."""
    mine = client.part_state()
    if set(tensors) != set(mine):
        raise SplitProtocolError(f"state_down: keys differ from this client's parts ({len(tensors)} vs {len(mine)})")
    for k, v in mine.items():
        if tensors[k].dtype != v.dtype or tensors[k].shape != v.shape:
            raise SplitProtocolError(f"state_down: {k} is {tensors[k].dtype} {tuple(tensors[k].shape)}")
    client.load_part_state(tensors)


@dataclass
class Outcome:
    """What a finished role reports (comm record fields)."""

    rounds: list[int] = field(default_factory=list)
    losses: dict[int, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    params: CostParams | None = None
    train_kinds: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


async def _join(ch: SplitChannel, t: Task, resume: bool) -> dict[str, Any]:
    await ch.send("join", None, {"task": t.spec.name, "num_samples": int(t.x.shape[0]),
                                 "rounds": t.rounds, "resume": resume})
    return (await ch.recv("welcome")).meta


async def _evaluate(ch: SplitChannel, evaluate, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Run a protocols ``evaluate(images, targets, infer)`` in a worker thread whose
    ``infer`` carries each batch through the server body over ``ch``."""

    async def remote(feats: torch.Tensor) -> torch.Tensor:
        await ch.send("eval_forward", {"x": feats})
        return _like(tensor(await ch.recv("eval_out"), "y"), feats.shape, "eval_out")

    return await trio.to_thread.run_sync(lambda: evaluate(x, y, lambda f: trio.from_thread.run(remote, f),
                                                          batch_size=EVAL_BATCH))


class FestaRole:
    """FESTA: head + tail here, body on the server; this side drives every step."""

    def __init__(self, t: Task) -> None:
        self.t, self.out = t, Outcome(train_kinds=festa.TRAIN_KINDS)
        self.client: festa.FestaClient | None = None
        self.body_bytes = 0

    async def session(self, ch: SplitChannel, resume: bool) -> None:
        t, off = self.t, self.t.offer
        w = await _join(ch, t, resume)
        self.body_bytes = int(w["body_bytes"])
        if self.client is None:
            self.client = festa.FestaClient(t.client, t.cfg, t.spec, t.x, t.y, batch_size=int(w["batch_size"]),
                                            lr=t.lr or off["lr"], class_token=bool(off["class_token"]), seed=t.seed,
                                            device=t.run_device())
        c, plan = self.client, RoundPlan.from_offer(off)
        with progress.task(f"{t.spec.name}: FESTA rounds", total=int(w["last_round"])) as bar:
            bar.update(int(w["next_round"]) - 1)
            for r in range(int(w["next_round"]), int(w["last_round"]) + 1):
                await self._round(ch, r)
                bar.update(r)
        if t.test is not None and not self.out.metrics:
            self.out.metrics = await _evaluate(ch, c.evaluate, *t.test)
        await ch.send("bye")
        self.out.params = c.cost_params(steps_per_round=plan.steps_per_round, rounds=len(self.out.rounds),
                                        unifying_rounds=plan.unifying_rounds, body_bytes=self.body_bytes)

    async def _round(self, ch: SplitChannel, r: int) -> None:
        """Round r: `FestaClient.train_step` per step (head forward, body on the server, tail and
        head steps), the messages over ``ch``; parts unified as the plan says."""
        c, plan = self.client, RoundPlan.from_offer(self.t.offer)

        async def remote(kind: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> torch.Tensor:
            await ch.send(kind, tensors, meta)
            reply, name = ("body_out", "y") if kind == "forward" else ("grad_in", "g")
            return tensor(await ch.recv(reply), name)

        def exchange(kind: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> torch.Tensor:
            return trio.from_thread.run(remote, kind, tensors, meta)  # the step runs in a worker thread

        losses = []
        for _ in range(plan.steps_per_round):  # the client's half of festa_step (FestaClient.train_step)
            losses.append(await trio.to_thread.run_sync(c.train_step, exchange, r))
        self.out.losses[r] = sum(losses) / len(losses)
        if plan.unifies(r):
            await ch.send("state_up", c.part_state(), {"samples": c.num_samples, "round": r})
            _load_parts(c, (await ch.recv("state_down")).tensors)
        if r not in self.out.rounds:
            self.out.rounds.append(r)


class PFestaRole:
    """p-FESTA: frozen embedder (the clients' secret, `secret.py`), permutation keys kept here, task tail; the server
    chooses the batches."""

    def __init__(self, t: Task) -> None:
        # the ablation switches are p-FESTA's (absent from an MSD offer: fixed head, position table)
        self.head, pos = str(t.offer.get("head", "fixed")), bool(t.offer.get("pos_embed", True))
        self.t, self.out = t, Outcome(train_kinds=pfesta.train_kinds(self.head))
        if t.embedder_state is None:
            raise SplitProtocolError("p-FESTA / MSD need the campaign's embedder secret (split_secret entry)")
        self.embedder = build_plain_embedder(t.cfg, state=t.embedder_state)
        try:
            self.client = pfesta.PFestaClient(t.client, t.cfg, t.spec, t.x, t.y, self.embedder, permute=t.permute,
                                              lr=t.lr or t.offer["lr"], seed=t.seed, head=self.head, pos_embed=pos,
                                              device=t.run_device())
        except ValueError as e:
            raise SplitProtocolError(f"offer: {e}") from None
        self.uploaded_any = False

    async def upload(self, ch: SplitChannel, start: int) -> None:
        """Permuted embeddings of samples start.. in chunks; keys stay in ``client.keys``."""
        c, chunk = self.client, int(self.t.offer["upload_chunk"])
        with progress.task("upload permuted embeddings", total=c.num_samples) as bar:
            bar.update(start)
            for s0 in range(start, c.num_samples, chunk):
                feats, keys = await trio.to_thread.run_sync(c.embed, c.images[s0:s0 + chunk])
                c.keys[s0:s0 + feats.shape[0]] = keys
                await ch.send("upload", {"x": feats}, {"start": s0})
                self.uploaded_any = True
                bar.update(s0 + feats.shape[0])

    async def session(self, ch: SplitChannel, resume: bool) -> None:
        t, c, off = self.t, self.client, self.t.offer
        learnable = self.head == "learnable"
        w = await _join(ch, t, resume and (self.uploaded_any or learnable))  # a learnable head uploads nothing
        if not learnable:
            await self.upload(ch, int(w["uploaded"]))
        plan, losses = RoundPlan.from_offer(off), {}

        async def send_grad(kind: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> torch.Tensor | None:
            await ch.send(kind, tensors, meta)  # grad_out; a learnable head gets grad_in back
            return _like(tensor(await ch.recv("grad_in"), "g"), tensors["g"].shape, "grad_in") if learnable else None

        def exchange(kind: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> torch.Tensor | None:
            return trio.from_thread.run(send_grad, kind, tensors, meta)
        last = int(w.get("last_round", 0))  # the welcome names this client's last round
        with progress.task(f"{t.spec.name}: p-FESTA rounds", total=last or None) as bar:
            bar.update(int(w.get("next_round", 1)) - 1)
            while True:
                m = await ch.recv("batch" if learnable else "body_out", "done")
                if m.meta["kind"] == "done":
                    break
                idx, r, step = m.meta.get("idx"), meta_int(m, "round", low=1), meta_int(m, "step")
                if not isinstance(idx, list) or not all(isinstance(i, int) for i in idx):
                    raise SplitProtocolError(f"{m.meta['kind']}: idx must be a list of ints")
                if learnable:  # embed the named batch afresh, send it, get its body output
                    await ch.send("forward", {"x": await trio.to_thread.run_sync(c.head_forward, idx)})
                    y = tensor(await ch.recv("body_out"), "y")
                else:
                    y = tensor(m, "y")
                y = _like(y, (len(idx), t.cfg.num_patches, t.cfg.embed_dim), "body_out")
                # the client's half of pfesta_step (PFestaClient.train_step), in a worker thread
                losses.setdefault(r, []).append(await trio.to_thread.run_sync(c.train_step, idx, y, exchange))
                if m.meta.get("unify"):
                    await ch.send("state_up", c.part_state(), {"samples": c.num_samples, "round": r})
                    _load_parts(c, (await ch.recv("state_down")).tensors)
                if step == plan.steps_per_round - 1 and r not in self.out.rounds:
                    self.out.rounds.append(r)
                    self.out.losses[r] = sum(losses[r]) / len(losses[r])
                    bar.update(min(r, last) if last else r)
        if t.test is not None and not self.out.metrics:
            self.out.metrics = await _evaluate(ch, c.evaluate, *t.test)
        await ch.send("bye")
        self.out.params = c.cost_params(batch_size=int(w["batch_size"]), steps_per_round=plan.steps_per_round,
                                        rounds=len(self.out.rounds), unifying_rounds=plan.unifying_rounds,
                                        body_bytes=int(w["body_bytes"]))


class MSDRole(PFestaRole):
    """MSD: upload permuted embeddings once, receive the distilled body, fine-tune here."""

    def __init__(self, t: Task) -> None:
        super().__init__(t)
        self.out = Outcome(train_kinds=("upload", "weights"))
        self.body: dict[str, torch.Tensor] | None = None

    async def session(self, ch: SplitChannel, resume: bool) -> None:
        t = self.t
        w = await _join(ch, t, resume and self.uploaded_any)
        await self.upload(ch, int(w["uploaded"]))
        m = await ch.recv("weights")
        self.body = await trio.to_thread.run_sync(self._check_weights, m)
        self.out.extra.update({"weights_entry": m.meta.get("entry"), "weights_blob": m.meta.get("blob")})
        await ch.send("bye")
        f = t.cfg.num_patches * t.cfg.embed_dim * 4
        self.out.params = CostParams(D=int(t.x.shape[0]), B=0, R=1, n=1, F=f, G=f,
                                     Ph=tensor_bytes(self.embedder.state_dict()), Pb=int(w["body_bytes"]), Pt=0)
        self.out.rounds = [1]

    def _check_weights(self, m) -> dict[str, torch.Tensor]:
        """Store the received body as the published blob (same bytes -> same hash) and load it
        back through the checked loader (keys, shapes, dtypes, finiteness)."""
        meta = m.meta.get("weights_meta")
        if not isinstance(meta, dict) or self.t.store is None:
            raise SplitProtocolError("weights: no weights_meta to rebuild the published blob")
        try:
            blob = save_weights(self.t.store, m.tensors, meta)
            if blob != m.meta.get("blob"):
                raise SplitProtocolError(f"weights differ from the published blob {m.meta.get('blob')}")
            expect = {k: (tuple(v.shape), v.dtype) for k, v in SplitBody(self.t.cfg).state_dict().items()}
            tensors, _ = load_weights(self.t.store, blob, expect=expect)
        except WeightsError as e:
            raise SplitProtocolError(f"weights: {e}") from None
        return tensors

    def finetune(self) -> None:
        """Fine-tune body + tail locally from the distilled body (and from scratch, if asked)."""
        t = self.t
        assert self.body is not None
        runs = [("", self.body)] + ([("scratch_", None)] if t.compare_scratch else [])
        for prefix, state in runs:
            body, tail = fine_tune(self.embedder, t.cfg, t.spec, t.x, t.y, body_state=state,
                                   steps=t.finetune_steps, lr=t.finetune_lr, seed=t.seed,
                                   device=t.run_device())
            if t.test is not None:
                got = evaluate_local(self.embedder, body, tail, t.spec, *t.test)
                self.out.metrics.update({prefix + k: v for k, v in got.items() if math.isfinite(v)})


ROLES = {"festa": FestaRole, "pfesta": PFestaRole, "msd": MSDRole}
