"""Stage 02's text generation over `data.gen_engines` vLLM engines, each in a child process of its own, side by side
on one GPU.

Why: a small target's decode step is bound by the engine's CPU-side work (scheduling, sampling, output handling),
not by the GPU. SmolLM2-135M on one H200 wrote 28.1k tok/s with one engine and 39.5k with two side by side (x1.41,
docs/gpu.md#several-generation-engines). Processes, not threads: that CPU work holds the GIL.

Each child holds one `VllmGenerator` built from the run's config except for two things (`engine_config`): 1/N of
`extract.gpu_memory_utilization` and `run.seed + i` for engine i. Its engine runs as any stage 02 engine does
(vllm_engine.prepare_environment: in-process on the CPU; on a GPU its engine core in a process of its own, as in the
x1.41 measurement: in-process, scheduling and output handling would share one GIL). `EnginePoolGenerator`, what
stage 02's `make_generator` (eagle3lib.extract.prepare) returns for N > 1, starts the N engines on the first call
(a fully cached rerun starts none). Two ways in: streamed, `submit` sends texts to the engine with the most room
(each holds up to `generators.in_flight_for` its max_num_seqs) and `wait_any` hands back every reply that came back
since, from any engine, so stage 02's generation (generators.generate_continuous) keeps every engine's batch full,
none waiting for another; `generate` (benchmarks/generate.py) deals text j to engine j % N, sends every share, then
gathers the replies in input order. Greedy replies are the single engine's; sampled ones depend on N and on when each
request joined its engine's batch, since each engine samples from its own seed.

Engine 0 starts first, alone; the others then start at once, each given engine 0's KV cache size
(`kv_cache_memory_bytes`, read back by generators.kv_cache_bytes), with which vLLM skips its memory profile
(vllm/v1/worker/gpu_worker.py, determine_available_memory: "skipped memory profiling"). Why not all at once: vLLM sizes
its KV cache from the change in the GPU's free memory while it profiles ("we assume that the other processes using the
same GPU did not change their memory usage during the profiling"), so an engine that profiled while another allocated
its cache counted that cache as its own use; on one H200 engine 2 of 4 failed with "No available memory for the cache
blocks" (available -0.19 GiB: docs/gpu.md#several-generation-engines), and an engine that survives such a race
silently gets a smaller cache.
Engine 0 profiles alone (the others are importing vLLM, which takes no GPU memory); the others, the same model with the
same memory share, need the same cache. Engine 0 also compiles alone into the run's compile cache (VLLM_CACHE_ROOT,
`<run>/cache/vllm`, as any stage 02 engine): the others load its graphs (vLLM's compile hash leaves out the seed,
gpu_memory_utilization and kv_cache_memory_bytes, the things that differ: vllm/config/cache.py). Where engine 0's size
cannot be read, the others start one after another, each profiling alone, as they all did before (on one H200 with the
1.5B target four engines were up sooner with engines 1-3 at once than one after another:
docs/gpu.md#several-generation-engines). Each engine's own start is
`start_each_s`, its KV cache `kv_cache_bytes`, both recorded in stage 02's manifest. All N processes begin at once, so
their imports (~13 s of CPU each) overlap.

The channel is one socket pair per child (its end inherited as `--fd`), pickled messages in multiprocessing's
Connection framing; stdout and stderr stay vLLM's log, <run>/cache/logs/gen_engine_<i>.log:
    parent -> child   {"cfg", "model_dir", "cwd"} once; {"go": True, "kv_cache_memory_bytes"} at its turn to start
                      (the size: engine 0's, or None); {"ticket", "texts", "temperature", "max_new_tokens", "seeds"}
                      at any time, also while it generates; {"stop": True} at the end
    child -> parent   {"ready": pid, "start_s", "began", "in_flight", "kv_cache_bytes"} once its engine is up
                      (`began`: time.time() at its turn; `in_flight`: how many requests it holds at once;
                      `kv_cache_bytes`: its KV cache, None where unknown); {"done": [(ticket, index,
                      Reply)]} after each engine step that finished replies; or {"error": text} instead, after
                      which it exits
The child reads its socket in a thread of its own, so a parent sending texts never waits for an engine step, and
neither side can block the other with both sockets' buffers full. A child that dies is end-of-file on its socket. On
an error or a death the pool stops every child and raises one WorkbookError naming the engine and quoting its log;
the cache keeps every reply that came back before. `cancel` (a caller that stops with requests in flight) closes the
pool. `close` sends an idle child the stop message and one still starting or generating SIGTERM (both leave through
closing the engine), SIGKILL after a grace, and waits until each has exited. Children die with this process even on
SIGKILL (eagle3lib.common.processes.popen_with_parent).

    python -m eagle3lib.extract.engine_pool --fd FD      (started by EnginePoolGenerator, never by hand)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from eagle3lib.common.config import WorkbookConfig
from eagle3lib.common.errors import WorkbookError
from eagle3lib.extract.generators import Done, Reply

STOP_GRACE_S = 30.0  # a child told to stop closes its engine and exits; after this it is stopped by signal


def engine_config(cfg: WorkbookConfig, index: int) -> WorkbookConfig:
    """Engine `index`'s config: the run's, with its share of the GPU memory and its own seed."""
    n = cfg.data.gen_engines
    tree = cfg.model_dump(mode="json")
    tree["data"]["gen_engines"] = 1
    tree["run"]["seed"] = cfg.run.seed + index
    tree["extract"]["gpu_memory_utilization"] = cfg.extract.gpu_memory_utilization / n
    return WorkbookConfig.model_validate(tree)


@dataclass
class _Engine:
    """One child, from the parent: its process, its end of the socket pair, its log, how many requests it may hold
    (`in_flight`, from its ready message) and holds now (`holds`), and whether it is idle (engine up, nothing in
    hand: only then does it act on a stop message at once)."""

    index: int
    proc: subprocess.Popen
    conn: Connection
    log: Path
    in_flight: int = 0
    holds: int = 0
    idle: bool = False

    @property
    def room(self) -> int:
        return self.in_flight - self.holds

    @classmethod
    def start(cls, index: int, cfg: WorkbookConfig, model_dir: Path, log: Path) -> _Engine:
        from eagle3lib.common.processes import popen_with_parent

        ours, theirs = socket.socketpair()
        try:
            with open(log, "w") as out:
                proc = popen_with_parent([sys.executable, "-m", "eagle3lib.extract.engine_pool", "--fd",
                                          str(theirs.fileno())], stdout=out, stderr=subprocess.STDOUT,
                                         pass_fds=(theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # the child's copy only: its death is then end-of-file here
        engine = cls(index, proc, Connection(ours.detach()), log)
        with contextlib.suppress(OSError):  # a child already gone is reported, with its log, when it is waited for
            engine.conn.send({"cfg": cfg.model_dump_json(), "model_dir": str(Path(model_dir).absolute()),
                              "cwd": os.getcwd()})
        return engine


class EnginePoolGenerator:
    """`data.gen_engines` VllmGenerators in child processes behind the one Generator interface (the module's
    docstring says why and how)."""

    name = "vllm"

    def __init__(self, cfg: WorkbookConfig, model_dir: Path, tok: Any):
        self.cfg, self.model_dir, self.tok = cfg, Path(model_dir), tok
        self.engines = cfg.data.gen_engines
        self.tickets: dict[int, list[int]] = {}  # ticket -> [engine index, replies still to come]
        self._tickets = 0
        self.children: list[_Engine] = []
        self.start_s = 0.0  # from the first child's start to the last engine's readiness
        self.start_each_s: list[float] = []  # each engine's own start, as its child measured it
        self.pids: list[int] = []  # the children's, once their engines are up
        self.began: list[float] = []  # time.time() at which each engine's own start began (its turn)
        self.kv_cache_bytes: list[int | None] = []  # each engine's KV cache, as it reported it once up

    def start(self) -> None:
        """The N engines on the first call: engine 0 alone, then the others at once with its KV cache size, or one
        after another where that size is unknown (the module's docstring says why); benchmarks/generate.py calls it
        to time the start apart from the generation."""
        if self.children:
            return
        from eagle3lib.common.rundir import cache_root

        t0 = time.perf_counter()
        logs = cache_root(self.cfg) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(self.engines):  # every process at once: their imports overlap
                self.children.append(_Engine.start(i, engine_config(self.cfg, i), self.model_dir,
                                                   logs / f"gen_engine_{i}.log"))
            first, *rest = self.children
            self._go(first)
            kv = self._ready(first)
            if kv:  # the others at once: given engine 0's size, none of them profiles
                for child in rest:
                    self._go(child, kv)
                for child in rest:
                    self._ready(child)
            else:  # one after another, each profiling alone
                for child in rest:
                    self._go(child)
                    self._ready(child)
        except BaseException:
            self.close()
            raise
        self.start_s = round(time.perf_counter() - t0, 2)

    def _go(self, child: _Engine, kv_cache_bytes: int | None = None) -> None:
        """Tell a child to start its engine (with this KV cache size, where given)."""
        try:
            child.conn.send({"go": True, "kv_cache_memory_bytes": kv_cache_bytes})
        except OSError:
            self._fail(child, "to start", "its process exited")

    def _ready(self, child: _Engine) -> int | None:
        """Wait for a child's engine to be up, keep what it reports; returns its KV cache size (None: unknown)."""
        ready = self._next_message(child, "to start")
        child.in_flight, child.idle = ready["in_flight"], True
        self.pids.append(ready["ready"])
        self.start_each_s.append(ready["start_s"])
        self.began.append(ready["began"])
        self.kv_cache_bytes.append(ready["kv_cache_bytes"])
        return ready["kv_cache_bytes"]

    def generate(self, texts: list[str], temperature: float, max_new_tokens: int, seeds: list[int]) -> list[Reply]:
        """Text j to engine j % N, all shares at once, the replies in input order once every engine is done."""
        if self.tickets:
            raise RuntimeError("generate with streamed requests in flight: wait for them (or cancel) first")
        self.start()
        n = self.engines
        shares = {self._send(self.children[i], texts[i::n], temperature, max_new_tokens, seeds[i::n]): i
                  for i in range(min(n, len(texts)))}
        replies: list[Reply] = [Reply("", 0, False)] * len(texts)
        while self.tickets:
            for ticket, j, reply in self.wait_any():
                replies[shares[ticket] + j * n] = reply
        return replies

    def room(self) -> int:
        """What the engine with the most room may take now, at most a quarter of its `in_flight` at once: a long
        queue is dealt out over the engines rather than filling one while the others wait."""
        most = self._most_room()
        return max(0, min(most.room, max(1, most.in_flight // 4)))

    def submit(self, texts: list[str], temperature: float, max_new_tokens: int, seeds: list[int]) -> int:
        """Send texts to the engine with the most room; their replies come back through `wait_any`."""
        return self._send(self._most_room(), texts, temperature, max_new_tokens, seeds)

    def _most_room(self) -> _Engine:
        self.start()
        return max(self.children, key=lambda c: c.room)

    def _send(self, child: _Engine, texts: list[str], temperature: float, max_new_tokens: int,
              seeds: list[int]) -> int:
        self._tickets += 1
        try:
            child.conn.send({"ticket": self._tickets, "texts": texts, "temperature": temperature,
                             "max_new_tokens": max_new_tokens, "seeds": seeds})
        except OSError:
            self._fail(child, "while generating", "its process exited")
        child.holds += len(texts)
        child.idle = False
        self.tickets[self._tickets] = [child.index, len(texts)]
        return self._tickets

    def wait_any(self) -> list[Done]:
        """Every reply that came back since, from any engine (at least one); an engine's error or death fails at
        once."""
        busy = {c.conn: c for c in self.children if c.holds}
        if not busy:
            raise RuntimeError("nothing submitted")
        done: list[Done] = []
        for conn in wait(list(busy)):
            child = busy[conn]
            for ticket, i, reply in self._next_message(child, "while generating")["done"]:
                where = self.tickets.get(ticket)
                if where is None or where[0] != child.index:
                    self.close()
                    raise WorkbookError(f"generation engine {child.index} returned a reply for a request it was "
                                        f"not sent (ticket {ticket})", "report this as a bug")
                where[1] -= 1
                if not where[1]:
                    del self.tickets[ticket]
                child.holds -= 1
                done.append((ticket, i, reply))
            child.idle = not child.holds
        return done

    def cancel(self) -> None:
        """Drop what is in flight: the pool is closed (its engines start again on the next call); an idle pool
        stays up."""
        if self.tickets:
            self.close()

    def _next_message(self, child: _Engine, doing: str) -> dict[str, Any]:
        """The child's next message; an error or its death fails at once."""
        try:
            msg = child.conn.recv()
        except (EOFError, OSError):
            msg = {"error": "its process exited"}
        if "error" in msg:
            child.idle = True  # it exits by itself: no signal needed
            self._fail(child, doing, msg["error"])
        return msg

    def _fail(self, child: _Engine, doing: str, error: str) -> None:
        """Stop every child (the failed one's log is then complete), raise one error quoting that log."""
        from eagle3lib.common.processes import log_tail

        self.close()
        code = child.proc.returncode
        raise WorkbookError(
            f"generation engine {child.index} of {self.engines} failed {doing}: {error}"
            + (f" (exit code {code})" if code not in (None, 0) else "")
            + f"; last lines of {child.log}:\n{log_tail(child.log)}",
            "read the engine's log: the target, data.gen_vllm_args, or memory: each engine gets "
            "extract.gpu_memory_utilization / data.gen_engines of the GPU and uses more than that at full batch (on "
            "vLLM 0.26 its CUDA graphs lie outside its memory profile: docs/gpu.md#several-generation-engines), "
            "so 'CUDA out of memory' means fewer engines or a lower extract.gpu_memory_utilization; a rerun resumes "
            "from the replies cached so far")

    def close(self) -> None:
        """Stop every child and wait until it has exited (its GPU memory is then free, before extraction loads the
        target again). An idle child gets a stop message (it closes its engine and exits) and signals only after
        STOP_GRACE_S; one still starting or generating (another failed, or the user interrupted) gets SIGTERM at
        once, which it also leaves through closing its engine, with the same grace before SIGKILL
        (eagle3lib.common.processes.stop_process_tree)."""
        from eagle3lib.common.processes import descendants, stop_process_tree

        children, self.children = self.children, []
        self.tickets = {}
        below = {c.index: descendants(c.proc) for c in children}  # taken while they live: orphans are found later
        for c in children:
            if c.idle:
                with contextlib.suppress(OSError):
                    c.conn.send({"stop": True})
        deadline = time.monotonic() + STOP_GRACE_S
        for c in children:
            if not c.idle:
                with contextlib.suppress(ProcessLookupError):
                    c.proc.send_signal(signal.SIGTERM)  # all at once: each then has the same grace
        for c in children:  # both kinds get the grace: closing an engine on a busy 2-core CI box took over 10 s
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for c in children:
            stop_process_tree(c.proc, grace_s=10, known=below[c.index])
            c.conn.close()
        gc.collect()


# ------------------------------------------------------------------------------------------------ the child's side
def serve(conn: Connection) -> int:
    """Build the engine the first message describes, say so, then run it: texts that come in join its batch between
    steps, the replies each step finished go back at once, until told to stop (or the parent is gone). An exception
    is sent as one line (its traceback goes to the log) and ends the process."""
    import traceback

    job = conn.recv()
    os.chdir(job["cwd"])  # relative paths in the config mean what they mean to the parent
    from eagle3lib.common.target import load_tokenizer
    from eagle3lib.extract.backends.vllm_engine import prepare_environment
    from eagle3lib.extract.generators import VllmGenerator, kv_cache_bytes

    gen = None
    try:
        try:
            cfg = WorkbookConfig.model_validate_json(job["cfg"])
            model_dir = Path(job["model_dir"])
            gen = VllmGenerator(cfg, model_dir, load_tokenizer(cfg.target, model_dir))
            prepare_environment(cfg)  # what vLLM reads, in place before its import (VllmGenerator.start sets it too)
            import vllm.entrypoints.llm  # noqa: F401 - vLLM's imports, while the engines before this one start

            try:
                go = conn.recv()  # {"go": True, "kv_cache_memory_bytes"}: its turn (a stop before it is SIGTERM)
            except EOFError:
                return 0  # the parent is gone
            if go.get("kv_cache_memory_bytes"):  # engine 0's size: no memory profile, which would race the others
                gen.cfg.data.gen_vllm_args["kv_cache_memory_bytes"] = go["kv_cache_memory_bytes"]  # read at start
            began = time.time()
            gen.start()
            conn.send({"ready": os.getpid(), "start_s": gen.start_s, "began": began, "in_flight": gen.in_flight,
                       "kv_cache_bytes": kv_cache_bytes(gen.llm)})
            inbox = read_in_background(conn)
            tickets: dict[int, list[int]] = {}  # the generator's ticket -> [the parent's, replies still to come]
            while True:
                msgs = [] if gen.busy() else [inbox.get()]  # idle: wait for work; else take what came, then step
                with contextlib.suppress(queue.Empty):
                    while True:
                        msgs.append(inbox.get_nowait())
                for msg in msgs:
                    if msg is None or msg.get("stop"):
                        return 0  # the parent is gone, or done
                    t = gen.submit(msg["texts"], msg["temperature"], msg["max_new_tokens"], msg["seeds"])
                    tickets[t] = [msg["ticket"], len(msg["texts"])]
                done = []
                for t, i, reply in gen.step():
                    done.append((tickets[t][0], i, reply))
                    tickets[t][1] -= 1
                    if not tickets[t][1]:
                        del tickets[t]
                if done:
                    conn.send({"done": done})
        except Exception as e:  # noqa: BLE001 - sent to the parent with its text
            traceback.print_exc()
            sys.stdout.flush()
            with contextlib.suppress(OSError):
                conn.send({"error": e.problem if isinstance(e, WorkbookError) else f"{e.__class__.__name__}: {e}"})
            return 1
    finally:
        if gen is not None:
            gen.close()


def read_in_background(conn: Connection) -> queue.Queue:
    """Every message the parent sends, read as it comes by a daemon thread into a queue (None once the parent is
    gone): the engine's loop takes them between steps, and the parent's sends never wait for a step to end."""
    inbox: queue.Queue = queue.Queue()

    def read() -> None:
        while True:
            try:
                inbox.put(conn.recv())
            except (EOFError, OSError):
                inbox.put(None)
                return

    threading.Thread(target=read, name="engine-pool-inbox", daemon=True).start()
    return inbox


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eagle3lib.extract.engine_pool", description=__doc__.splitlines()[0])
    ap.add_argument("--fd", type=int, required=True, help="this engine's end of the socket pair its parent holds")
    args = ap.parse_args(argv)
    os.set_inheritable(args.fd, False)  # vLLM's own children must not hold it open: the parent reads EOF as death

    def stop(signum: int, _frame: object) -> None:  # the parent's fallback: leave through `finally` (engine closed)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    return serve(Connection(args.fd))


if __name__ == "__main__":
    sys.exit(main())
