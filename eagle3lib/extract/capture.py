"""Stage 02, part 2: the backend-neutral capture: hidden-state shards, the dataset table, token_freq, metrics.

A backend (`eagle3lib.extract.backends`) only turns token ids into states. Everything that must be the same whichever
backend ran lives here and beside it:
- resume, validation and writing on background threads: `shard_writer`; one process per GPU: `data_parallel`;
  the space check before the first shard and the error when the disk fills: `disk`;
- token_freq over the loss-masked tokens of the TRAIN rows (stage 04 builds the draft vocabulary from it);
- the dataset table (input_ids, loss_mask, seq_len; torch format, as speculators reads it) is written last;
- online and spool modes (`train.hidden_states`): the table and token_freq as always, but shards only for the
  `online_sample_rows` rows (recorded in the manifest as `shard_rows`); stage 05 gets the rest elsewhere
  (docs/capture.md#online-hidden-states, #spool-producer-mode).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eagle3lib.common import atomic, shards
from eagle3lib.common.config import WorkbookConfig
from eagle3lib.common.rundir import StageResult, StageRun
from eagle3lib.common.target import ResolvedTarget
from eagle3lib.extract import data_parallel, disk, shard_writer
from eagle3lib.extract.shard_writer import ProgressFn

if TYPE_CHECKING:
    from eagle3lib.extract.prepare import Prepared


# ----------------------------------------------------------------------------------------------------- helpers
def shard_spec(cfg: WorkbookConfig, layer_ids: list[int], hidden_size: int) -> shards.ShardSpec:
    return shards.ShardSpec(len(layer_ids), hidden_size, shards.DTYPES[cfg.extract.dtype], cfg.extract.fp8_shards)


def online_sample_rows(n_train: int, n_val: int, k: int) -> list[int]:
    """The rows stage 02 writes shards for in online mode: the first rows of the train split and the first of the
    validation split, k in all, in proportion to the split (at least one validation row when there is one), so
    stage 03 sees both splits and stage 06's offline method has validation rows. Every row when k covers them."""
    if k >= n_train + n_val:
        return list(range(n_train + n_val))
    k_val = min(n_val, max(1 if n_val else 0, round(k * n_val / (n_train + n_val))))
    k_train = min(n_train, k - k_val)
    return list(range(k_train)) + list(range(n_train, n_train + k_val))


def token_freq(input_ids: list[list[int]], loss_mask: list[list[int]], n_train: int) -> dict[int, int]:
    """{token id: count} over loss-masked tokens of the first n_train rows (the train rows)."""
    freq: dict[int, int] = {}
    for ids, mask in zip(input_ids[:n_train], loss_mask[:n_train], strict=True):
        for t, m in zip(ids, mask, strict=True):
            if m:
                freq[t] = freq.get(t, 0) + 1
    return freq


def save_table(dataset_dir: Path, input_ids: list[list[int]], loss_mask: list[list[int]]) -> None:
    """The dataset table in the folder that already holds hidden_states/, written aside and moved in file by file.

    Why not `atomic_dir` over the whole folder: the shards live inside it and must not move. The table's files are
    renamed in last (state.json, which `load_from_disk` reads first, at the very end); the manifest, written after
    this, is what marks the stage complete.
    """
    from datasets import Dataset, Features, Sequence, Value

    features = Features({"input_ids": Sequence(Value("int64")), "loss_mask": Sequence(Value("int64")),
                         "seq_len": Value("int64")})
    ds = Dataset.from_dict({"input_ids": input_ids, "loss_mask": loss_mask,
                            "seq_len": [len(r) for r in input_ids]}, features=features)
    ds.set_format("torch")
    dataset_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".table.", suffix=".tmp", dir=dataset_dir))
    try:
        ds.save_to_disk(str(tmp))
        new = sorted(p.name for p in tmp.iterdir())
        for old in dataset_dir.iterdir():
            if old.is_file() and (old.suffix == ".arrow" or old.name in ("dataset_info.json", "state.json")) \
                    and old.name not in new:
                old.unlink()
        for name in sorted(new, key=lambda n: n == "state.json"):
            os.replace(tmp / name, dataset_dir / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -------------------------------------------------------------------------------------------------- the stage
def shard_rows_for(cfg: WorkbookConfig, n_train: int, n_val: int) -> list[int] | None:
    """The rows stage 02 writes shards for: None = every row (offline), else the sample rows (online, spool)."""
    if shards.sample_shards_only(cfg.train.hidden_states):
        return online_sample_rows(n_train, n_val, cfg.extract.online_sample_rows)
    return None


def plan(cfg: WorkbookConfig, prepared: Prepared, target: ResolvedTarget) -> dict[str, Any]:
    """What the extraction will do: samples, tokens and the disk it will take (online, spool: the sample rows' only)."""
    layer_ids = target.layer_ids
    spec = shard_spec(cfg, layer_ids, target.info.hidden_size)
    tokens = prepared.tokens
    rows = shard_rows_for(cfg, prepared.n_train, prepared.n_val)
    on_disk = tokens if rows is None else sum(len(prepared.input_ids[i]) for i in rows)
    return {"samples": len(prepared), "train_rows": prepared.n_train, "val_rows": prepared.n_val,
            "tokens": tokens, "loss_tokens": sum(sum(m) for m in prepared.loss_mask),
            "mean_len": round(tokens / max(1, len(prepared)), 1), "layer_ids": layer_ids,
            "hidden_states": cfg.train.hidden_states, "shards_written": len(prepared) if rows is None else len(rows),
            "bytes_per_token": spec.bytes_per_token(), "disk_bytes": on_disk * spec.bytes_per_token(),
            "disk_gb": round(on_disk * spec.bytes_per_token() / 1e9, 3), "backend": cfg.extract.backend,
            "dtype": cfg.extract.dtype, "shards": "FP8 (e4m3 + a per-token scale)" if spec.fp8 else cfg.extract.dtype}


def extract(cfg: WorkbookConfig, dataset_dir: Path, model_dir: Path, layer_ids: list[int], hidden_size: int,
            input_ids: list[list[int]], loss_mask: list[list[int]], progress: bool = True,
            backend: Any | None = None, probe_dir: Path | None = None, shard_rows: list[int] | None = None
            ) -> dict[str, Any]:
    """Shards for every row (or only `shard_rows`: online and spool modes), resuming, then the table. Returns
    metrics of this call (resumed, computed, tok/s).

    `probe_dir` (stage 02 passes the run folder): the capture probe (eagle3lib.extract.probe) runs on the started
    backend before its first shard and writes its report there; a failing probe stops the run with nothing written.
    A full disk stops the run with one line saying how much more space the rest needs (`disk.disk_full_error`)."""
    job = _Extraction(cfg, dataset_dir, model_dir, layer_ids, hidden_size, input_ids, progress, probe_dir,
                      shard_spec(cfg, layer_ids, hidden_size))
    try:
        rows = list(range(len(input_ids))) if shard_rows is None else list(shard_rows)
        metrics = job.run(rows, backend)
        save_table(dataset_dir, input_ids, loss_mask)
        return metrics
    except Exception as e:
        if not disk.is_disk_full(e):
            raise
        raise disk.disk_full_error(dataset_dir, input_ids, job.spec, shard_rows) from None


@dataclass
class _Extraction:
    """One `extract` call: the shards still missing, captured in this process or one process per GPU."""

    cfg: WorkbookConfig
    dataset_dir: Path
    model_dir: Path
    layer_ids: list[int]
    hidden_size: int
    input_ids: list[list[int]]
    progress: bool
    probe_dir: Path | None
    spec: shards.ShardSpec
    metrics: dict[str, Any] = field(default_factory=dict)

    def tokens(self, rows: Iterable[int]) -> int:
        return sum(len(self.input_ids[i]) for i in rows)

    def run(self, rows: list[int], backend: Any | None) -> dict[str, Any]:
        """Keeps the valid shards among `rows`, captures the rest; the metrics of the capture."""
        self.clean_folder()
        # online, spool: shards of other rows (an earlier offline run) are left as they are, neither checked nor counted
        keep = shard_writer.valid_shards(self.dataset_dir, self.input_ids, self.spec, self.cfg.extract.writer_threads,
                                         rows)
        todo = [i for i in rows if i not in keep]
        self.metrics.update({"resumed_shards": len(keep), "computed_shards": len(todo),
                             "computed_tokens": self.tokens(todo), "tokens_per_s": None, "load_seconds": 0.0,
                             "capture_seconds": 0.0})
        if todo:
            if self.spec.fp8:
                shards.require_fp8_reader()
            disk.require_disk(self.dataset_dir, self.input_ids, todo, self.spec)
            self.capture(todo, len(rows), len(keep), backend)
        return self.metrics

    def clean_folder(self) -> None:
        """Temp files of a killed run, and shards of rows beyond this dataset (an earlier, larger run), go."""
        sdir = shards.shard_dir(self.dataset_dir)
        sdir.mkdir(parents=True, exist_ok=True)
        atomic.remove_stale_temps(sdir)
        atomic.remove_stale_temps(self.dataset_dir)
        for p in sdir.glob("hs_*.safetensors"):
            idx = p.stem.removeprefix("hs_")
            if not idx.isdigit() or int(idx) >= len(self.input_ids):
                p.unlink()

    def capture(self, todo: list[int], total: int, kept: int, backend: Any | None) -> None:
        """The rows in `todo`, with a progress bar over all the rows (`kept` of `total` already there); the capture's
        speed into the metrics."""
        from tqdm.auto import tqdm

        bar = tqdm(total=total, initial=kept, desc="extract", unit="sample", disable=not self.progress)
        state = {"tokens": 0, "t0": time.time()}

        def on_written(rows: int, tokens: int) -> None:
            state["tokens"] += tokens
            bar.update(rows)
            bar.set_postfix_str(f"{state['tokens'] / max(time.time() - state['t0'], 1e-9):,.0f} tok/s")

        try:
            devices = data_parallel.devices_for(self.cfg, self.model_dir, backend)
            if devices:
                computed, blocked = self.on_gpus(todo, devices, on_written, state), 0.0
            else:
                computed, blocked = self.in_process(todo, backend, on_written, state)
        finally:
            bar.close()
        secs = time.time() - state["t0"]
        # capture_seconds and tokens_per_s: the capture loop (after the probe's blocking part; the rows the probe
        # captured for it are not in it); end_to_end_tokens_per_s: every computed row over the probe's blocking part
        # and the loop together
        self.metrics["capture_seconds"] = round(secs, 2)
        self.metrics["tokens_per_s"] = round(computed / secs, 1) if secs > 0 else None
        self.metrics["end_to_end_tokens_per_s"] = \
            round(self.tokens(todo) / (secs + blocked), 1) if secs + blocked > 0 else None

    def on_gpus(self, todo: list[int], devices: list[str], on_written: ProgressFn, state: dict[str, float]) -> int:
        """One process per GPU; the probe first, on a backend of its own on the first GPU (the processes write
        shards at once, so the verdict comes before them). Returns the tokens computed."""
        if self.probe_dir is not None:
            from eagle3lib.extract.backends.transformers_backend import TransformersBackend

            probing = TransformersBackend(self.cfg, self.model_dir, self.layer_ids, device=devices[0])
            try:
                pending = self.start_probe(probing, [])
            finally:
                probing.close()
            self.record_probe(pending, 0.0)
        state["t0"] = time.time()
        data_parallel.capture_data_parallel(self.cfg, self.model_dir, self.layer_ids, self.dataset_dir,
                                            self.input_ids, todo, devices, self.spec, on_written)
        return self.tokens(todo)

    def in_process(self, todo: list[int], backend: Any | None, on_written: ProgressFn, state: dict[str, float]
                   ) -> tuple[int, float]:
        """The given backend, or one made here: the probe's rows become their shards (captured once) and its judging
        runs beside the extraction, no shard written before its verdict (the writer's gate). Returns the tokens
        computed in the loop and the probe's blocking seconds."""
        own = backend is None
        if own:
            from eagle3lib.extract.backends import make_backend

            backend = make_backend(self.cfg, self.model_dir, self.layer_ids)
        self.metrics["load_seconds"] = round(time.time() - state["t0"], 2)
        try:
            pending = self.start_probe(backend, todo)
            kept = pending.kept if pending is not None else {}
            timing: dict[str, float] = {}
            state["t0"] = time.time()
            shard_writer.capture_rows(backend, [(i, self.input_ids[i]) for i in todo], self.dataset_dir, self.spec,
                                      self.cfg.extract.writer_threads, self.cfg.extract.write_queue, on_written,
                                      captured=kept, gate=pending.verdict if pending is not None else None,
                                      timing=timing)
            if pending is not None:
                self.record_probe(pending, timing["gate_wait_s"])
        finally:
            if own:
                backend.close()
        return self.tokens(todo) - self.tokens(kept), pending.blocking_s if pending is not None else 0.0

    def start_probe(self, on: Any, keep: list[int]) -> Any:
        if self.probe_dir is None:
            return None
        from eagle3lib.extract import probe

        return probe.start(self.cfg, on, self.model_dir, self.layer_ids, self.hidden_size, self.input_ids,
                           self.probe_dir, probe.compute_dtype(self.cfg, on), self.progress, keep=keep)

    def record_probe(self, pending: Any, waited_s: float) -> None:
        from eagle3lib.extract import probe

        report = pending.verdict.result()  # the probe's WorkbookError, if it failed
        self.metrics["probe"] = {"passed": report["passed"], "seconds": report["seconds"],
                                 "blocking_seconds": round(pending.blocking_s + waited_s, 3),
                                 "gate_wait_seconds": round(waited_s, 3), "phase_seconds": report["phase_seconds"],
                                 "kept_rows": len(pending.kept), "summary": probe.summary_line(report)}


def capture_dataset(stage: StageRun, target: ResolvedTarget, prepared: Prepared, the_plan: dict[str, Any],
                    progress: bool = True, backend: Any | None = None) -> StageResult:
    """Extraction + token_freq for prepared rows: stage 02's outputs and metrics, for its manifest."""
    cfg, rd = stage.cfg, stage.rd
    model_dir, info, layer_ids = target.model_dir, target.info, target.layer_ids
    dataset_dir = rd.path("dataset")
    t0 = time.time()
    from eagle3lib.extract.probe import REPORT_FILE

    probe_file = rd.path(REPORT_FILE)
    if cfg.extract.probe == "never":
        probe_file.unlink(missing_ok=True)  # an earlier run's report does not describe this capture
    rows = shard_rows_for(cfg, prepared.n_train, prepared.n_val)
    ext = extract(cfg, dataset_dir, model_dir, layer_ids, info.hidden_size, prepared.input_ids, prepared.loss_mask,
                  progress=progress, backend=backend, probe_dir=None if cfg.extract.probe == "never" else rd.root,
                  shard_rows=rows)
    freq = token_freq(prepared.input_ids, prepared.loss_mask, prepared.n_train)
    with atomic.atomic_path(rd.path("token_freq.pt"), suffix=".pt") as tmp:
        torch.save(freq, tmp)
    n_bytes = sum(shards.shard_path(dataset_dir, i).stat().st_size
                  for i in (range(len(prepared.input_ids)) if rows is None else rows))
    metrics = {
        "samples": len(prepared), "train_rows": prepared.n_train, "val_rows": prepared.n_val,
        "train_ratio": shards.train_ratio(prepared.n_train, prepared.n_val),
        "tokens": prepared.tokens, "loss_tokens": the_plan["loss_tokens"], "bytes": n_bytes,
        "layer_ids": layer_ids, "hidden_size": info.hidden_size, "num_layers": info.num_layers,
        "vocab_size": info.vocab_size, "dtype": cfg.extract.dtype, "fp8_shards": cfg.extract.fp8_shards, "backend": cfg.extract.backend,
        "hidden_states": cfg.train.hidden_states,
        "tokens_per_s": ext["tokens_per_s"], "extract": ext, "extract_seconds": round(time.time() - t0, 2),
        "eval_prompts": len(prepared.eval_prompts), "distinct_loss_tokens": len(freq),
        "split": {"eval": len(prepared.eval_prompts), "train": prepared.n_train, "val": prepared.n_val,
                  "seed": cfg.run.seed, "val_fraction": cfg.data.val_fraction},
        "data": prepared.stats,
    }
    if rows is not None:  # online, spool: the only rows with a shard (shards.shard_rows reads this)
        metrics["shard_rows"] = rows
    outputs = {"dataset": dataset_dir, "token_freq": rd.path("token_freq.pt"),
               "train_conversations": rd.path("data", "train.jsonl"), "eval_prompts": rd.path("data", "eval.jsonl"),
               "model_dir": str(model_dir)}
    if probe_file.is_file():
        outputs["capture_probe"] = probe_file
    benchmarks = getattr(prepared, "benchmarks", {})  # evaluate.benchmarks: stage 06 reads their prompts from here
    outputs.update({f"benchmark_{name}": b["path"] for name, b in benchmarks.items()})
    metrics["benchmarks"] = {name: {k: v for k, v in b.items() if k != "path"} for name, b in benchmarks.items()}
    return StageResult(outputs, metrics)
