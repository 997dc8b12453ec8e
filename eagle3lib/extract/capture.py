"""Stage 02, part 2: the backend-neutral capture loop — hidden-state shards, the dataset table, token_freq, metrics.

A backend (`eagle3lib.extract.backends`) only turns token ids into states. Everything that must be the same whichever
backend ran lives here:
- resume: shards already on disk are checked (`shards.check_shard_file`) and kept when valid; the rest are redone;
- every shard is validated as it is written (`shards.write_shard`): a wrong shape, dtype or token id stops the run
  with the row index and what was expected — nothing invalid reaches the disk;
- writing happens on background threads behind a bounded queue, so the forward never waits for the disk;
- token_freq over the loss-masked tokens of the TRAIN rows (stage 04 builds the draft vocabulary from it);
- the dataset table (input_ids, loss_mask, seq_len; torch format, as speculators reads it) is written last.
- data parallel (transformers backend): one process per visible GPU, each capturing a token-balanced share.
- online and spool modes (`train.hidden_states`): the table and token_freq as always, but shards only for the
  `online_sample_rows` rows (recorded in the manifest as `shard_rows`); stage 05 gets the rest elsewhere
  (docs/capture.md#online-hidden-states, #spool-producer-mode). Stage 05's spool producer runs `capture_rows`
  itself, into the spool folder.

"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eagle3lib.common import atomic, shards
from eagle3lib.common.config import WorkbookConfig
from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.rundir import StageResult, StageRun
from eagle3lib.common.target import ResolvedTarget

if TYPE_CHECKING:
    from eagle3lib.extract.prepare import Prepared

ProgressFn = Callable[[int, int], None]  # (rows done, tokens done) since the last call


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


def valid_shards(dataset_dir: Path, input_ids: list[list[int]], spec: shards.ShardSpec, threads: int = 4,
                 rows: list[int] | None = None) -> set[int]:
    """Rows (of `rows`, default all) whose shard on disk is complete and right for this dataset (resume keeps them
    untouched)."""
    sdir = shards.shard_dir(dataset_dir)
    if not sdir.is_dir():
        return set()
    rows = range(len(input_ids)) if rows is None else rows
    present = {i for i in rows if shards.shard_path(dataset_dir, i).is_file()}

    def ok(i: int) -> bool:
        return not shards.check_shard_file(shards.shard_path(dataset_dir, i), input_ids[i], spec)

    with ThreadPoolExecutor(threads) as pool:
        return {i for i, good in zip(sorted(present), pool.map(ok, sorted(present)), strict=True) if good}


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


# ------------------------------------------------------------------------------------------------ capture loop
class ShardWriter:
    """Validates and writes shards on background threads; at most `depth` waiting. The first failure stops the run.
    `values_checked`: the backend's files were checked finite where they were made (see shards.adopt_shard).
    `gate`: no shard is written before this future (the capture probe's verdict) is done; its exception is the
    run's failure, and nothing waiting is written then. `gate_wait_s`: what the capture loop waited for it."""

    def __init__(self, dataset_dir: Path, input_ids: Mapping[int, list[int]], spec: shards.ShardSpec, threads: int,
                 depth: int, on_written: ProgressFn | None = None, values_checked: bool = False,
                 gate: Future | None = None):
        self.dataset_dir, self.input_ids, self.spec = dataset_dir, input_ids, spec
        self.values_checked = values_checked
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="shard-writer")
        self.slots = threading.BoundedSemaphore(depth)
        self.on_written = on_written
        self.gate = gate
        self.gate_wait_s = 0.0
        self.error: BaseException | None = None
        self.lock = threading.Lock()

    def _write(self, row: int, states: torch.Tensor | Path) -> None:
        try:
            if self.gate is not None:
                self.gate.result()  # raises the probe's failure: this write (and every other) is dropped
            ids = torch.as_tensor(self.input_ids[row], dtype=torch.int64)
            if isinstance(states, Path):  # a finished shard file from the backend: checked, then renamed
                shards.adopt_shard(self.dataset_dir, row, states, ids, self.spec, self.values_checked)
            else:
                shards.write_shard(self.dataset_dir, row, ids, states, ids, self.spec)
            if self.on_written:
                with self.lock:
                    self.on_written(1, len(ids))
        finally:
            self.slots.release()

    def submit(self, row: int, states: torch.Tensor | Path) -> None:
        self.raise_if_failed()
        if row not in self.input_ids:
            raise WorkbookError(f"the capture backend returned row {row}, which it was not asked for",
                                "this is a backend bug")
        gated = self.gate is not None and not self.gate.done()
        t0 = time.perf_counter()
        self.slots.acquire()
        if gated:
            self.gate_wait_s += time.perf_counter() - t0
        self.raise_if_failed()  # a failure seen while waiting for a slot: stop before submitting more
        fut = self.pool.submit(self._write, row, states)
        fut.add_done_callback(self._done)

    def _done(self, fut: Future) -> None:
        if not fut.cancelled() and fut.exception() is not None and self.error is None:
            self.error = fut.exception()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self, failed: bool = False) -> None:
        """Waits for the writes already running (so no temp file is still being written when an error reaches the
        user); after a failure, the ones still queued are dropped instead of written."""
        self.pool.shutdown(wait=True, cancel_futures=failed)
        if not failed:
            self.raise_if_failed()


def capture_rows(backend: Any, rows: list[tuple[int, list[int]]], dataset_dir: Path, spec: shards.ShardSpec,
                 threads: int, depth: int, on_written: ProgressFn | None = None,
                 captured: Mapping[int, torch.Tensor | Path] | None = None, gate: Future | None = None,
                 timing: dict[str, float] | None = None) -> int:
    """Run `rows` through `backend`, writing every shard; returns the number written. Every row must come back.
    `captured`: states of some of `rows` already captured (the capture probe's rows), written as they are instead of
    run again; `gate`: see ShardWriter (the capture probe's verdict); `timing` gets `gate_wait_s`."""
    captured = dict(captured or {})
    writer = ShardWriter(dataset_dir, dict(rows), spec, threads, depth, on_written,
                         values_checked=getattr(backend, "values_checked", False), gate=gate)
    seen: set[int] = set()
    ok = False
    try:
        for row, states in captured.items():
            seen.add(row)
            writer.submit(row, states)
        rest = [(r, t) for r, t in rows if r not in captured]
        if rest:
            for row, states in backend.capture(rest):
                seen.add(row)
                writer.submit(row, states)
        ok = True
    finally:
        writer.close(failed=not ok)
        if timing is not None:
            timing["gate_wait_s"] = writer.gate_wait_s
    missing = {r for r, _ in rows} - seen
    if missing:
        raise WorkbookError(f"the capture backend returned no states for {len(missing)} rows (e.g. {sorted(missing)[:5]})",
                            "this is a backend bug; rerun to resume once it is fixed")
    return len(seen)


def _dp_worker(cfg_json: str, model_dir: str, layer_ids: list[int], dataset_dir: str,
               rows: list[tuple[int, list[int]]], device: str, spec: shards.ShardSpec, queue: Any) -> None:
    """One data-parallel process: its own GPU, its own backend and writer threads, progress to the parent."""
    from eagle3lib.common.config import WorkbookConfig
    from eagle3lib.extract.backends.transformers_backend import TransformersBackend

    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        cfg = WorkbookConfig.model_validate_json(cfg_json)
        backend = TransformersBackend(cfg, Path(model_dir), layer_ids, device=device)
        queue.put(("ready", device, None))
        try:
            capture_rows(backend, rows, Path(dataset_dir), spec, cfg.extract.writer_threads, cfg.extract.write_queue,
                         on_written=lambda r, t: queue.put(("progress", r, t)))
        finally:
            backend.close()
        queue.put(("done", device, None))
    except BaseException as e:  # reported to the parent, which stops the run with it
        queue.put(("error", device, f"{e.__class__.__name__}: {e}"))


def _split_balanced(rows: list[int], input_ids: list[list[int]], n: int) -> list[list[int]]:
    """n shares with about equal tokens (longest first, each to the lightest share)."""
    shares: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for r in sorted(rows, key=lambda r: len(input_ids[r]), reverse=True):
        k = load.index(min(load))
        shares[k].append(r)
        load[k] += len(input_ids[r])
    return shares


def _capture_data_parallel(cfg: WorkbookConfig, model_dir: Path, layer_ids: list[int], dataset_dir: Path,
                           input_ids: list[list[int]], todo: list[int], devices: list[str], spec: shards.ShardSpec,
                           on_written: ProgressFn, on_ready: Callable[[str], None] | None = None) -> None:
    """One spawned process per device over balanced shares of `todo`; `on_ready(device)` once a process has its
    model loaded (benchmarks time the steady state from there)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = []
    for dev, share in zip(devices, _split_balanced(todo, input_ids, len(devices)), strict=True):
        if not share:
            continue
        p = ctx.Process(target=_dp_worker, args=(cfg.model_dump_json(), str(model_dir), layer_ids, str(dataset_dir),
                                                 [(i, input_ids[i]) for i in share], dev,
                                                 spec, queue),
                        daemon=True)
        p.start()
        procs.append(p)
    running = len(procs)
    try:
        while running:
            try:
                kind, a, b = queue.get(timeout=5)
            except Exception:  # queue.Empty: check that nobody died without a word
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise WorkbookError(f"a data-parallel capture process died (exit code {dead[0].exitcode})",
                                        "rerun to resume; lower extract.batch_tokens if it ran out of memory") from None
                continue
            if kind == "progress":
                on_written(a, b)
            elif kind == "ready":
                if on_ready is not None:
                    on_ready(a)
            elif kind == "done":
                running -= 1
            else:
                raise WorkbookError(f"capture on {a} failed: {b}", "fix the cause and rerun: valid shards are kept")
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()


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


def is_disk_full(e: BaseException) -> bool:
    """ENOSPC / EDQUOT however it arrives: an OSError from Python, or safetensors' own error, which carries no errno
    (measured on a full tmpfs: `SafetensorError: Error while serializing: I/O error: No space left on device (os
    error 28)`), or the text a data-parallel capture process sent back."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e)
    return "No space left on device" in text or "os error 28" in text or "Disk quota exceeded" in text


def disk_full_error(dataset_dir: Path, input_ids: list[list[int]], spec: shards.ShardSpec,
                    rows: list[int] | None = None) -> WorkbookError:
    """One line: how far the run got, how much more the rest needs, what is free. Every shard under its final name is
    complete (atomic writes), so the rerun keeps them. `rows`: the rows that get a shard (None = all)."""
    done = {int(p.stem.removeprefix("hs_")) for p in shards.shard_dir(dataset_dir).glob("hs_*.safetensors")
            if p.stem.removeprefix("hs_").isdigit()}
    rows = list(range(len(input_ids))) if rows is None else rows
    done &= set(rows)
    rest = [i for i in rows if i not in done]
    need = sum(len(input_ids[i]) for i in rest) * spec.bytes_per_token() + 1_000_000  # + the table, token_freq
    free = shutil.disk_usage(dataset_dir).free if dataset_dir.exists() else 0
    return WorkbookError(
        f"the disk is full: writing to {dataset_dir} failed with {len(done)} of "
        f"{len(rows)} shards written; the remaining {len(rest)} shards need about {need / 1e9:.3f} GB "
        f"({need:,} bytes), {free / 1e9:.3f} GB is free",
        f"free at least {need / 1e9:.3f} GB on that disk (or set run.output_root to a bigger one) and rerun: the shards "
        "already written are kept")


def require_disk(dataset_dir: Path, input_ids: list[list[int]], todo: list[int], spec: shards.ShardSpec) -> None:
    """Before the first shard: the rows still to extract must fit the free space (their real token count × bytes per
    token, plus the table), else one error saying how many of them fit. Nothing is written before it, and the
    replies stage 02 generated are cached, so the rerun after freeing space starts where this one stopped."""
    per_token = spec.bytes_per_token()
    margin = 1_000_000 + 16 * sum(len(r) for r in input_ids)  # the table (int64 input_ids + loss_mask), token_freq
    need = sum(len(input_ids[i]) for i in todo) * per_token + margin
    free = shutil.disk_usage(dataset_dir).free
    if need <= free:
        return
    room, fit = free - margin, 0
    for i in todo:
        room -= len(input_ids[i]) * per_token
        if room < 0:
            break
        fit += 1
    kept = len(input_ids) - len(todo)
    raise WorkbookError(
        f"the hidden states of the {len(todo)} rows still to extract need {_size(need)} and {_size(free)} is free at "
        f"{dataset_dir}: {fit} of them fit",
        f"free at least {_size(need - free)}, set run.output_root to a bigger disk, or lower data.num_samples to "
        f"about {kept + fit}; rerun (the generated replies are cached)")


def _size(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def extract(cfg: WorkbookConfig, dataset_dir: Path, model_dir: Path, layer_ids: list[int], hidden_size: int,
            input_ids: list[list[int]], loss_mask: list[list[int]], progress: bool = True,
            backend: Any | None = None, probe_dir: Path | None = None, shard_rows: list[int] | None = None
            ) -> dict[str, Any]:
    """Shards for every row (or only `shard_rows`: online and spool modes), resuming, then the table. Returns
    metrics of this call (resumed, computed, tok/s).

    `probe_dir` (stage 02 passes the run folder): the capture probe (eagle3lib.extract.probe) runs on the started
    backend before its first shard and writes its report there; a failing probe stops the run with nothing written.
    A full disk stops the run with one line saying how much more space the rest needs (`disk_full_error`)."""
    try:
        return _extract(cfg, dataset_dir, model_dir, layer_ids, hidden_size, input_ids, loss_mask, progress, backend,
                        probe_dir, shard_rows)
    except Exception as e:
        if not is_disk_full(e):
            raise
        raise disk_full_error(dataset_dir, input_ids, shard_spec(cfg, layer_ids, hidden_size), shard_rows) from None


def _extract(cfg: WorkbookConfig, dataset_dir: Path, model_dir: Path, layer_ids: list[int], hidden_size: int,
             input_ids: list[list[int]], loss_mask: list[list[int]], progress: bool = True,
             backend: Any | None = None, probe_dir: Path | None = None, shard_rows: list[int] | None = None
             ) -> dict[str, Any]:
    from tqdm.auto import tqdm

    spec = shard_spec(cfg, layer_ids, hidden_size)
    sdir = shards.shard_dir(dataset_dir)
    sdir.mkdir(parents=True, exist_ok=True)
    atomic.remove_stale_temps(sdir)
    atomic.remove_stale_temps(dataset_dir)
    for p in sdir.glob("hs_*.safetensors"):  # shards of rows beyond this dataset (an earlier, larger run)
        idx = p.stem.removeprefix("hs_")
        if not idx.isdigit() or int(idx) >= len(input_ids):
            p.unlink()
    rows = list(range(len(input_ids))) if shard_rows is None else list(shard_rows)
    # online, spool: shards of other rows (an earlier offline run) are left as they are, neither checked nor counted
    keep = valid_shards(dataset_dir, input_ids, spec, cfg.extract.writer_threads, rows)
    todo = [i for i in rows if i not in keep]
    todo_tokens = sum(len(input_ids[i]) for i in todo)
    if todo:
        if spec.fp8:
            shards.require_fp8_reader()
        require_disk(dataset_dir, input_ids, todo, spec)
    metrics: dict[str, Any] = {"resumed_shards": len(keep), "computed_shards": len(todo), "computed_tokens": todo_tokens,
                               "tokens_per_s": None, "load_seconds": 0.0, "capture_seconds": 0.0}
    if todo:
        bar = tqdm(total=len(rows), initial=len(keep), desc="extract", unit="sample", disable=not progress)
        state = {"tokens": 0, "t0": 0.0}

        def on_written(rows: int, tokens: int) -> None:
            state["tokens"] += tokens
            bar.update(rows)
            el = time.time() - state["t0"]
            bar.set_postfix_str(f"{state['tokens'] / max(el, 1e-9):,.0f} tok/s")

        t_load = time.time()
        from eagle3lib.extract import probe as capture_probe

        def start_probe(on: Any, keep: list[int]) -> capture_probe.Pending | None:
            if probe_dir is None:
                return None
            return capture_probe.start(cfg, on, model_dir, layer_ids, hidden_size, input_ids, probe_dir,
                                       capture_probe.compute_dtype(cfg, on), progress, keep=keep)

        def record_probe(pending: capture_probe.Pending, waited_s: float) -> None:
            report = pending.verdict.result()  # the probe's WorkbookError, if it failed
            metrics["probe"] = {"passed": report["passed"], "seconds": report["seconds"],
                                "blocking_seconds": round(pending.blocking_s + waited_s, 3),
                                "gate_wait_seconds": round(waited_s, 3),
                                "phase_seconds": report["phase_seconds"], "kept_rows": len(pending.kept),
                                "summary": capture_probe.summary_line(report)}

        computed_tokens, blocked = todo_tokens, 0.0
        try:
            devices = _dp_devices(cfg, model_dir, backend)
            if devices:
                if probe_dir is not None:  # one more load, on the first GPU, before the processes start
                    from eagle3lib.extract.backends.transformers_backend import TransformersBackend

                    probing = TransformersBackend(cfg, model_dir, layer_ids, device=devices[0])
                    try:
                        pending = start_probe(probing, [])
                    finally:
                        probing.close()
                    record_probe(pending, 0.0)  # the processes write shards at once: the verdict first
                state["t0"] = time.time()
                _capture_data_parallel(cfg, model_dir, layer_ids, dataset_dir, input_ids, todo, devices, spec,
                                       on_written)
            else:
                own = backend is None
                if own:
                    from eagle3lib.extract.backends import make_backend

                    backend = make_backend(cfg, model_dir, layer_ids)
                metrics["load_seconds"] = round(time.time() - t_load, 2)
                try:
                    # the probe's rows become their shards (captured once) and its judging runs beside the
                    # extraction: no shard is written before its verdict (the writer's gate)
                    pending = start_probe(backend, todo)
                    kept = pending.kept if pending is not None else {}
                    blocked = pending.blocking_s if pending is not None else 0.0
                    computed_tokens -= sum(len(input_ids[i]) for i in kept)
                    timing: dict[str, float] = {}
                    state["t0"] = time.time()
                    capture_rows(backend, [(i, input_ids[i]) for i in todo], dataset_dir, spec,
                                 cfg.extract.writer_threads, cfg.extract.write_queue, on_written, captured=kept,
                                 gate=pending.verdict if pending is not None else None, timing=timing)
                    if pending is not None:
                        record_probe(pending, timing["gate_wait_s"])
                finally:
                    if own:
                        backend.close()
        finally:
            bar.close()
        secs = time.time() - state["t0"]
        # capture_seconds and tokens_per_s: the capture loop (after the probe's blocking part; the rows the probe
        # captured for it are not in it); end_to_end_tokens_per_s: every computed row over the probe's blocking part
        # and the loop together
        metrics["capture_seconds"] = round(secs, 2)
        metrics["tokens_per_s"] = round(computed_tokens / secs, 1) if secs > 0 else None
        metrics["end_to_end_tokens_per_s"] = round(todo_tokens / (secs + blocked), 1) if secs + blocked > 0 else None
    save_table(dataset_dir, input_ids, loss_mask)
    return metrics


def _dp_devices(cfg: WorkbookConfig, model_dir: Path, backend: Any | None) -> list[str] | None:
    """The GPUs to run one process each on, or None for a single in-process backend."""
    if backend is not None or cfg.extract.backend != "transformers":
        return None
    from eagle3lib.common.device import resolve_devices, torch_dtype
    from eagle3lib.extract.backends.transformers_backend import needs_device_map

    devices = resolve_devices(cfg.extract.devices)
    if len(devices) < 2 or not all(d.startswith("cuda") for d in devices):
        return None
    if needs_device_map(model_dir, devices, torch_dtype(cfg.target.dtype, devices[0])):
        return None  # one process spreads the model over the GPUs
    return devices


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
