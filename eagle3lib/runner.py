"""Headless runs: execute the numbered notebooks in order with papermill, into the run directory.

Why notebooks and not plain functions: the executed copy of each notebook (tables, plots, logs) is the record of
the run a person reads afterwards, and the same page is what they step through in JupyterLab.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from eagle3lib.common.config import REPO_ROOT, load_run_config, resolve_config_path, run_overrides
from eagle3lib.common.errors import StageFailed, WorkbookError
from eagle3lib.common.rundir import RunDir, cache_root
from eagle3lib.common.stages import EXECUTED_NOTEBOOKS_ENV, Stage, parse_selection
from eagle3lib.common.target import check_tokenizer, resolve_target

KERNEL = "python3"  # the kernel of the interpreter that runs papermill: the workbook's venv


def run_environment(rd: RunDir) -> dict[str, str]:
    """Keep every cache and socket a run makes inside folders the run owns (vLLM, IPython, HF, temp files): the
    run's one cache folder (`rundir.cache_root`), where stage 02's engines, stage 06's servers and their children
    find what another built. (A second folder here once kept the kernels' vLLM cache apart from the servers': on the
    H200 the draft's server then inspected the target's model class again: 17 s.)"""
    cache = cache_root(rd.cfg)
    env = {
        "IPYTHONDIR": str(cache / "ipython"),
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "MPLCONFIGDIR": str(cache / "matplotlib"),
        "TOKENIZERS_PARALLELISM": "false",
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",
    }
    for path in env.values():
        if path.startswith(str(cache)):
            Path(path).mkdir(parents=True, exist_ok=True)
    return env


def ipc_kernel_manager() -> type:
    """The notebooks' kernel manager: jupyter_client's, with the kernel on local IPC sockets in a private temp folder
    instead of TCP ports on 127.0.0.1. Why: over TCP without CurveZMQ keys every stage's kernel warned "Kernel is
    running over TCP without encryption" (ipykernel/kernelapp.py), and any local user could connect to its ports; an
    IPC socket lives in a folder only this user can open. (The folder's path is kept short: a Unix socket path has a
    limit of about 107 bytes, which a run folder's path can pass.)"""
    import shutil
    import tempfile

    from jupyter_client.manager import AsyncKernelManager

    class IPCKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs: object) -> None:
            super().__init__(**kwargs)
            self._socket_dir = tempfile.mkdtemp(prefix="eagle3-kernel-")
            self.transport = "ipc"
            self.ip = os.path.join(self._socket_dir, "k")

        async def _async_cleanup_resources(self, restart: bool = False) -> None:
            await super()._async_cleanup_resources(restart=restart)
            if not restart:
                shutil.rmtree(self._socket_dir, ignore_errors=True)

    return IPCKernelManager


def preflight(config: str | Path | None, overrides: list[str], run: str | None = None) -> RunDir:
    """Everything that can be checked before a notebook starts: config, target path and config.json, layer ids, the
    draft vocabulary against the target's, the tokenizer against the model, then the output folder (created last, so
    bad input leaves nothing behind)."""
    cfg = load_run_config(config, run, overrides)
    target = resolve_target(cfg.target)
    info = target.info
    if cfg.verifier.draft_vocab_size > info.vocab_size:
        raise WorkbookError(
            f"verifier.draft_vocab_size={cfg.verifier.draft_vocab_size} is larger than the target's vocabulary "
            f"({info.vocab_size} tokens)",
            f"set verifier.draft_vocab_size to at most {info.vocab_size} (equal = no draft vocabulary mapping)")
    check_tokenizer(cfg.target, target.model_dir, info)
    return RunDir.create(cfg)


def run_stages(config: str | Path | None, run: str | None = None, stages: str | None = None,
               overrides: list[str] | None = None, log_output: bool = True) -> RunDir:
    """Run the selected stages in order; stop at the first failure with the stage, the error and the notebook path."""
    import papermill as pm

    config_path = resolve_config_path(config)
    overrides = run_overrides(run, overrides or [])
    rd = preflight(config_path, overrides)
    selected: list[Stage] = parse_selection(stages)
    os.environ.update(run_environment(rd))
    out_dir = rd.path("notebooks")
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ[EXECUTED_NOTEBOOKS_ENV] = str(out_dir)  # where the executed copies are read: notebook 06's links
    print(f"run '{rd.cfg.run.name}' → {rd.root}   stages: {' '.join(s.id for s in selected)}", flush=True)
    for stage in selected:
        out = out_dir / stage.notebook.name
        t0 = time.time()
        print(f"[{stage.key}] {stage.title} …", flush=True)
        try:
            pm.execute_notebook(
                str(stage.notebook), str(out), kernel_name=KERNEL, cwd=str(REPO_ROOT),
                parameters={"config": str(config_path) if config_path else None, "run": rd.cfg.run.name, "overrides": list(overrides)},
                log_output=log_output, progress_bar=False, stdout_file=sys.stdout if log_output else None,
                kernel_manager_class=ipc_kernel_manager(),
            )
        except pm.PapermillExecutionError as e:
            if e.ename == "WorkbookError":  # the notebook's own problem and fix, with where it stopped
                raise StageFailed(f"stage {stage.key} stopped: {e.evalue.strip()} (executed notebook: {out}, cell "
                                  f"{e.exec_count})") from None
            raise StageFailed(
                f"stage {stage.key} failed: {e.ename}: {e.evalue.strip()}",
                f"read the executed notebook {out} (cell {e.exec_count}), fix the cause, rerun with --stages {stage.id}-",
            ) from None
        print(f"[{stage.key}] done in {time.time() - t0:.1f} s → {out}", flush=True)
    return rd
