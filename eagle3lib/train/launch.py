"""Where stage 05 trains: in this process, or in `torchrun` processes (speculators' DDP) when
train.nproc_per_node > 1; and `main`, the entry those processes (and `python -m eagle3lib.train`) run.

Why the notebook launches torchrun with `--no-manifest`: the notebook (or `run(stage)`) writes manifests/05 itself
from rank 0's draft/result.json; run by hand, the torchrun entry is the stage's notebook and writes it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from eagle3lib.common.config import REPO_ROOT, load_run_config
from eagle3lib.common.rundir import RunDir, StageRun, open_stage, run_root
from eagle3lib.train.checkpoint import draft_dir
from eagle3lib.train.loop import train
from eagle3lib.train.result import summarize
from eagle3lib.train.settings import Resolved


def launch_command(config: str, run: str | None, overrides: list[str], nproc: int) -> list[str]:
    """The torchrun command notebook 05 runs when train.nproc_per_node > 1."""
    cmd = ["torchrun", f"--nproc-per-node={nproc}", "-m", "eagle3lib.train", "--config", str(config)]
    if run:
        cmd += ["--run-name", run]  # not --run: torchrun reads it as an ambiguous prefix of its --run-path
    for o in overrides:
        cmd += ["-p", o]
    return cmd


def launch(rd: RunDir, config: str | Path, run: str | None, overrides: list[str], nproc: int) -> dict[str, Any]:
    """Run `launch_command` from the repo root, without its manifest, and return rank 0's draft/result.json."""
    cmd = launch_command(str(config), run, list(overrides), nproc) + ["--no-manifest"]
    print("launching:", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO_ROOT, check=True)
    return json.loads(draft_dir(rd).joinpath("result.json").read_text())


def train_or_launch(stage: StageRun, resolved: Resolved | None = None, *, progress: bool = True,
                    config: str | Path | None = None, run_name: str | None = None,
                    overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Train the draft for this stage and return the result dict: in this process (with `resolved` settings), or,
    when train.nproc_per_node > 1, under torchrun with the config as the notebook was given it (`config`, `run_name`,
    `overrides`; None: the stage's resolved config, written to a temporary file). The torchrun processes resolve
    'auto' themselves."""
    nproc = stage.cfg.train.nproc_per_node
    if nproc <= 1:
        return train(stage.rd, resolved=resolved, progress=progress)
    if config is not None:
        return launch(stage.rd, config, run_name, list(overrides), nproc)
    with tempfile.TemporaryDirectory(prefix="eagle3-train-") as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(stage.cfg.to_yaml())
        return launch(stage.rd, path, None, [], nproc)


def main(argv: list[str] | None = None) -> int:
    """`python -m eagle3lib.train` / `torchrun ... -m eagle3lib.train`: stage 05 without the notebook."""
    from eagle3lib import train as package

    p = argparse.ArgumentParser(prog="eagle3lib.train", description=package.__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--run-name", dest="run", default=None,
                   help="run name (not --run: under torchrun that is an ambiguous prefix of torchrun's --run-path)")
    p.add_argument("-p", dest="overrides", action="append", default=[])
    p.add_argument("--no-manifest", action="store_true", help="do not write manifests/05 (the notebook writes it)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    stage = None
    if int(os.environ.get("RANK", "0")) == 0:
        stage = open_stage("05", a.config, a.run, a.overrides)
        rd = stage.rd
    else:  # other torchrun ranks: same config, but no racing on open_stage's write probe in the run directory
        from eagle3lib.common import quiet

        quiet.setup()  # the logging rule open_stage sets on rank 0 (their output reaches the same notebook)
        cfg = load_run_config(a.config, a.run, a.overrides)
        rd = RunDir(run_root(cfg), cfg)
    result = train(rd)
    from speculators.train.distributed import maybe_destroy_distributed

    if result and not a.no_manifest and stage is not None:
        stage.finish(summarize(rd, result))
    maybe_destroy_distributed()
    return 0
