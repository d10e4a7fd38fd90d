"""`base = "msd"`: before the VGS-ATD phases, the scenario's nodes build their base model by
masked sampling distillation, through the code the CLI runs:

1. a consortium of the scenario's nodes plus one ``msd-server`` node (its own homes and
   ledger under ``work``; the VGS-ATD run that follows has its own consortium, see below);
2. the server's daemon (`atd node start --role msd-server`) offers one MSD campaign whose
   body is the scenario's ``[model]`` sizes;
3. every node joins it (`atd split join`, `atdnode.split.client.run_join`) with its own
   training images: the first client seals the campaign's secret embedder to the others,
   each uploads its permuted patch embeddings once — no labels (the join's local
   fine-tuning is switched off) — the server distils the body and publishes it to them;
4. every node runs `atd base build` (`atdnode.split.base.build_base`): embedder + body ->
   a timm ViT extractor (:data:`atdnode.split.base.BASE_MODEL`), and writes it out as an
   atd weight-set file, which its VGS-ATD training then starts from exactly as
   ``atd train --init-from FILE`` does (the file is imported into the node's store).

Deviation: in netsim the campaign runs in its own in-memory consortium (same node names,
one extra server node), not over the VGS-ATD run's simulated network — the VGS-ATD nodes
receive the assembled base as a local file. Every node assembles the same bytes. The
embedder secret is drawn from the scenario seed (a run is reproducible), not from the OS.

MSD settings the paper leaves blank (``[msd]`` of the scenario, `netsim.scenario.MSDSpec`)
were chosen by measurement, and the numbers live where they cannot drift from this code
unnoticed: the output of ``bench/msd_base_bench.py`` and RESULTS.md ("MSD base"). The choices, with what decided them:

- teacher views keep 0.75 of the patches, student views 0.5, two of each
  (``--choose``: the best sum of accuracy after 20 and 40 fine-tuning steps; with 4 patches a
  view keeps ceil(keep * 4) tokens, so MSDConfig's 0.875 is 1.0 here; no student views is worst);
- 1000 campaign steps (``--probe``: the base's own features, scored by the phase-3 ensemble
  against a random body's, stopped improving between 1000 and 2000 steps);
- ``finetune_lr`` 3e-4 for VGS-ATD training from the base (3e-3, the rate for training from
  scratch, wore the base's features away on three_phase);
- the campaign's embedder secret drawn from the scenario seed (`JoinOptions.secret_seed`,
  simulation only; a deployment keeps OS randomness), so a run at one seed is reproducible.
"""
from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import trio

from atdnode.blobs import BlobStore
from atdnode.learning import ModelConfig
from atdnode.split import BASE_MODEL, build_base
from netsim.homes import make_consortium
from netsim.nodedata import ScenarioData, node_spec
from netsim.scenario import Scenario, ScenarioError

SERVER = "msd"  # short: a daemon's control socket path must fit AF_UNIX's limit


@dataclass
class MSDBase:
    """What the base step produced: each node's base file, the base's model config, and the
    campaign's cost (wall time, measured bytes per client) and loss."""

    files: dict[str, Path]
    model: ModelConfig
    campaign: str
    wall_s: float
    bytes_per_client: dict[str, dict[str, int]] = field(default_factory=dict)
    msd_loss: dict[str, float] = field(default_factory=dict)
    settings: dict = field(default_factory=dict)

    def summary(self) -> dict:
        return {"campaign": self.campaign, "model": self.model.to_dict(), "wall_s": round(self.wall_s, 3),
                "bytes_per_client": self.bytes_per_client, "msd_loss": self.msd_loss, "settings": self.settings}


def base_scenario(scn: Scenario) -> Scenario:
    """``scn`` with its ``[model]`` renamed to the base's timm ViT (same sizes): the
    class-token-free, average-pooled ViT the MSD body fits."""
    return scn.replace(model=replace(scn.model, name=BASE_MODEL))


def campaign_settings(scn: Scenario, data: ScenarioData) -> dict:
    """The server's split settings (`atdnode.split.settings.SplitSettings` dict)."""
    m, s = scn.model, scn.msd
    body = {"img_size": m.img_size, "patch_size": m.patch_size, "in_chans": m.in_chans, "embed_dim": m.embed_dim,
            "depth": m.depth, "num_heads": m.num_heads, "mlp_ratio": m.mlp_ratio}
    task = {"name": "images", "kind": "classification", "num_outputs": max(2, len(data.label_space))}
    msd = {"steps": s.steps, "batch_size": s.batch_size, "lr": s.lr, "teacher_keep": s.teacher_keep,
           "student_keep": s.student_keep, "teacher_views": s.teacher_views, "student_views": s.student_views,
           "seed": scn.seed}
    return {"tasks": [task], "body": body, "clients": len(data.nodes), "start_timeout": 3600.0,
            "round_timeout": 3600.0, "max_samples": max(len(d.train) for d in data.nodes.values()) + 1,
            "msd": msd}


def run_msd_base(scn: Scenario, data: ScenarioData, work: Path, *, progress=lambda _m: None) -> MSDBase:
    """Run the MSD campaign over the scenario's nodes and assemble each node's base (see the
    module doc); the base files are written under ``work/base``."""
    from atdnode.split import SplitSettings

    names = list(data.nodes)
    if SERVER in names:
        raise ScenarioError(f"{scn.source}: base = \"msd\" needs the node name {SERVER!r} for its server")
    cons = make_consortium(work / "h", [SERVER] + names, seed=scn.seed, consortium="netsim-msd",
                           roles={SERVER: "msd-server"})
    server_home = cons.homes[SERVER]
    settings = campaign_settings(scn, data)
    SplitSettings.from_dict(settings).save(server_home)
    specs = {n: node_spec(data.nodes[n], work / 'data' / f'{n}.npz') for n in names}
    progress(f"MSD base: campaign over {len(names)} nodes' unlabelled images ({scn.msd.steps} steps)")
    t0 = time.perf_counter()
    records = trio.run(_campaign, cons, names, specs, scn.seed)
    wall = time.perf_counter() - t0
    from atdnode.split import report_row

    out = work / "base"
    out.mkdir(parents=True, exist_ok=True)
    files, campaign, loss = {}, "", {}
    for n in names:
        rec = build_base(cons.homes[n])
        src = BlobStore(cons.homes[n].blobs_dir).path(rec.blobs["extractor"])
        files[n] = Path(shutil.copyfile(src, out / f"{n}.safetensors"))
        campaign = rec.provenance["campaign"]
        loss = {k: float(v) for k, v in rec.metrics.items()}
    per_client = {}
    for n, r in records.items():
        row = report_row(r)
        per_client[n] = {"up": int(row["measured_up"]), "down": int(row["measured_down"])}
    model = ModelConfig.from_dict(_read_model(files[names[0]]))
    progress(f"MSD base: campaign {campaign[:12]} done in {wall:.1f} s; bases assembled on {len(files)} nodes")
    return MSDBase(files=files, model=model, campaign=campaign, wall_s=wall, bytes_per_client=per_client,
                   msd_loss=loss, settings=asdict(scn.msd))


def _read_model(path: Path) -> dict:
    import json

    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["atd"])["model"]


async def _campaign(cons, names: list[str], specs: dict[str, str], seed: int) -> dict[str, dict]:
    """The server daemon and every client session on one in-memory network; the clients'
    comm records."""
    from atdnode.node import NodeDaemon, NodeIdentity
    from atdnode.split import JoinOptions, run_join, single_error
    from atdnode.transport import MemoryNetwork, MemoryTransport

    net = MemoryNetwork(seed=seed)
    homes = cons.homes
    server = NodeDaemon(homes[SERVER], transport=MemoryTransport(net, NodeIdentity.load(homes[SERVER]).signer.seed),
                        sync_interval=0.5, poll_interval=0.05)
    records: dict[str, dict] = {}

    async def join(n: str) -> None:
        t = MemoryTransport(net, NodeIdentity.load(homes[n]).signer.seed)
        opts = JoinOptions(server=server.transport.peer_id, task="images", data=specs[n],
                           server_addrs=server.transport.addrs(), finetune_steps=0, evaluate=False,
                           read_timeout=3600.0, secret_seed=seed)
        try:
            async with t.run([]):
                records[n] = (await run_join(homes[n], t, opts)).record
        except BaseExceptionGroup as eg:
            raise single_error(eg) from None

    async with trio.open_nursery() as nursery:
        await nursery.start(server.run, [], [])
        async with trio.open_nursery() as clients:
            for n in names:
                clients.start_soon(join, n)
        server.stop()
    return records


def base_tensors(base: MSDBase) -> dict:
    """The extractor tensors of the base (every node's file holds the same bytes)."""
    from netsim.publicbase import load_extractor

    return load_extractor(next(iter(base.files.values())), "MSD base")
