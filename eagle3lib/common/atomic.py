"""Atomic writes: a file appears under its final name complete, or not at all.

Why: runs are killed (Ctrl-C, the kernel's stop button, SIGKILL, a full disk) and a rerun must be able to trust
every file it finds. We write to a temp name in the same folder and `os.replace` it into place.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # read once at import: os.umask is process-wide, so never toggle it while threads write


def _normal_mode(path: Path, directory: bool = False) -> None:
    """mkstemp/mkdtemp create private (0600/0700) entries; a finished output gets the usual umask-based mode."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_UMASK)


@contextlib.contextmanager
def atomic_path(final: str | Path, suffix: str = "") -> Iterator[Path]:
    """Yields a temp path next to `final`; on success it is renamed to `final`, on error it is removed."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=f".tmp{suffix}", dir=final.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        if tmp_path.exists():
            _normal_mode(tmp_path)
        os.replace(tmp_path, final)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_dir(final: str | Path) -> Iterator[Path]:
    """Like atomic_path, for a folder (e.g. a datasets.save_to_disk output): built aside, swapped in at the end."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        yield tmp
        _normal_mode(tmp, directory=True)
        if final.exists():
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text(path: str | Path, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def write_json(path: str | Path, data: Any) -> Path:
    return write_text(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def remove_stale_temps(folder: str | Path) -> int:
    """Delete temp files a killed run left behind (they never carry a final name). Returns how many."""
    n = 0
    folder = Path(folder)
    if folder.is_dir():
        for p in folder.glob(".*.tmp*"):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            n += 1
    return n


@contextlib.contextmanager
def exclusive(lock_file: str | Path) -> Iterator[None]:
    """One process at a time past this point, across processes on this machine (an advisory `flock` on
    `lock_file`, released when the block ends or the process dies). Why: two processes that build the same cached
    output (two test workers converting the same embedded target) must not both write it; the second waits, then
    finds it built."""
    lock_file = Path(lock_file)
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
