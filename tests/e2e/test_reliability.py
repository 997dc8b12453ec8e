"""Reliability and safety: faults really caused, and untrusted files.

What is tested where (so nothing is duplicated):
- extraction SIGKILLed mid-run, then rerun: tests/unit/test_capture.py::test_sigkill_mid_run_then_rerun_...
- a vLLM engine dying in a worker reaches the user with its real text: tests/unit/test_vllm_backends.py
- shards truncated / empty / NaN / shifted / wrong dtype / wrong shape, caught by stage 03: tests/unit/test_inspect.py
- stage 02's resume redoes invalid shards: tests/unit/test_capture.py::test_resume_keeps_valid_shards_and_redoes_broken_ones
- config: unknown keys, wrong types, layer ids out of range / not increasing: tests/unit/test_foundation.py; the
  remaining bad-config cases and property-based tests of the data reader: tests/e2e/test_bad_input.py
This file adds: training SIGKILLed mid-epoch then resumed (same steps as an uninterrupted run), a full disk during
extraction, corrupt shards met by stage 05, and the untrusted-files rules (nothing unpickled, no remote code by
default, servers on loopback, a headless run's kernel shut down by SIGTERM).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_run

from eagle3lib import train
from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.rundir import REPO_ROOT, RunDir, StageRun
from eagle3lib.common.stages import get_stage

# ---------------------------------------------------------------------------------------------------------------------
# Training killed mid-epoch, then resumed
# ---------------------------------------------------------------------------------------------------------------------

TRAIN = {"epochs": 3, "packing_length": 128, "lr": 3e-3, "scheduler": "cosine", "warmup_steps": 2}

# The child trains a run, and when epoch 1 asks for its second batch (checkpoint 0 is on disk, one optimizer step of
# epoch 1 is done and not saved) it says so in a marker file and waits: the parent then SIGKILLs it there. The wait is
# in OUR loader class (eagle3lib.train), so the kill lands at the same step every time without a timed race.
CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import eagle3lib.train as T
    from eagle3lib.common.config import load_config
    from eagle3lib.common.rundir import RunDir

    config, root, marker = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    base = T.loader._counting_loader_class

    def stalling():
        cls = base()

        class Stalling(cls):
            def __iter__(self):
                for i, batch in enumerate(super().__iter__()):
                    if self.dataset.start_file_idx == 0 and self.batch_sampler.epoch == 1 and i == 1:
                        marker.write_text("epoch 1, step 2")
                        time.sleep(600)
                    yield batch
        return Stalling

    T.loader._counting_loader_class = stalling
    T.train(RunDir(root, load_config(config)), progress=False)
    print("the child was not killed", file=sys.stderr)
    sys.exit(3)
""")


def _stage04(cfg, rd) -> None:
    from eagle3lib import verifier

    stage = StageRun(get_stage("04"), cfg, rd)
    stage.finish(verifier.run(stage, check_speculators=False))


def _with_train(cfg, **updates):
    return cfg.model_copy(update={"train": cfg.train.model_copy(update=updates)})


@pytest.fixture(params=["offline", "online", "spool"])
def two_identical_runs(request, tmp_path, tiny_llama_dir):
    """Two run directories with identical stage 02 + 04 outputs (one built, then copied); offline (shards),
    online (train.hidden_states: online, eagle3lib.train.online: the target runs in the training process, so the
    killed process takes its target with it and the resumed one loads its own) and spool (eagle3lib.train.spool: the
    killed process's producer is stopped by the kernel, PR_SET_PDEATHSIG, and the resumed run empties the spool
    folder and starts its own)."""
    import shutil

    root = tmp_path / "whole"
    root.mkdir()
    cfg, rd = make_tiny_run(root, tiny_llama_dir, run="tiny", n_train=12, n_val=4,
                            hidden_states=request.param, overrides=("extract.online_sample_rows=4",))
    _stage04(cfg, rd)
    cfg = _with_train(cfg, **TRAIN, spool_bytes=400_000)  # spool: about 1.5 batches
    copy = tmp_path / "killed" / "tiny"
    shutil.copytree(rd.root, copy, symlinks=True)
    return (cfg, RunDir(rd.root, cfg)), (cfg, RunDir(copy, cfg))


def test_training_sigkilled_mid_epoch_resumes_with_the_same_next_steps(two_identical_runs, tmp_path):
    import psutil

    (cfg_a, rd_a), (cfg_b, rd_b) = two_identical_runs
    whole = train.train(rd_a, progress=False)["eagle3"]

    config_b = tmp_path / "killed.yaml"
    config_b.write_text(cfg_b.to_yaml())
    marker = tmp_path / "stalled"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT / 'tests'}:{REPO_ROOT}"}
    log = tmp_path / "child.log"  # a file, not a pipe: a full pipe would block the child before it gets there
    with log.open("w") as out:
        child = subprocess.Popen([sys.executable, str(script), str(config_b), str(rd_b.root), str(marker)],
                                 env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), f"the child never reached epoch 1: {log.read_text()[-3000:]}"
        below = psutil.Process(child.pid).children(recursive=True)  # spool: its producer
        assert bool(below) == (cfg_b.train.hidden_states == "spool")
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL
    _, alive = psutil.wait_procs(below, timeout=30)
    assert not alive, f"processes of the killed training left running: {[p.pid for p in alive]}"
    ckpts = rd_b.path("draft", "eagle3", "checkpoints")
    assert sorted(d.name for d in ckpts.iterdir() if d.is_dir() and not d.is_symlink()) == ["0"]
    killed_curves = json.loads(rd_b.path("draft", "eagle3", "curves.json").read_text())
    assert [e["epoch"] for e in killed_curves["train_epochs"]] == [0]

    resumed = train.train(rd_b, progress=False)["eagle3"]
    assert resumed["global_step"] == whole["global_step"] and resumed["epochs_done"] == 3
    ca = json.loads(rd_a.path("draft", "eagle3", "curves.json").read_text())
    cb = json.loads(rd_b.path("draft", "eagle3", "curves.json").read_text())
    per_epoch = whole["global_step"] // 3
    assert per_epoch >= 3
    assert [s["step"] for s in cb["steps"]] == [s["step"] for s in ca["steps"]] == list(range(1, 3 * per_epoch + 1))
    for sa, sb in zip(ca["steps"], cb["steps"], strict=True):
        assert sb["epoch"] == sa["epoch"]
        assert sb["tokens"] == sa["tokens"]
        assert sb["lr"] == pytest.approx(sa["lr"], rel=1e-12, abs=0)  # the scheduler continued where it stopped
    # the steps after the resume point: the same losses as the uninterrupted run, within tolerance (per-step losses
    # of different batches differ by 10-30% here, so this also says the batches came in the same order)
    after = [(sa, sb) for sa, sb in zip(ca["steps"], cb["steps"], strict=True) if sa["epoch"] >= 1]
    for sa, sb in after:
        assert sb["loss"] == pytest.approx(sa["loss"], rel=1e-2), sa["step"]
    # and the final weights
    from safetensors.torch import load_file

    wa = load_file(str(Path(whole["checkpoint"]) / "model.safetensors"))
    wb = load_file(str(Path(resumed["checkpoint"]) / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        # speculators stores checkpoints (weights and AdamW moments) in bf16 while training keeps fp32: the resumed run
        # restarts from bf16-rounded state, so it lands within a few bf16 ulps of the uninterrupted run, not bitwise
        a, b = wa[k].float(), wb[k].float()
        assert (a - b).abs().max() <= a.abs().max() * 2**-6, k


# ---------------------------------------------------------------------------------------------------------------------
# The disk filling up during extraction
# ---------------------------------------------------------------------------------------------------------------------

LAYER_IDS = [1, 3, 5, 6]
# what safetensors raises when the disk is full (measured on a 64 KiB tmpfs): no errno, the OS error in the text
ENOSPC_TEXT = "Error while serializing: I/O error: No space left on device (os error 28)"


def _random_rows(n: int, vocab: int = 512, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(t),), generator=g).tolist() for t in torch.randint(8, 40, (n,), generator=g)]


def _mount_tmpfs(path: Path, size: str, remount: bool = False) -> bool:
    """A real small filesystem where this process may mount one (root, e.g. a VM); CI containers usually may not."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False
    opts = f"remount,size={size}" if remount else f"size={size}"
    return subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True).returncode == 0


class DiskFillsAfter:
    """Fallback fault where no filesystem can be mounted: OUR shard writer's save (eagle3lib.common.shards.save_file) writes
    half of the file, then fails exactly as safetensors does on a full disk, from the (k+1)-th shard on."""

    def __init__(self, k: int):
        from safetensors.torch import save_file

        self.k, self.calls, self.real, self.full = k, 0, save_file, True

    def __call__(self, tensors, filename, metadata=None):
        from safetensors import SafetensorError

        self.calls += 1
        if self.full and self.calls > self.k:
            time.sleep(1.0)  # slow failing writes: one taken up next may still run when the error reaches us
            self.real(tensors, filename, metadata)
            data = Path(filename).read_bytes()
            Path(filename).write_bytes(data[: len(data) // 2])
            raise SafetensorError(ENOSPC_TEXT)
        return self.real(tensors, filename, metadata)


@pytest.mark.parametrize("fault", ["tmpfs", "hook"])
def test_full_disk_during_extraction_one_error_nothing_half_written_rerun_resumes(fault, tmp_path, tiny_llama_dir,
                                                                                 monkeypatch):
    from conftest import reference_states
    from transformers import AutoModelForCausalLM

    from eagle3lib.common import shards
    from eagle3lib.common.config import load_config
    from eagle3lib.extract import capture

    cfg = load_config(None, [f"target.model={tiny_llama_dir}", f"target.layer_ids={LAYER_IDS[:-1]}",
                             "extract.batch_tokens=64", "extract.writer_threads=1", "extract.write_queue=1"])
    ids = _random_rows(24)
    masks = [[0] * (len(t) // 2) + [1] * (len(t) - len(t) // 2) for t in ids]
    mount = tmp_path / "disk"
    mount.mkdir()
    if fault == "tmpfs":
        if not _mount_tmpfs(mount, "96k"):
            pytest.skip("cannot mount a tmpfs here (not root, or no mount permission): the hook variant covers it")
    else:
        hook = DiskFillsAfter(k=7)
        monkeypatch.setattr(shards, "save_file", hook)
    ddir = mount / "dataset"
    try:
        with pytest.raises(WorkbookError) as err:
            capture.extract(cfg, ddir, tiny_llama_dir, LAYER_IDS, 64, ids, masks, progress=False)
        msg = str(err.value)
        assert "\n" not in msg and "rerun" in msg, msg
        sdir = shards.shard_dir(ddir)
        written = sorted(int(p.stem[3:]) for p in sdir.glob("hs_*.safetensors"))
        if fault == "tmpfs":  # a disk too small from the start: stage 02's check refuses before the first shard
            assert "the 24 rows still to extract need" in msg and "0 of them fit" in msg, msg
            assert written == []
        else:  # a disk that fills while the shards are written
            assert msg.startswith("the disk is full") and "the remaining" in msg and "GB" in msg, msg
            assert 0 < len(written) < len(ids), written
            assert f"with {len(written)} of 24 shards written; the remaining {24 - len(written)} shards" in msg
        assert [p.name for p in sdir.iterdir() if not p.name.startswith("hs_")] == []  # no temp file left behind
        spec = shards.ShardSpec(4, 64, torch.bfloat16)
        for i in written:  # everything under a final name is complete and right
            assert shards.check_shard_file(shards.shard_path(ddir, i), ids[i], spec) == []
        assert not (ddir / "state.json").exists()  # no table for a run that did not finish
        before = {i: shards.shard_path(ddir, i).stat().st_mtime_ns for i in written}

        # space is freed; the rerun keeps what was written and does the rest
        if fault == "tmpfs":
            assert _mount_tmpfs(mount, "8m", remount=True)
        else:
            hook.full = False
        again = capture.extract(cfg, ddir, tiny_llama_dir, LAYER_IDS, 64, ids, masks, progress=False)
        assert (again["resumed_shards"], again["computed_shards"]) == (len(written), 24 - len(written))
        assert all(shards.shard_path(ddir, i).stat().st_mtime_ns == t for i, t in before.items())
        model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
        for i in range(24):
            got = shards.read_shard(shards.shard_path(ddir, i))["hidden_states"].float()
            ref = reference_states(model, torch.tensor([ids[i]]), LAYER_IDS)[0]
            torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
        assert (ddir / "state.json").exists()
    finally:
        if fault == "tmpfs":
            subprocess.run(["umount", str(mount)], capture_output=True)


# ---------------------------------------------------------------------------------------------------------------------
# Corrupt shards met by stage 05, then regenerated by stage 02 on request
# ---------------------------------------------------------------------------------------------------------------------


def test_stage_05_names_corrupt_shards_and_stage_02_regenerates_them(tiny_run):
    from safetensors.torch import save_file

    from eagle3lib.common import shards
    from eagle3lib.extract import capture

    cfg, rd = tiny_run
    _stage04(cfg, rd)
    cfg = _with_train(cfg, epochs=1, packing_length=128)
    rd = RunDir(rd.root, cfg)
    d = rd.output("02", "dataset")
    path = lambda i: shards.shard_path(d, i)  # noqa: E731
    # (cloned: safetensors maps the files, and reading a mapped file after it was truncated is a SIGBUS)
    good = {i: {k: v.clone() for k, v in shards.read_shard(path(i)).items()} for i in range(16)}
    raw = path(3).read_bytes()
    path(3).write_bytes(raw[: len(raw) // 2])  # truncated
    path(4).write_bytes(b"")  # empty
    flipped = bytearray(path(10).read_bytes())
    flipped[20] ^= 0x40  # a bit flipped inside the header
    path(10).write_bytes(bytes(flipped))
    save_file({"token_ids": torch.roll(good[5]["token_ids"], 1), "hidden_states": good[5]["hidden_states"]},
              str(path(5)))  # token ids shifted by one position (speculators would drop the row with a warning)
    save_file({"token_ids": good[6]["token_ids"], "hidden_states": good[6]["hidden_states"].float()},
              str(path(6)))  # wrong dtype
    save_file({"token_ids": good[8]["token_ids"], "hidden_states": good[8]["hidden_states"][:, 1:].contiguous()},
              str(path(8)))  # wrong shape: a slot missing
    path(13).unlink()  # missing (a validation row: index 13 is past the 12 train rows)
    with pytest.raises(WorkbookError) as err:
        train.train(rd, progress=False)
    msg = str(err.value)
    assert "7 of 16 hidden-state shards" in msg and "rows [3, 4, 5, 6, 8, 10, 13]" in msg, msg
    assert "hs_3: unreadable" in msg and "rerun stage 02" in msg and "\n" not in msg
    assert not rd.path("draft", "eagle3", "checkpoints").exists() or not any(rd.path("draft", "eagle3", "checkpoints").iterdir())

    # "regenerated on request": stage 02's resume keeps the 9 valid shards and redoes the 7 others
    from datasets import load_from_disk

    table = load_from_disk(str(d)).with_format(None)
    layer_ids = rd.read_manifest("02")["metrics"]["layer_ids"]
    before = {i: path(i).stat().st_mtime_ns for i in range(16) if i not in (3, 4, 5, 6, 8, 10, 13)}
    hidden = rd.read_manifest("02")["metrics"]["hidden_size"]
    again = capture.extract(cfg, d, Path(cfg.target.model), layer_ids, hidden, table["input_ids"], table["loss_mask"],
                            progress=False)
    assert (again["resumed_shards"], again["computed_shards"]) == (9, 7)
    assert all(path(i).stat().st_mtime_ns == t for i, t in before.items())
    for i in (3, 4, 5, 6, 8, 10, 13):  # the states stage 02 recomputed are the ones it wrote the first time
        torch.testing.assert_close(shards.read_shard(path(i))["hidden_states"].float(),
                                   good[i]["hidden_states"].float(), rtol=2e-2, atol=2e-2)
    result = train.train(rd, progress=False)["eagle3"]
    assert result["epochs_done"] == 1 and result["global_step"] > 0


# ---------------------------------------------------------------------------------------------------------------------
# Untrusted files: nothing is unpickled, no remote code by default, servers on loopback
# ---------------------------------------------------------------------------------------------------------------------


def unpickling_problems(root: Path) -> list[str]:
    """Every place in root/eagle3lib that could unpickle or run code from a file (read from the source's AST)."""
    import ast

    problems = []
    for path in sorted((root / "eagle3lib").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        where = lambda node: f"{path.relative_to(root)}:{node.lineno}"  # noqa: B023, E731
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                if any(n and n.split(".")[0] in ("pickle", "cPickle", "dill", "joblib", "cloudpickle") for n in names):
                    problems.append(f"{where(node)}: imports a pickle library")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                kw = {k.arg: k.value for k in node.keywords}
                owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
                if owner == "torch" and node.func.attr == "load":
                    wo = kw.get("weights_only")
                    if not (isinstance(wo, ast.Constant) and wo.value is True):
                        problems.append(f"{where(node)}: torch.load without weights_only=True")
                if owner in ("np", "numpy") and node.func.attr == "load":
                    ap = kw.get("allow_pickle")
                    if ap is not None and not (isinstance(ap, ast.Constant) and ap.value is False):
                        problems.append(f"{where(node)}: np.load with allow_pickle")
            if isinstance(node, ast.keyword) and node.arg == "trust_remote_code":
                if isinstance(node.value, ast.Constant) and node.value.value is True:
                    problems.append(f"{where(node.value)}: trust_remote_code=True hard-coded")
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value.strip() == "VLLM_ALLOW_INSECURE_SERIALIZATION":
                problems.append(f"{where(node)}: sets or reads VLLM_ALLOW_INSECURE_SERIALIZATION (pickled RPC)")
    return problems


def test_nothing_in_eagle3lib_unpickles(tmp_path):
    assert unpickling_problems(REPO_ROOT) == []
    # the check has teeth
    bad = tmp_path / "eagle3lib" / "bad.py"
    bad.parent.mkdir()
    bad.write_text("import pickle\nimport torch\nx = torch.load('f')\ny = torch.load('f', weights_only=False)\n"
                   "import os\nos.environ['VLLM_ALLOW_INSECURE_SERIALIZATION'] = '1'\nf(trust_remote_code=True)\n"
                   "z = torch.load('f', weights_only=True)\n")
    found = "\n".join(unpickling_problems(tmp_path))
    for needle in ("bad.py:1: imports a pickle", "bad.py:3: torch.load", "bad.py:4: torch.load", "bad.py:6: sets",
                   "bad.py:7: trust_remote_code"):
        assert needle in found
    assert "bad.py:8" not in found


def test_remote_code_is_off_and_servers_bind_loopback_by_default(tiny_llama_dir):
    from eagle3lib.cli import build_parser, lab_argv
    from eagle3lib.common.config import load_config
    from eagle3lib.extract.backends.vllm_native import serve_command

    cfg = load_config(REPO_ROOT / "configs/demo.yaml")
    assert cfg.target.trust_remote_code is False and load_config(None).target.trust_remote_code is False
    cmd = serve_command(load_config(None, [f"target.model={tiny_llama_dir}"]), tiny_llama_dir, [1, 2, 3, 6])
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and "--trust-remote-code" not in cmd
    args = build_parser().parse_args(["lab"])
    assert args.ip == "127.0.0.1"
    argv = lab_argv(REPO_ROOT, ip=args.ip, port=8888, token="t0ken", default_url="/lab")
    assert "--ServerApp.ip=127.0.0.1" in argv and "--IdentityProvider.token=t0ken" in argv
    # (the served lab itself: tests/e2e/test_browser.py::test_eagle3_lab_prints_a_token_url_and_listens_on_loopback_only)


def test_sigterm_to_a_headless_run_shuts_its_kernel_down_with_everything_it_started(tmp_path, smollm2_dir):
    """`timeout` / a scheduler sends SIGTERM: the run ends like Ctrl-C (exit 130) and the notebook's kernel goes with
    its whole process group — a vLLM engine the kernel spawned once survived an H200 run holding 120 GiB."""
    import psutil

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "eagle3lib.cli", "run", "--config", "configs/demo.yaml", "--run",
                             "term", "--stages", "02", "-q", "-p", f"run.output_root={tmp_path}"],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    kernels: list[psutil.Process] = []
    try:
        deadline = time.time() + 120
        while not kernels and time.time() < deadline and proc.poll() is None:
            kernels = [p for p in psutil.Process(proc.pid).children(recursive=True)
                       if "ipykernel_launcher" in " ".join(p.cmdline())]
            time.sleep(0.5)
        assert kernels, f"no kernel started: {proc.stderr.read().decode()[-1500:] if proc.poll() is not None else ''}"
        time.sleep(3)  # the kernel is executing stage 02
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 130, proc.stderr.read().decode()[-1500:]
    assert "rerun the same command to resume" in proc.stderr.read().decode()
    gone, alive = psutil.wait_procs(kernels, timeout=15)
    assert not alive, f"kernel processes left running: {[p.pid for p in alive]}"
