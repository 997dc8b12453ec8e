"""Children that must not outlive the process that started them: started, watched, stopped with everything under
them.

Why one module: stage 06's vLLM servers and benchmark worker and stage 05's spool producer are all children that
hold an engine (a GPU, a port, gigabytes of memory) and outlive the call that started them unless something stops
them; an engine the kernel had spawned once lived on holding 120 GiB of an H200. So every such child is started by
`popen_with_parent` (the kernel tells it to stop when the thread that started it dies, even by SIGKILL: Linux
PR_SET_PDEATHSIG; it stays in its parent's process group, so a runner that kills that group kills it too), stopped
by `stop_process_tree` (it and every process under it), and, inside `interrupt_on_sigterm`, a SIGTERM to the parent
runs the `finally` that stops it. `log_tail` is what an error shows of a child's log.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eagle3lib.common.config import REPO_ROOT

LOG_TAIL_LINES = 12
# an exception's last line, e.g. torch.OutOfMemoryError: ..., also behind vLLM's "(EngineCore pid=N) " and an ERROR
# record's header; a name inside other text (a vLLM warning that mentions "`OSError: [Errno 24] Too many open files`")
# is not one
ERROR_LINE = re.compile(r"^(?:\(\w+ pid=\d+\) )?(?:(?:ERROR|CRITICAL) [^]]*\] )?[\w.]*(Error|Exception)\b: ")
CAUSES_SHOWN = 3


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The log's last `lines` lines, after the exception lines above them (the last CAUSES_SHOWN distinct ones, each
    cut at 400 characters): a child that fails often logs its cause and then a screen of shutdown lines, e.g. a vLLM
    engine core's "torch.OutOfMemoryError: CUDA out of memory ..." above its frontend's EngineDeadError ("See stack
    trace (above) for the root cause") and a dozen lines of shutting down."""
    try:
        text = path.read_text(errors="replace").splitlines(keepends=True)
    except OSError:
        return "(no log)\n"
    above = error_lines(text[:-lines])
    head = "".join(f"{line}\n" for line in above[-CAUSES_SHOWN:])
    return (f"errors above the last lines:\n{head}...\n" if head else "") + "".join(text[-lines:])


def error_lines(lines: list[str]) -> list[str]:
    """The distinct exception lines (ERROR_LINE) among `lines`, in order, stripped and cut at 400 characters."""
    found: list[str] = []
    for line in lines:
        line = line.strip()[:400]
        if ERROR_LINE.search(line) and line not in found:
            found.append(line)
    return found


_LIBC: Any = None


def _die_with_parent() -> None:
    """preexec_fn of a child: the kernel sends it SIGTERM when the thread that started it dies, even by SIGKILL,
    where no `finally` of ours can run. Only a foreign call here: between fork and exec nothing may take a lock."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def popen_with_parent(argv: list[str], **kwargs: Any) -> subprocess.Popen:
    """subprocess.Popen(argv, cwd=REPO_ROOT, ...) for a child that must not outlive this process (see the module's
    docstring)."""
    global _LIBC
    if sys.platform.startswith("linux") and _LIBC is None:
        import ctypes

        _LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here, before any fork
    return subprocess.Popen(argv, cwd=str(REPO_ROOT), preexec_fn=_die_with_parent if _LIBC is not None else None,
                            **kwargs)


def descendants(proc: subprocess.Popen | None) -> list[Any]:
    """The processes under `proc` now (psutil.Process objects, which know their start time: a recycled pid is not
    mistaken for one of them later); [] once it has exited, whose children then belong to init."""
    import psutil

    try:
        return psutil.Process(proc.pid).children(recursive=True) if proc is not None and proc.poll() is None else []
    except psutil.Error:
        return []


def stop_process_tree(proc: subprocess.Popen | None, grace_s: float = 30.0, known: list[Any] = ()) -> None:
    """SIGTERM to `proc` (a vLLM server, or the spool producer, then shuts its engine down), SIGKILL after `grace_s`;
    then SIGKILL to every process that was under it, now or when `known` was taken, and still lives (an engine core
    whose API server died: once the server is gone, only a list taken earlier still names it)."""
    if proc is None:
        return
    import psutil

    below = list({p.pid: p for p in [*known, *descendants(proc)]}.values())
    stopping = proc.poll() is None
    if stopping:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    # a server that was told to stop stops its own children; orphans of one that died are told here
    _, alive = psutil.wait_procs(below, timeout=10 if stopping else 0)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)
        _, alive = psutil.wait_procs(alive, timeout=5)


@contextlib.contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """While children live: SIGTERM to this process raises KeyboardInterrupt, so the `finally` that stops them runs
    (Python's default SIGTERM exit runs none). Only from the main thread, and only where nobody handles SIGTERM
    already (`eagle3 run` does, the same way)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def handler(signum: int, _frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
