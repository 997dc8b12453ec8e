"""The spool producer (`train.hidden_states: spool`): the process that computes the hidden states the trainer asks
for, with stage 02's own capture, into the spool folder (docs/capture.md#spool-producer-mode).

Why a process of its own: a target only vLLM can hold (tensor parallel over several GPUs) cannot live inside the
training process the way online mode's target does, and a vLLM engine belongs in a child the notebook kernel can
stop (eagle3lib.common.processes). Why stage 02's code: `capture_rows` with the configured extract backend (vLLM native or
the capture worker, with its parallel sizes; or transformers) validates every shard as it writes it, so the spool
holds exactly what stage 02 would have written for those rows.

The protocol, all of it files in the spool folder (eagle3lib.train.spool decides what is asked for):
    requests/<seq>.json       {"rows": [dataset rows]}, seq = 0, 1, 2, ... written atomically by the trainer;
                              taken in that order, each captured once
    hidden_states/hs_<row>.safetensors   what capture_rows writes (the trainer reads and deletes it)
    producer.json             this process's status after each request: capture seconds, tokens, idle seconds,
                              the largest size the shards folder had after any write (result.json reports it)
The producer only ever writes rows it was asked for: that, and the trainer asking only for what fits
train.spool_bytes, is what keeps the folder within the budget.

Both sides are here: `ProducerProcess` is the trainer's handle (start, check alive, stop with everything under it),
`main` the process (`python -m eagle3lib.train.spool_producer JOB.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from eagle3lib.common import atomic
from eagle3lib.common.errors import WorkbookError

POLL_S = 0.005  # how often each side looks for the other's next file


def request_path(root: Path, seq: int) -> Path:
    return Path(root) / "requests" / f"{seq:09d}.json"


def status_path(root: Path) -> Path:
    return Path(root) / "producer.json"


def folder_bytes(folder: Path) -> int:
    """The bytes of the files in `folder` now (a file deleted while we look is not counted)."""
    total = 0
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return 0
    for e in entries:
        try:
            total += e.stat().st_size
        except FileNotFoundError:
            pass
    return total


def read_status(root: Path) -> dict[str, Any]:
    try:
        return json.loads(status_path(root).read_text())
    except (OSError, ValueError):
        return {}


# ------------------------------------------------------------------------------------------- the trainer's side
class ProducerProcess:
    """The running producer, from the trainer: `check` raises one error with the last lines of its log once it has
    exited; `stop` ends it and every process under it (a vLLM engine core, tensor-parallel workers)."""

    BELOW_EVERY_S = 5.0  # how often `check` notes the processes under the producer (for `stop`, if it dies first)

    def __init__(self, proc: subprocess.Popen, root: Path, log_path: Path):
        self.proc, self.root, self.log_path = proc, Path(root), log_path
        self.below: list[Any] = []
        self._below_at = 0.0
        self._ready = False

    @classmethod
    def start(cls, job: dict[str, Any], root: Path, log_path: Path) -> ProducerProcess:
        """`python -m eagle3lib.train.spool_producer` on `job` (config, target, layer ids, dataset, spool folder),
        its output in `log_path`; it dies with this process (eagle3lib.common.processes.popen_with_parent)."""
        from eagle3lib.common.processes import popen_with_parent

        job_path = atomic.write_json(Path(root) / "producer_job.json", {**job, "parent_pid": os.getpid()})
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as log:
            proc = popen_with_parent([sys.executable, "-m", "eagle3lib.train.spool_producer", str(job_path)],
                                     stdout=log, stderr=subprocess.STDOUT)
        return cls(proc, root, log_path)

    def ready(self) -> bool:
        """Its backend is up (its first status is written once the engine has started)."""
        self._ready = self._ready or status_path(self.root).is_file()
        return self._ready

    def check(self) -> None:
        if self.proc.poll() is None:
            if time.monotonic() - self._below_at > self.BELOW_EVERY_S:
                from eagle3lib.common.processes import descendants

                self.below, self._below_at = descendants(self.proc) or self.below, time.monotonic()
            return
        from eagle3lib.common.processes import log_tail

        raise WorkbookError(
            f"the spool producer exited (code {self.proc.returncode}) while the trainer waited for its hidden states; "
            f"last lines of {self.log_path}:\n{log_tail(self.log_path)}",
            "read the producer's log: a target the extract backend cannot load, memory (extract.batch_tokens, "
            "extract.gpu_memory_utilization), or states stage 02's validator refused; rerun to resume from the last "
            "checkpoint")

    def stop(self) -> None:
        from eagle3lib.common.processes import stop_process_tree

        stop_process_tree(self.proc, known=self.below)


# ------------------------------------------------------------------------------------------ the producer's side
def produce(job: dict[str, Any]) -> None:
    """Capture each request in order until the trainer stops this process (SIGTERM) or is gone."""
    from datasets import load_from_disk

    from eagle3lib.common import shards
    from eagle3lib.common.config import WorkbookConfig
    from eagle3lib.extract.backends import make_backend
    from eagle3lib.extract.capture import shard_spec
    from eagle3lib.extract.shard_writer import capture_rows

    cfg = WorkbookConfig.model_validate_json(job["cfg"])
    root, layer_ids = Path(job["spool"]), list(job["layer_ids"])
    spec = shard_spec(cfg, layer_ids, int(job["hidden_size"]))
    if spec.fp8:
        shards.require_fp8_reader()
    table = load_from_disk(job["dataset"]).with_format(None)
    sdir = shards.shard_dir(root)
    status: dict[str, Any] = {"pid": os.getpid(), "engine_start_s": None, "requests": 0, "rows": 0, "tokens": 0,
                              "capture_s": 0.0, "idle_s": 0.0, "peak_bytes": 0}

    def on_written(_rows: int, _tokens: int) -> None:  # after each shard: the folder is at a local maximum
        status["peak_bytes"] = max(status["peak_bytes"], folder_bytes(sdir))

    t0 = time.perf_counter()
    backend = make_backend(cfg, Path(job["model_dir"]), layer_ids)
    try:
        status["engine_start_s"] = round(time.perf_counter() - t0, 2)
        atomic.write_json(status_path(root), status)
        print(f"spool producer ready: {cfg.extract.backend} backend in {status['engine_start_s']} s", flush=True)
        seq = 0
        while True:
            t = time.perf_counter()
            request = next_request(root, seq, job["parent_pid"])
            status["idle_s"] += time.perf_counter() - t
            if request is None:
                return
            rows = [int(r) for r in json.loads(request.read_text())["rows"]]
            todo = list(zip(rows, table[rows]["input_ids"], strict=True))
            t = time.perf_counter()
            capture_rows(backend, todo, root, spec, cfg.extract.writer_threads, cfg.extract.write_queue, on_written)
            status["capture_s"] += time.perf_counter() - t
            status["requests"] += 1
            status["rows"] += len(rows)
            status["tokens"] += sum(len(ids) for _, ids in todo)
            atomic.write_json(status_path(root), {**status, "capture_s": round(status["capture_s"], 3),
                                                  "idle_s": round(status["idle_s"], 3)})
            seq += 1
    finally:
        backend.close()


def next_request(root: Path, seq: int, parent_pid: int) -> Path | None:
    """Request `seq` once the trainer has written it; None when the trainer is gone (where the kernel's
    PR_SET_PDEATHSIG did not already stop this process)."""
    path = request_path(root, seq)
    while not path.is_file():
        if os.getppid() != parent_pid:
            return None
        time.sleep(POLL_S)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="eagle3lib.train.spool_producer", description=__doc__.splitlines()[0])
    p.add_argument("job", help="the job file the trainer wrote (ProducerProcess.start)")
    a = p.parse_args(argv)

    def stop(signum: int, _frame: object) -> None:  # the trainer's stop: leave through `finally` (the engine closes)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    produce(json.loads(Path(a.job).read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
