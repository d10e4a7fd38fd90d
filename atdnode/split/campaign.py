"""FESTA / p-FESTA campaigns over the network: the server side of each client session and
the round coordinator, moving exactly the messages of the in-process drivers
(`protocols.festa.run_festa_inprocess`, `protocols.pfesta.run_pfesta_inprocess`) on the same
round schedule (`protocols.split_rounds.RoundPlan`: which round freezes the body, which
unifies, how many steps).

FESTA (the client drives each step; the server holds a forward of round r until r opens)::

    forward{task, round} -> body_out -> grad_out -> grad_in          x steps_per_round
    state_up{samples, round} -> state_down                           every n rounds

p-FESTA (the server drives: it chooses the batches from the stored uploads)::

    upload{start} ...                                                 once, in chunks
    body_out{idx, round, step, unify} -> grad_out                     x steps_per_round
    state_up{samples, round} -> state_down                            when unify is set
    done

Both end with optional ``eval_forward`` -> ``eval_out`` and ``bye``. Every protocol-server
call runs in one worker thread at a time (`call`), never on the trio loop.
"""
from __future__ import annotations

from typing import Any

import logging

import trio

from atdnode.learning import resolve_device

from atdnode.split.host import CampaignHost, Session
from atdnode.split.report import server_record, write_record
from atdnode.split.rounds import Member
from atdnode.split.session import EVAL_KINDS, meta_int, tensor
from protocols import festa, pfesta
from protocols.comm_cost import ByteCounter, CostParams, tensor_bytes
from protocols.split_parts import embedder_state_bytes, part_template
from protocols.split_state import SplitProtocolError, SplitStateError

log = logging.getLogger("atd.split")


class Campaign:
    """Coordinator + session logic of a FESTA or p-FESTA server (``svc.algorithm``)."""

    def __init__(self, svc: CampaignHost) -> None:
        assert svc.settings is not None and svc.board is not None
        self.svc, self.s, self.board = svc, svc.settings, svc.board
        self.device = resolve_device(None, home=svc.home)  # the body's device (atdnode.learning.device rule)
        self.algo = svc.algorithm
        self.cfg, self.tasks = self.s.vit_config(), {t.name: t for t in self.s.task_specs()}
        self.server: Any = None
        self.resumed: set[str] = set()
        self._limiter = trio.CapacityLimiter(1)
        self.train_kinds = festa.TRAIN_KINDS if self.algo == "festa" else pfesta.train_kinds(self.s.head)
        self.plan = self.s.plan(self.algo)  # the round schedule of the in-process drivers too

    async def call(self, fn, *args):
        """Run ``fn(*args)`` in the worker thread that owns the protocol server."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    # ------------------------------------------------------------------ state

    def _new_server(self):
        s, tasks = self.s, list(self.tasks.values())
        kw = dict(lr=s.lr, weight_decay=s.weight_decay, seed=s.seed, max_batch=max(1024, s.batch_size, s.upload_chunk),
                  part_weighting=s.part_weighting, device=self.device)
        if self.algo == "festa":
            return festa.FestaServer(self.cfg, tasks, class_token=s.class_token, **kw)
        return pfesta.PFestaServer(self.cfg, tasks, batch_size=s.batch_size, head=s.head, **kw)

    async def open_state(self) -> None:
        """Resume from ``HOME/split/server/<algorithm>/`` if a saved state is there."""
        state_dir = self.svc.dir / "state"
        cls = festa.FestaServer if self.algo == "festa" else pfesta.PFestaServer

        def load():
            if not (state_dir / "state.json").exists():
                return self._new_server(), None, None
            srv = cls.load(state_dir, device=self.device)
            if srv.cfg != self.cfg or set(srv.tasks.values()) != set(self.tasks.values()) \
                    or getattr(srv, "head", self.s.head) != self.s.head:
                raise SplitStateError(f"saved state in {state_dir} serves a different body, tasks or head than the "
                                      "[split] config; move it away to start a new campaign")
            return srv, self.svc.read_json("board.json"), self.svc.read_json("counter.json")

        self.server, board, counter = await trio.to_thread.run_sync(load)
        if board is not None:
            self.board.load_dict(board)
            self.resumed = set(self.server.clients) if not self.board.done else set()
        if counter is not None:
            self.svc.counter.merge(ByteCounter.from_dict(counter))
        self.pb = tensor_bytes(self.server.body.state_dict())
        pool = "token" if self.server.has_cls else "avg"
        self.pt = {n: tensor_bytes(part_template(self.cfg, t, with_head=False, pool=pool)) for n, t in self.tasks.items()}
        if self.algo == "festa":
            self.ph = {n: tensor_bytes(part_template(self.cfg, t, with_head=True, pool=pool)) - self.pt[n]
                       for n, t in self.tasks.items()}
        else:
            emb = embedder_state_bytes(self.cfg)  # from shapes: the server never holds the embedder
            self.ph = {n: emb for n in self.tasks}

    async def save(self) -> None:
        """Protocol server, round board, byte counter and per-client records, after a round."""
        board, counter = self.board.to_dict(), self.svc.counter.to_dict()
        members = {c: Member.from_dict(m.to_dict()) for c, m in self.board.members.items()}

        def work() -> None:
            self.server.save(self.svc.dir / "state")
            self.svc.write_json("board.json", board)
            self.svc.write_json("counter.json", counter)
            for c, m in members.items():
                rec = server_record(algorithm=self.algo, client=c, server=self.svc.daemon.transport.peer_id,
                                    task=self.tasks[m.task].to_dict(), params=self.params(m), counter=counter,
                                    train_kinds=self.train_kinds, rounds=m.rounds_done,
                                    dropped=self.server.dropped.get(c), **self.variant())
                write_record(self.svc.home, rec, name=f"server-{self.algo}-{c}")

        await self.call(work)

    def variant(self) -> dict[str, Any]:
        """p-FESTA's ablation switches, named in every record (empty for FESTA)."""
        return {"variant": {"head": self.s.head, "pos_embed": self.s.pos_embed}} if self.algo == "pfesta" else {}

    def params(self, m: Member) -> CostParams:
        """The paper's symbols for one client, as the server sees them."""
        tokens = self.cfg.num_patches + int(self.server.has_cls)
        f = tokens * self.cfg.embed_dim * 4
        return CostParams(D=m.num_samples, B=self.s.steps_per_round * min(self.s.batch_size, m.num_samples),
                          R=len(m.rounds_done), n=self.s.unifying_rounds, F=f, G=f, Ph=self.ph[m.task],
                          Pb=self.pb, Pt=self.pt[m.task])

    # ------------------------------------------------------------------ coordinator

    async def run(self) -> None:
        b, s = self.board, self.s
        if b.done:
            return
        start_deadline = trio.current_time() + s.start_timeout
        if not b.started:
            await b.wait(lambda: len(b.ready) >= s.clients, start_deadline)
            await b.wait(lambda: len(b.ready) >= 1)
            b.started = True
            await self.save()  # round 0: p-FESTA uploads are kept from here on
        else:  # resumed: give the previous participants time to come back
            await b.wait(lambda: self.resumed <= b.ready, start_deadline)
            for c in sorted(self.resumed - b.ready):
                await self.svc.drop(c, "did not return after the server restarted")
        r = b.completed + 1
        while r <= b.total:
            await b.wait(lambda: any(b.members[c].last_round >= r for c in b.ready))
            if self.plan.freezes_at(r) and not self.server.frozen:
                await self.call(self.server.freeze_body)
            members = sorted(c for c in b.ready if b.members[c].last_round >= r)
            deadline = trio.current_time() + s.round_timeout
            await self.call(self.server.begin_round, r, deadline, members)
            b.round, b.round_members = r, set(members)
            b.notify()
            while not await b.wait(lambda: not b.pending(), deadline):
                # past the deadline: drop whoever holds the round up; clients waiting at the
                # step barrier for them go on, with a fresh deadline for their remaining steps
                stalling = set(await self.call(self.server.stalling)) & b.pending()
                for c in sorted(stalling or b.pending()):
                    await self.svc.drop(c, f"missed the round {r} deadline")
                deadline = trio.current_time() + s.round_timeout
            if self.plan.unifies(r):
                await self._unify(r, deadline)
            for c in b.round_members:
                b.members[c].rounds_done.append(r)
            b.completed = r
            await self.save()
            log.info("split round %d/%d done: %d client(s)", r, b.total, len(b.round_members))
            for fn in self.svc.round_observers:
                await fn(r)
            r += 1
        b.done = True
        b.notify()
        await self.save()

    async def _unify(self, r: int, deadline: float) -> None:
        """Wait for every round member's parts, average per task, hand out the averages."""
        b = self.board
        await b.wait(lambda: all(b.submitted.get(c) == r for c in b.round_members), deadline)
        for c in sorted(c for c in b.round_members if b.submitted.get(c) != r):
            await self.svc.drop(c, f"missed the round {r} unification")
        by_task: dict[str, list[str]] = {}
        for c in sorted(b.round_members):
            by_task.setdefault(b.members[c].task, []).append(c)
        for task, clients in sorted(by_task.items()):
            try:
                avg = await self.call(self.server.unify, task)
            except SplitProtocolError as e:  # its clients were dropped meanwhile
                log.info("no unification of task %s in round %d: %s", task, r, e)
                continue
            for c in clients:
                b.downloads[c] = (r, avg)
        b.notify()

    # ------------------------------------------------------------------ sessions

    async def admit(self, sess: Session, frame) -> dict[str, Any]:
        """Handle ``join``: (re-)admit the client; returns the ``welcome`` meta."""
        cid, b = sess.client, self.board
        task, num, rounds, resume = self.svc.join_fields(frame)
        if task not in self.tasks:
            raise SplitProtocolError(f"unknown task {task!r}; this server offers {sorted(self.tasks)}")
        await self.svc.check_member(cid)
        known = b.members.get(cid)
        if b.done and known is None:
            raise SplitProtocolError("this campaign is over")
        if known is not None and known.task != task:
            raise SplitProtocolError(f"{cid} joined for task {known.task!r} before")
        fresh = not resume or known is None or known.num_samples != num
        srv = self.server

        def join() -> int:
            if self.algo == "festa":
                srv.join(cid, task)
                return 0
            if fresh:  # a new client process has new permutation keys: its old upload is useless
                srv.forget_upload(cid)
            srv.join(cid, task, num)
            return srv.store.received.get(cid, 0)

        uploaded = await self.call(join)
        old = self.svc.sessions.get(cid)
        if old is not None and old is not sess:
            old.scope.cancel()
        # no await from here on: the round a client starts in must not move under it
        next_round = b.next_round_for(cid)
        last = (known.last_round if known is not None and resume
                else min(b.total, next_round + rounds - 1) if rounds else b.total)
        b.members[cid] = Member(task, num, last, list(known.rounds_done) if known else [])
        self.svc.sessions[cid] = sess
        sess.admitted = True
        if self.algo == "festa":
            b.ready.add(cid)
        b.notify()
        log.info("split client %s joined for %s (rounds %d..%d, resume=%s)", cid[-8:], task, next_round, last, resume)
        return {"client": cid, "offer": self.svc.offer, "service_entry": self.svc.service_entry,
                "next_round": next_round, "last_round": last, "uploaded": uploaded,
                "batch_size": min(self.s.batch_size, num), "body_bytes": self.pb}

    async def drop_member(self, client: str, reason: str) -> None:
        def drop() -> None:
            if client in self.server.clients:
                self.server.drop_client(client, reason)

        await self.call(drop)

    async def serve(self, sess: Session) -> None:
        if self.algo == "festa":
            await self._serve_festa(sess)
        else:
            await self._serve_pfesta(sess)

    async def _serve_festa(self, sess: Session) -> None:
        cid, ch, steps = sess.client, sess.channel, self.plan.steps_per_round
        done_steps: dict[int, int] = {}
        while True:
            m = await self.svc.recv(sess, "forward", "state_up", "eval_forward", "bye")
            kind = m.meta["kind"]
            if kind == "bye":
                sess.clean = True
                return
            if kind == "eval_forward":
                await ch.send("eval_out", {"y": await self.call(self.server.infer, cid, tensor(m, "x"))})
            elif kind == "state_up":
                await self._exchange_parts(sess, m)
            else:
                r = meta_int(m, "round", low=1)
                await self._await_round(sess, r)
                if done_steps.get(r, 0) >= steps:
                    raise SplitProtocolError(f"round {r} has only {steps} steps")
                await self._await_step(cid)
                y = await self.call(self.server.forward, cid, m.meta.get("task"), tensor(m, "x"))
                await ch.send("body_out", {"y": y})
                g = await self.svc.recv(sess, "grad_out")
                gin = await self.call(self.server.backward, cid, tensor(g, "g"))
                self.board.notify()  # the body step may have been taken: release waiting clients
                await ch.send("grad_in", {"g": gin})
                done_steps[r] = done_steps.get(r, 0) + 1
                if done_steps[r] == steps:
                    await self._finish_round(cid, r)

    async def _await_round(self, sess: Session, r: int) -> None:
        """Hold a FESTA forward until round ``r`` opens; refuse it if ``r`` is not the client's."""
        b, m = self.board, self.svc.member(sess.client)
        if r > m.last_round:
            raise SplitProtocolError(f"round {r} is past this client's last round {m.last_round}")
        await b.wait(lambda: b.round >= r or b.done)
        if b.round != r or sess.client not in b.round_members:
            raise SplitProtocolError(f"{sess.client} is not taking part in round {r} (open round: {b.round})")

    async def _await_step(self, cid: str) -> None:
        """Hold a client's next step until the body took the one it finished (the step
        barrier of `protocols.split_server`: every round member's gradient, or its drop)."""
        b = self.board
        await b.wait(lambda: cid not in self.server.clients or self.server.can_forward(cid))

    async def _finish_round(self, cid: str, r: int) -> None:
        await self.call(self.server.finish_round, cid)
        self.board.finished[cid] = r
        self.board.notify()

    async def _exchange_parts(self, sess: Session, m) -> None:
        """``state_up`` of round r -> wait for the task's average -> ``state_down``."""
        b, cid = self.board, sess.client
        r = meta_int(m, "round", low=1)
        if r != b.round or not self.plan.unifies(r) or b.finished.get(cid, 0) != r:
            raise SplitProtocolError(f"state_up for round {r} out of turn (open round {b.round})")
        await self.call(self.server.submit_state, cid, m.tensors, m.meta.get("samples"))
        b.submitted[cid] = r
        b.notify()
        await b.wait(lambda: b.downloads.get(cid, (0, None))[0] == r)
        _, avg = b.downloads.pop(cid)
        await sess.channel.send("state_down", avg)

    async def _serve_pfesta(self, sess: Session) -> None:
        cid, ch, b, srv = sess.client, sess.channel, self.board, self.server
        while srv.head == "fixed" and not srv.store.complete(cid):
            m = await self.svc.recv(sess, "upload")
            await self.call(srv.receive_features, cid, meta_int(m, "start"), tensor(m, "x"))
        b.ready.add(cid)
        b.notify()
        member = self.svc.member(cid)

        def my_turn() -> bool:
            return cid in b.round_members and b.finished.get(cid, 0) < b.round

        while True:
            await b.wait(lambda: b.done or b.round > member.last_round or my_turn())
            if not my_turn():
                break
            r = b.round
            for step in range(self.plan.steps_per_round):
                await self._await_step(cid)
                idx = await self.call(srv.next_indices, cid)
                unify = self.plan.unifies_after(r, step)
                meta = {"idx": idx, "round": r, "step": step, "unify": unify}
                if srv.head == "learnable":  # the client embeds the named batch afresh (pfesta module doc)
                    await ch.send("batch", None, meta)
                    x = tensor(await self.svc.recv(sess, "forward"), "x")
                    await ch.send("body_out", {"y": await self.call(srv.forward_features, cid, x)})
                else:
                    await ch.send("body_out", {"y": await self.call(srv.forward, cid, idx)}, meta)
                g = await self.svc.recv(sess, "grad_out")
                gin = await self.call(srv.backward, cid, tensor(g, "g"))
                b.notify()  # the body step may have been taken: release waiting clients
                if gin is not None:
                    await ch.send("grad_in", {"g": gin})
            await self._finish_round(cid, r)
            if self.plan.unifies(r):
                await self._exchange_parts(sess, await self.svc.recv(sess, "state_up"))
        await ch.send("done")
        while True:
            m = await self.svc.recv(sess, *EVAL_KINDS[:1], "bye")
            if m.meta["kind"] == "bye":
                sess.clean = True
                return
            await ch.send("eval_out", {"y": await self.call(srv.infer, cid, tensor(m, "x"))})
