"""Masked sampling distillation over the network: one round of communication.

    client -> server   upload{start} ...          permuted plain embeddings, once (D * F)
    server             waits for `clients` uploads (or start_timeout), trains the DINO-style
                       student / teacher on them (`protocols.msd.MSDTrainer`, no labels),
                       stores the teacher body as a safetensors blob and appends a signed
                       `weights` entry (part "body", readers = the contributors: MSD's
                       "authorised" clients, enforced by the blob server)
    server -> client   weights{blob, entry, weights_meta}   the body state (Pb)
    client -> server   bye

Each client then fine-tunes body + task tail locally (`atd split join` does it at once;
`atd split finetune` does it later from the `weights` entry). A client that re-connects
after the round gets the published body again; one that did not contribute is refused.
"""
from __future__ import annotations

from typing import Any

import torch
import trio

from atdnode.blobs import BlobStore
from atdnode.split.host import CampaignHost, Session
from atdnode.split.report import server_record, write_record
from atdnode.split.rounds import Member
from atdnode.split.session import meta_int, tensor
from atdnode.models import load_weights, save_weights
from protocols.comm_cost import ByteCounter, CostParams, tensor_bytes
from atdnode.learning import resolve_device
from protocols.msd import MSDTrainer
from protocols.pfesta import FeatureStore
from atdnode.bodies import READERS
from protocols.split_parts import SplitBody, embedder_state_bytes, split_dict
from protocols.split_state import SplitProtocolError


TRAIN_KINDS = ("upload", "weights")


class MSDCampaign:
    """Coordinator + session logic of an MSD server."""

    def __init__(self, svc: CampaignHost) -> None:
        assert svc.settings is not None and svc.board is not None
        self.svc, self.s, self.board = svc, svc.settings, svc.board
        self.cfg, self.tasks = self.s.vit_config(), {t.name: t for t in self.s.task_specs()}
        self.store = FeatureStore((self.cfg.num_patches, self.cfg.embed_dim), max(1024, self.s.upload_chunk))
        self.dropped: dict[str, str] = {}
        self.result: dict[str, Any] | None = None  # {"tensors", "meta", "blob", "entry", "contributors"}
        self.train_kinds = TRAIN_KINDS
        self._limiter = trio.CapacityLimiter(1)
        self.pb = tensor_bytes(SplitBody(self.cfg).state_dict())
        self.ph = embedder_state_bytes(self.cfg)  # from shapes: the server never holds the embedder

    async def open_state(self) -> None:
        """After a restart: the finished round's result (uploads are not kept before it)."""
        board = self.svc.read_json("board.json")
        if board is None:
            return
        self.board.load_dict(board)
        counter = self.svc.read_json("counter.json")
        if counter is not None:
            self.svc.counter.merge(ByteCounter.from_dict(counter))
        saved = self.svc.read_json("result.json")
        if self.board.done and saved is not None:
            store = BlobStore(self.svc.home.blobs_dir)
            tensors, meta = await trio.to_thread.run_sync(lambda: load_weights(store, saved["blob"]))
            self.result = {**saved, "tensors": tensors, "meta": meta}

    async def run(self) -> None:
        b, s = self.board, self.s
        if b.done:
            return
        deadline = trio.current_time() + s.start_timeout
        await b.wait(lambda: len(b.ready) >= s.clients, deadline)
        await b.wait(lambda: sum(b.members[c].num_samples for c in b.ready) >= 2)
        contributors = sorted(b.ready)
        b.started, b.round, b.round_members = True, 1, set(contributors)
        b.notify()
        feats = torch.cat([self.store.features[c] for c in contributors])  # (M, N, D)
        result = await trio.to_thread.run_sync(MSDTrainer(self.cfg, self.s.msd_config(),
                                                                     device=resolve_device(None, home=self.svc.home)).train, feats)
        # the body is useless without the clients' secret embedder; the entry names which
        # (an id only) so a client can fine-tune later, and who may fetch it (MSD §III)
        secret = {"service": self.svc.service_entry, "secret": self.svc.secret_entry}
        meta = {"part": "body", "algorithm": "msd", "split": split_dict(self.cfg), **secret, "msd": result.config}
        store = self.svc.daemon.store
        blob = await trio.to_thread.run_sync(lambda: save_weights(store, result.body_state, meta))
        body = {"blob": blob, "size": store.size(blob), "manifest": store.manifest(blob).hash, "part": "body",
                "model": {"split": split_dict(self.cfg), **secret},
                "labels": [], "label_fp": "", "samples": int(feats.shape[0]),
                "provenance": [self.svc.service_entry] if self.svc.service_entry else [],
                "metrics": {"msd_loss_first": result.losses[0], "msd_loss_last": result.losses[-1]},
                "algorithm": "msd", "tasks": [t.to_dict() for t in self.tasks.values()],
                READERS: contributors}
        entry = await self.svc.daemon.append("weights", body)
        self.result = {"blob": blob, "entry": entry.id.hex(), "contributors": contributors,
                       "tensors": result.body_state, "meta": meta}
        for c in contributors:
            b.members[c].rounds_done.append(1)
        b.completed, b.done = 1, True
        await self.save()
        b.notify()

    async def save(self) -> None:
        board, counter = self.board.to_dict(), self.svc.counter.to_dict()
        members = {c: Member.from_dict(m.to_dict()) for c, m in self.board.members.items()}
        saved = None if self.result is None else {k: self.result[k] for k in ("blob", "entry", "contributors")}

        def work() -> None:
            self.svc.write_json("board.json", board)
            self.svc.write_json("counter.json", counter)
            if saved is not None:
                self.svc.write_json("result.json", saved)
            for c, m in members.items():
                rec = server_record(algorithm="msd", client=c, server=self.svc.daemon.transport.peer_id,
                                    task=self.tasks[m.task].to_dict(), params=self.params(m), counter=counter,
                                    train_kinds=TRAIN_KINDS, rounds=m.rounds_done, dropped=self.dropped.get(c))
                write_record(self.svc.home, rec, name=f"server-msd-{c}")

        await trio.to_thread.run_sync(work)

    def params(self, m: Member) -> CostParams:
        f = self.cfg.num_patches * self.cfg.embed_dim * 4
        return CostParams(D=m.num_samples, B=0, R=1, n=1, F=f, G=f, Ph=self.ph, Pb=self.pb, Pt=0)

    # ------------------------------------------------------------------ sessions

    async def admit(self, sess: Session, frame) -> dict[str, Any]:
        cid, b = sess.client, self.board
        task, num, _rounds, resume = self.svc.join_fields(frame)
        if task not in self.tasks:
            raise SplitProtocolError(f"unknown task {task!r}; this server offers {sorted(self.tasks)}")
        await self.svc.check_member(cid)
        if b.done and (self.result is None or cid not in self.result["contributors"]):
            entry = self.result["entry"] if self.result else "?"
            raise SplitProtocolError(f"the MSD round is over; fine-tune from weights entry {entry} "
                                     "(atd split finetune)")
        known = b.members.get(cid)
        if not b.done and (not resume or known is None or known.num_samples != num):
            self.store.features.pop(cid, None)
            self.store.received.pop(cid, None)
        if not b.done:
            self.store.open(cid, num)
        old = self.svc.sessions.get(cid)
        if old is not None and old is not sess:
            old.scope.cancel()
        b.members[cid] = Member(task, num, 1, list(known.rounds_done) if known else [])
        self.svc.sessions[cid] = sess
        sess.admitted = True
        self.dropped.pop(cid, None)
        b.notify()
        return {"client": cid, "offer": self.svc.offer, "service_entry": self.svc.service_entry,
                "next_round": 1, "last_round": 1, "body_bytes": self.pb,
                "uploaded": num if b.done else self.store.received.get(cid, 0)}

    async def drop_member(self, client: str, reason: str) -> None:
        self.dropped[client] = reason
        await trio.lowlevel.checkpoint()

    async def serve(self, sess: Session) -> None:
        cid, b = sess.client, self.board
        while not b.done and not self.store.complete(cid):
            m = await self.svc.recv(sess, "upload")
            feats = tensor(m, "x")
            await trio.to_thread.run_sync(self.store.receive, cid, meta_int(m, "start"), feats,
                                          limiter=self._limiter)
        b.ready.add(cid)
        b.notify()
        await b.wait(lambda: b.done)
        assert self.result is not None
        if cid not in self.result["contributors"]:
            raise SplitProtocolError("the MSD round ran without this client's features")
        r = self.result
        await sess.channel.send("weights", r["tensors"], {"bytes": tensor_bytes(r["tensors"]), "blob": r["blob"],
                                                          "entry": r["entry"], "weights_meta": r["meta"]})
        await self.svc.recv(sess, "bye")
        sess.clean = True
