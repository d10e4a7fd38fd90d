"""Rebuild a scenario's shipped W_p (`[public] file`) from its recipe and check it.

The designated client's training of `netsim.publicbase.build_public_base` (what a run does
when the scenario ships no file): the scenario's [model] and [train] recipe at [public]
epochs / lr on the pool `[public] spec`, seeded by the scenario's seed, one torch thread.
Prints one JSON object: the rebuilt file's SHA-256 against the scenario's `[public] sha256`
(`match`), W_p's accuracy on the pool's test split and the build's wall / CPU seconds.
`--write` copies the rebuilt file over the shipped one (then set `[public] sha256` to the
printed hash). Bit-identical rebuilds need the same torch build and CPU kind; a mismatch
elsewhere says so and changes nothing.

    nice -n 10 python bench/public_base_build.py netsim/scenarios/demo.toml
    nice -n 10 python bench/public_base_build.py netsim/scenarios/demo.toml --write
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario", help="a scenario TOML (or a shipped scenario's name) with [public] file")
    ap.add_argument("--write", action="store_true", help="copy the rebuilt file over the scenario's [public] file")
    args = ap.parse_args()

    import torch

    from netsim.publicbase import build_public_base
    from netsim.scenario import load_scenario, shipped_scenario

    torch.set_num_threads(1)
    path = Path(args.scenario)
    scn = load_scenario(path if path.suffix == ".toml" else shipped_scenario(args.scenario))
    if not scn.public.file:
        ap.error(f"{scn.source} ships no W_p ([public] file is unset)")
    t0, c0 = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory() as tmp:
        f, info = build_public_base(scn, Path(tmp), progress=lambda m: print(m, file=sys.stderr, flush=True))
        out = {"scenario": scn.source, "file": scn.public.file, "sha256": info["sha256"],
               "expected": scn.public.sha256, "match": info["sha256"] == scn.public.sha256,
               "bytes": info["bytes"], "pool_train_images": info["pool_train_images"],
               "pool_test_accuracy": info["pool_test_accuracy"], "epochs": scn.public.epochs, "lr": scn.public.lr,
               "wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(time.process_time() - c0, 1)}
        if args.write:
            shutil.copyfile(f, scn.public.file)
            out["written"] = scn.public.file
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
