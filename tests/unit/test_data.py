"""Stage 02 data preparation: sources, errors a user can fix, the eval split, the loss mask on SmolLM2's real chat
template, truncation, and self-distillation with its resume cache."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from eagle3lib.common import sources
from eagle3lib.common.config import load_config
from eagle3lib.common.errors import WorkbookError
from eagle3lib.extract import prepare, rows


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def chat(i: int, turns: int = 1) -> dict:
    msgs = []
    for t in range(turns):
        msgs += [{"role": "user", "content": f"Question {i}.{t}: what is {i} plus {t}?"},
                 {"role": "assistant", "content": f"{i} plus {t} is {i + t}."}]
    return {"messages": msgs, "category": ["a", "b", "c"][i % 3]}


def test_bundled_prompt_set_is_large_varied_and_valid():
    recs = sources.read_jsonl(sources.bundled_prompts_path())
    assert len(recs) >= 300
    cats = Counter(r["category"] for r in recs)
    assert {"code", "math", "reasoning", "chat", "writing", "multilingual"} <= set(cats)
    assert min(cats.values()) >= 25
    assert len({sources.prompt_key(r["messages"]) for r in recs}) == len(recs)  # no duplicates
    scripts = "".join(r["messages"][0]["content"] for r in recs if r["category"] == "multilingual")
    assert any("\u4e00" <= ch <= "\u9fff" for ch in scripts) and any("\u0400" <= ch <= "\u04ff" for ch in scripts)


def test_malformed_records_name_the_line_and_the_fix(tmp_path):
    good = json.dumps(chat(0))
    with pytest.raises(WorkbookError, match=r"bad.jsonl:3: not valid JSON"):
        sources.read_jsonl(write_jsonl(tmp_path / "bad.jsonl", [good, "", '{"messages": [}']))
    with pytest.raises(WorkbookError, match=r"roles.jsonl:2, turn 1: unknown role 'robot'"):
        sources.read_jsonl(write_jsonl(tmp_path / "roles.jsonl", [good, {"messages": [
            {"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]}]))
    with pytest.raises(WorkbookError, match=r"empty.jsonl:1, turn 1 \(assistant\): empty turn"):
        sources.read_jsonl(write_jsonl(tmp_path / "empty.jsonl", [{"messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]}]))
    with pytest.raises(WorkbookError, match="no 'messages'"):
        sources.read_jsonl(write_jsonl(tmp_path / "keys.jsonl", [{"text": "hello"}]))
    with pytest.raises(WorkbookError, match="does not exist"):
        sources.read_jsonl(tmp_path / "missing.jsonl")


def test_sharegpt_and_hf_disk_sources(tmp_path):
    from datasets import Dataset

    share = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                               {"from": "gpt", "value": "Hello!"}]}
    recs = sources.read_jsonl(write_jsonl(tmp_path / "s.jsonl", [share]))
    assert recs[0]["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                   {"role": "assistant", "content": "Hello!"}]
    Dataset.from_list([chat(i) for i in range(5)]).save_to_disk(str(tmp_path / "hf"))
    cfg = load_config(None, [f"data.sources=[{{kind: hf_disk, path: {tmp_path / 'hf'}, limit: 3}}, "
                             f"{{kind: jsonl, path: {tmp_path / 's.jsonl'}}}]"])
    recs = sources.load_records(cfg)
    assert len(recs) == 4 and recs[0]["messages"] == chat(0)["messages"] and recs[-1]["source"] == "s.jsonl"


def test_eval_split_is_first_disjoint_stratified_and_seeded():
    recs = [chat(i) for i in range(30)]
    recs.append({"messages": [{"role": "user", "content": "Question 4.0: what is 4 plus 0?"},
                              {"role": "assistant", "content": "4"}], "category": "a"})  # shares a prompt with #4
    evals, train = prepare.split_eval(recs, 6, seed=0)
    assert Counter(r["category"] for r in evals) == {"a": 2, "b": 2, "c": 2}
    held = {m["content"] for r in evals for m in r["messages"] if m["role"] == "user"}
    assert not any(m["content"] in held for r in train for m in r["messages"] if m["role"] == "user")
    assert prepare.split_eval(recs, 6, seed=0)[0] == evals and prepare.split_eval(recs, 6, seed=1)[0] != evals
    if any("Question 4.0" in m["content"] for r in evals for m in r["messages"]):
        assert len(train) == 31 - 6 - 1  # the duplicate prompt is not trained on either
    with pytest.raises(WorkbookError, match="leaves no training data"):
        prepare.split_eval(recs[:3], 3, seed=0)


def test_eval_split_holds_out_the_same_prompts_whatever_else_a_config_reads():
    """The draw follows each conversation's own text: the records in another order, another source beside them or
    more of one category (a larger ShareGPT limit) leave every other category's held-out prompts as they were, so
    two configs' held-out τ compare."""
    recs = [chat(i) for i in range(60)]
    evals, _ = prepare.split_eval(recs, 6, seed=0)  # two of each of the categories a, b, c

    def picks(held: list[dict], cats: str) -> list[dict]:
        return [r for r in held if r["category"] in cats]

    assert prepare.split_eval(list(reversed(recs)), 6, seed=0)[0] == evals
    more_d = [dict(chat(i), category="d") for i in range(100, 160)]
    assert picks(prepare.split_eval(recs + more_d, 8, seed=0)[0], "abc") == picks(evals, "abc")
    more_a = [dict(chat(i), category="a") for i in range(200, 260)]
    assert picks(prepare.split_eval(more_a + recs, 6, seed=0)[0], "bc") == picks(evals, "bc")


def test_loss_mask_covers_exactly_the_assistant_turns_on_smollm2(smol_tok):
    conv = chat(7, turns=2)["messages"]
    conv.insert(0, {"role": "system", "content": "You answer sums."})
    ids, mask = rows.tokenize_conversation(smol_tok, conv, 10_000)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    trained = smol_tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert trained == "7 plus 0 is 7.<|im_end|>\n7 plus 1 is 8.<|im_end|>\n"
    context = smol_tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert "Question 7.0" in context and "assistant" in context and "plus 0 is" not in context
    # the whole sequence is the template's own tokenization
    assert ids == smol_tok.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]
    short_ids, short_mask = rows.tokenize_conversation(smol_tok, conv, 40)
    assert short_ids == ids[:40] and short_mask == mask[:40]


def test_tokenizing_many_conversations_on_threads_gives_each_ones_ids_and_mask(smol_tok):
    convs = [chat(i, turns=1 + i % 3)["messages"] for i in range(40)]
    convs[3] = [{"role": "user", "content": "No reply yet"}]  # no assistant turn: an all-zero mask
    smol_tok(["a", "a much longer text than that"], padding=True)  # leaves padding on the tokenizer it wraps
    many = rows.tokenize_conversations(smol_tok, convs, threads=3, chunk=7)
    assert many == [rows.tokenize_conversation(smol_tok, c, 10**9) for c in convs]
    assert set(many[3][1]) == {0} and all(sum(m) > 0 for i, (_, m) in enumerate(many) if i != 3)
    assert rows.span_mask([(0, 2), (2, 2), (2, 5), (5, 9), (9, 12)], [(3, 6), (10, 11)]) == [0, 0, 1, 1, 1]


def test_prepare_without_replies_asks_for_self_distillation(tmp_path, smollm2_dir):
    src = write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": f"Say {i}"}]} for i in range(6)])
    cfg = load_config(None, [f"data.sources=[{{kind: jsonl, path: {src}}}]", "data.self_distill=false",
                             "data.eval_samples=2"])
    with pytest.raises(WorkbookError, match="self_distill=true"):
        prepare.prepare(cfg, smollm2_dir, tmp_path / "data")


def test_prepare_self_distills_splits_and_resumes_from_its_cache(tmp_path, smollm2_dir):
    src = write_jsonl(tmp_path / "p.jsonl", [
        {"messages": [{"role": "user", "content": q}], "category": c} for q, c in [
            ("What is the capital of France?", "k"), ("Name a color.", "k"), ("Say hello in Spanish.", "m"),
            ("What is 2 plus 2?", "m"), ("Write a word that rhymes with cat.", "w"), ("Count to three.", "w"),
            ("What is the opposite of hot?", "k"), ("Name a fruit.", "w")]])
    over = [f"data.sources=[{{kind: jsonl, path: {src}}}]", "data.eval_samples=2", "data.gen_max_new_tokens=12",
            "data.gen_batch_size=4", "data.val_fraction=0.25", "data.max_length=64"]
    cfg = load_config(None, over)
    ddir = tmp_path / "data"
    p = prepare.prepare(cfg, smollm2_dir, ddir, progress=False)
    assert (len(p), p.n_train, p.n_val) == (6, 4, 2)
    assert p.stats["self_distill"]["generated"] == 6 and p.stats["self_distill"]["new_tokens"] > 6
    evals = [json.loads(line) for line in (ddir / "eval.jsonl").read_text().splitlines()]
    train = [json.loads(line) for line in (ddir / "train.jsonl").read_text().splitlines()]
    assert len(evals) == 2 and all(e["messages"][-1]["role"] == "user" for e in evals)
    assert [t["split"] for t in train] == ["train"] * 4 + ["val"] * 2
    assert not {e["messages"][0]["content"] for e in evals} & {t["messages"][0]["content"] for t in train}
    for conv, ids, mask in zip(p.conversations, p.input_ids, p.loss_mask, strict=True):
        assert conv[-1]["role"] == "assistant" and conv[-1]["content"]
        assert sum(mask) > 0 and len(ids) <= 64
    # the replies are cached: a rerun generates nothing and gives the same rows
    again = prepare.prepare(cfg, smollm2_dir, ddir, progress=False)
    assert again.stats["self_distill"] == {**again.stats["self_distill"], "generated": 0, "cached": 6}
    assert again.input_ids == p.input_ids and again.loss_mask == p.loss_mask
    # "France" is greedy SmolLM2's answer to one of them, if that prompt was not held out
    replies = {c[0]["content"]: c[-1]["content"] for c in p.conversations}
    if "What is the capital of France?" in replies:
        assert "Paris" in replies["What is the capital of France?"]


def test_replies_cache_keeps_replies_holding_unicode_line_separators(tmp_path):
    """json.dumps(ensure_ascii=False) leaves U+2028 and its kin raw, and str.splitlines() splits on them: 3 of the
    125,670 cached replies of the 4x H200 run were read back torn and generated again (eagle3lib/common/jsonl.py)."""
    from eagle3lib.common import jsonl
    from eagle3lib.extract.generators import read_cache

    odd = "one\u2028two\u2029three\x85four\x1cfive"  # \x1c: escaped by json.dumps, split by splitlines
    rows = [{"key": "k1", "reply": odd, "tokens": 7, "finished": True},
            {"key": "k2", "reply": "plain", "tokens": 1, "finished": False}]
    path = tmp_path / "distill_cache.jsonl"
    path.write_text(jsonl.dumps(rows) + '{"key": "k3", "reply": "torn', encoding="utf-8")  # a killed run's last line
    assert len(path.read_text(encoding="utf-8").splitlines()) == 6  # the trap: the odd reply alone is 4 "lines"
    assert read_cache(path) == {"k1": rows[0], "k2": rows[1]}
    path.write_text(jsonl.dumps(rows), encoding="utf-8")
    assert jsonl.read(path) == rows


def test_replies_adds_sampled_replies_to_the_same_prompts(tmp_path, smollm2_dir):
    qs = ["Name a color.", "Say hello in Spanish.", "What is 2 plus 2?", "Count to three.", "Name a fruit."]
    src = write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": q}]} for q in qs])
    over = [f"data.sources=[{{kind: jsonl, path: {src}, replies: 3}}]", "data.eval_samples=1",
            "data.gen_max_new_tokens=12", "data.val_fraction=0", "data.max_length=64"]
    with pytest.raises(WorkbookError, match="replies > 1.*temperature above 0"):
        load_config(None, over)  # greedy only: the extra replies would be copies
    with pytest.raises(WorkbookError, match="temperature above 0"):
        load_config(None, [*over, "data.gen_temperatures=[0.0]"])
    cfg = load_config(None, [*over, "data.gen_temperatures=[0.0, 1.0]"])
    p = prepare.prepare(cfg, smollm2_dir, tmp_path / "data", progress=False)
    assert len(p) == 4 * 3 and p.stats["self_distill"]["generated"] == 12
    firsts = [c[0]["content"] for c in p.conversations]
    groups = [firsts[i:i + 3] for i in range(0, 12, 3)]
    assert all(len(set(g)) == 1 for g in groups) and len({g[0] for g in groups}) == 4  # a prompt's replies together
    # 12 generated (not 4): every extra reply has its own cache key; sampled, so they are not all copies
    assert len({c[-1]["content"] for c in p.conversations}) > 4
    # a rerun takes them all from the cache
    again = prepare.prepare(cfg, smollm2_dir, tmp_path / "data", progress=False)
    assert again.stats["self_distill"]["cached"] == 12 and again.input_ids == p.input_ids


def test_more_prompts_keep_every_cached_reply_and_a_moved_checkpoint_hits_too(tmp_path, smol_tok, smollm2_dir):
    """A reply's temperature (part of its cache key) belongs to its conversation, not to its place in the pool, and
    the key names the target as the config does, not its folder: a prompt added in front (every position shifts by
    one) costs one reply, the same prompts through a symlinked checkpoint none. Dealt by position, the 4x recipe data
    missed 41% of the 1x run's replies (8,925 of 21,984); keyed by folder, the committed caches hit only on the
    device's image."""
    from eagle3lib.extract.prepare import make_generator, reply_temperature

    temps = [0.0, 0.0, 0.7]
    bundled = sources.read_jsonl(sources.bundled_prompts_path())
    dealt = Counter(reply_temperature(r["messages"], temps) for r in bundled)
    assert set(dealt) == {0.0, 0.7} and 0.2 < dealt[0.7] / len(bundled) < 0.47  # ~1/3 sampled, as the list says
    cfg = load_config(None, ["data.gen_max_new_tokens=6", "data.gen_temperatures=[0.0, 0.7]", "data.gen_batch_size=16"])
    convs = [[{"role": "user", "content": f"Name animal number {i}."}] for i in range(6)]
    assert len({reply_temperature(c, [0.0, 0.7]) for c in convs}) == 2  # both temperatures among them
    cache = tmp_path / "distill_cache.jsonl"
    gen = make_generator(cfg, smollm2_dir, smol_tok)
    try:
        first, st = prepare.self_distill(cfg, smollm2_dir, smol_tok, convs, cache, progress=False, generator=gen)
        assert (st["generated"], st["cached"]) == (6, 0)
        grown = [[{"role": "user", "content": "Count to three."}], *convs]
        out, st = prepare.self_distill(cfg, smollm2_dir, smol_tok, grown, cache, progress=False, generator=gen)
        assert (st["generated"], st["cached"]) == (1, 6) and out[1:] == first
        moved = tmp_path / "elsewhere"
        moved.symlink_to(smollm2_dir, target_is_directory=True)
        out, st = prepare.self_distill(cfg, moved, smol_tok, grown[::-1], cache, progress=False, generator=gen)
        assert (st["generated"], st["cached"]) == (0, 7) and out[::-1][1:] == first
    finally:
        gen.close()


class Echo:
    """A streamed generator without a model, holding up to `in_flight` requests, at most `chunk_size` a submit: a
    reply names the user turns it answers and its temperature; replies come back one at a time, the newest request's
    first (as engines of different speeds may hand them back)."""

    name = "echo"

    def __init__(self, in_flight: int, chunk_size: int):
        self.in_flight, self.chunk_size = in_flight, chunk_size
        self.held: list = []
        self.chunks: list[tuple[float, int]] = []

    def generate(self, texts, temperature, max_new_tokens, seeds):
        from eagle3lib.extract.generators import Reply

        return [Reply(f"{t.count('<|im_start|>user')} at {temperature}", 3, True) for t in texts]

    def room(self):
        return min(self.chunk_size, self.in_flight - len(self.held))

    def submit(self, texts, temperature, max_new_tokens, seeds):
        assert 0 < len(texts) <= self.room()
        self.chunks.append((temperature, len(texts)))
        self.held += [(len(self.chunks), i, r) for i, r in
                      enumerate(self.generate(texts, temperature, max_new_tokens, seeds))]
        return len(self.chunks)

    def wait_any(self):
        return [self.held.pop()]

    def cancel(self):
        self.held.clear()

    def close(self):
        pass


def test_self_distill_queues_each_next_turn_as_its_reply_comes_back(tmp_path, smol_tok):
    """Continuous scheduling, without a model: replies one at a time and out of order, up to 6 in flight and 3 a
    submit, one temperature per submit, a repeated history asked once, a closing system message kept; every reply is
    the one its own history asks for."""
    cfg = load_config(None, ["data.gen_temperatures=[0.0, 0.7]", "data.gen_max_new_tokens=4"])
    u = [{"role": "user", "content": f"Question {i}?"} for i in range(6)]
    a = {"role": "assistant", "content": "old"}
    convs = [[u[0], a, u[1], a, u[2], a], [u[3], a, u[4]], [u[5]], [u[3], a, u[4], a],
             [u[1], a, {"role": "system", "content": "Closing note."}]]  # the 4th repeats the 2nd
    convs += [[{"role": "user", "content": f"Extra {i}?"}] for i in range(7)]
    gen = Echo(6, 3)
    out, st = prepare.self_distill(cfg, None, smol_tok, convs, tmp_path / "c.jsonl", progress=False, generator=gen)
    temps = [prepare.reply_temperature(c, [0.0, 0.7]) for c in convs]
    for c, conv, t in zip(convs, out, temps, strict=True):
        users = [m for m in c if m["role"] == "user"]
        assert [m for m in conv if m["role"] != "assistant"] == [m for m in c if m["role"] != "assistant"]
        assert [m["content"] for m in conv if m["role"] == "assistant"] == [f"{k} at {t}" for k in
                                                                            range(1, len(users) + 1)]
    assert (st["generated"], st["cached"]) == (sum(map(len, [[1, 2, 3], [1, 2], [1], [], [1]])) + 7, 0)
    assert max(n for _, n in gen.chunks) == 3 and {t for t, _ in gen.chunks} == {0.0, 0.7}
    assert sum(n for _, n in gen.chunks) == st["generated"]
    again, st = prepare.self_distill(cfg, None, smol_tok, convs, tmp_path / "c.jsonl", progress=False,
                                     generator=Echo(6, 3))
    assert again == out and (st["generated"], st["cached"]) == (0, 16)  # every user turn, the repeated ones too


def test_unreachable_hub_dataset_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cfg = load_config(None, ["data.sources=[{kind: hf_hub, path: no-such-org/no-such-dataset-eagle3}]"])
    with pytest.raises(WorkbookError, match="cannot load dataset 'no-such-org/no-such-dataset-eagle3'.*hf_disk"):
        sources.load_records(cfg)


def test_the_example_row_is_a_reply_that_is_not_a_loop():
    """Notebook 02 shows the first training row whose reply is long enough and not stuck repeating itself (a greedy
    reply looping to the token limit was the example row before)."""
    from eagle3lib.extract.prepare import Prepared
    from eagle3lib.extract.rows import example_row, repeated_share

    loop = [5, 6, 7, 8] * 20
    text = list(range(100, 180))
    assert repeated_share(loop) > 0.9 and repeated_share(text) == 0.0 and repeated_share([1, 2]) == 0.0
    rows = [[1, 2, *loop], [1, 2, *text[:10]], [1, 2, *text]]
    prepared = Prepared(input_ids=rows, loss_mask=[[0, 0] + [1] * (len(r) - 2) for r in rows],
                        conversations=[[]] * 3, categories=[None] * 3, n_train=3, n_val=0, eval_prompts=[])
    assert example_row(prepared) == 2  # not the loop, not the 10-token reply
    assert example_row(Prepared(input_ids=rows[:1], loss_mask=prepared.loss_mask[:1], conversations=[[]],
                                categories=[None], n_train=1, n_val=0, eval_prompts=[])) == 0
    # two replies with the same text, a turn between them: each reply is no loop, so the row is an example
    twice = [1, 2, *text[:40], 3, *text[:40]]
    mask = [0, 0, *[1] * 40, 0, *[1] * 40]
    assert example_row(Prepared(input_ids=[rows[0], twice], loss_mask=[prepared.loss_mask[0], mask],
                                conversations=[[]] * 2, categories=[None] * 2, n_train=2, n_val=0,
                                eval_prompts=[])) == 1


def test_stage_02_counts_looping_replies_and_leaves_them_out_of_the_loss_with_max_repeated_share(smollm2_dir):
    """A reply stuck repeating itself is counted (`looping_replies`) and trained on unless data.max_repeated_share
    takes it out of the loss; the conversation stays as context for its other replies, a conversation of nothing but
    the loop is dropped, and a reply that repeats an earlier turn's text is no loop."""
    from transformers import AutoTokenizer

    from eagle3lib.common.config import load_config

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    loop = "the cat sat on the mat and " * 30
    text = "Paris is the capital of France, and Lyon is its third largest city by population."
    code = "def add(a, b):\n    return a + b  # the sum of two numbers, as the user asked for it"
    user = [{"role": "user", "content": "Tell me a story."}]
    convs = [user + [{"role": "assistant", "content": loop}],
             user + [{"role": "assistant", "content": loop}, {"role": "user", "content": "Where is Paris?"},
                     {"role": "assistant", "content": text}],
             user + [{"role": "assistant", "content": code}, {"role": "user", "content": "Again."},
                     {"role": "assistant", "content": code}]]
    pool = [{"category": c} for c in ("loop", "loop then text", "code twice")]
    unmasked = [m for _, m in rows.tokenize_conversations(tok, convs)]
    (a, b), _ = rows.reply_spans(unmasked[1])
    for share, kept in ((None, ["loop", "loop then text", "code twice"]), (0.3, ["loop then text", "code twice"])):
        stats: dict = {}
        d = load_config(None, ["data.max_length=512"] + ([f"data.max_repeated_share={share}"] if share else [])).data
        ids, masks, convs_kept, cats = rows.training_rows(d, pool, convs, tok, stats)
        assert cats == kept and len(ids) == len(masks) == len(convs_kept) == len(kept)
        assert stats["replies"] == 5 and stats["looping_replies"] == {"over 0.3": 2, "over 0.5": 2}
        assert stats["dropped_rows"] == 3 - len(kept) and stats["masked_replies"] == (2 if share else 0)
        # the loop's reply out of the loss, the answer about Paris in it, the context kept
        expected = unmasked[1][:a] + [0] * (b - a) + unmasked[1][b:] if share else unmasked[1]
        assert masks[cats.index("loop then text")] == expected and sum(expected) > 0
        assert masks[cats.index("code twice")] == unmasked[2]  # the same code in two turns: trained on either way
