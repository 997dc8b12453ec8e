"""Stage 02 data preparation: sources, errors a user can fix, the eval split, the loss mask on SmolLM2's real chat
template, truncation, and self-distillation with its resume cache."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from eagle3lib import data
from eagle3lib.config import load_config
from eagle3lib.errors import WorkbookError


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def chat(i: int, turns: int = 1) -> dict:
    msgs = []
    for t in range(turns):
        msgs += [{"role": "user", "content": f"Question {i}.{t}: what is {i} plus {t}?"},
                 {"role": "assistant", "content": f"{i} plus {t} is {i + t}."}]
    return {"messages": msgs, "category": ["a", "b", "c"][i % 3]}


@pytest.fixture(scope="module")
def smol_tok(smollm2_dir):
    return data.load_tokenizer(load_config(None), smollm2_dir)


def test_bundled_prompt_set_is_large_varied_and_valid():
    recs = data.read_jsonl(data.bundled_prompts_path())
    assert len(recs) >= 300
    cats = Counter(r["category"] for r in recs)
    assert {"code", "math", "reasoning", "chat", "writing", "multilingual"} <= set(cats)
    assert min(cats.values()) >= 25
    assert len({data.prompt_key(r["messages"]) for r in recs}) == len(recs)  # no duplicates
    scripts = "".join(r["messages"][0]["content"] for r in recs if r["category"] == "multilingual")
    assert any("\u4e00" <= ch <= "\u9fff" for ch in scripts) and any("\u0400" <= ch <= "\u04ff" for ch in scripts)


def test_malformed_records_name_the_line_and_the_fix(tmp_path):
    good = json.dumps(chat(0))
    with pytest.raises(WorkbookError, match=r"bad.jsonl:3: not valid JSON"):
        data.read_jsonl(write_jsonl(tmp_path / "bad.jsonl", [good, "", '{"messages": [}']))
    with pytest.raises(WorkbookError, match=r"roles.jsonl:2, turn 1: unknown role 'robot'"):
        data.read_jsonl(write_jsonl(tmp_path / "roles.jsonl", [good, {"messages": [
            {"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]}]))
    with pytest.raises(WorkbookError, match=r"empty.jsonl:1, turn 1 \(assistant\): empty turn"):
        data.read_jsonl(write_jsonl(tmp_path / "empty.jsonl", [{"messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]}]))
    with pytest.raises(WorkbookError, match="no 'messages'"):
        data.read_jsonl(write_jsonl(tmp_path / "keys.jsonl", [{"text": "hello"}]))
    with pytest.raises(WorkbookError, match="does not exist"):
        data.read_jsonl(tmp_path / "missing.jsonl")


def test_sharegpt_and_hf_disk_sources(tmp_path):
    from datasets import Dataset

    share = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                               {"from": "gpt", "value": "Hello!"}]}
    recs = data.read_jsonl(write_jsonl(tmp_path / "s.jsonl", [share]))
    assert recs[0]["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                   {"role": "assistant", "content": "Hello!"}]
    Dataset.from_list([chat(i) for i in range(5)]).save_to_disk(str(tmp_path / "hf"))
    cfg = load_config(None, [f"data.sources=[{{kind: hf_disk, path: {tmp_path / 'hf'}, limit: 3}}, "
                             f"{{kind: jsonl, path: {tmp_path / 's.jsonl'}}}]"])
    recs = data.load_records(cfg)
    assert len(recs) == 4 and recs[0]["messages"] == chat(0)["messages"] and recs[-1]["source"] == "s.jsonl"


def test_eval_split_is_first_disjoint_stratified_and_seeded():
    recs = [chat(i) for i in range(30)]
    recs.append({"messages": [{"role": "user", "content": "Question 4.0: what is 4 plus 0?"},
                              {"role": "assistant", "content": "4"}], "category": "a"})  # shares a prompt with #4
    evals, train = data.split_eval(recs, 6, seed=0)
    assert Counter(r["category"] for r in evals) == {"a": 2, "b": 2, "c": 2}
    held = {m["content"] for r in evals for m in r["messages"] if m["role"] == "user"}
    assert not any(m["content"] in held for r in train for m in r["messages"] if m["role"] == "user")
    assert data.split_eval(recs, 6, seed=0)[0] == evals and data.split_eval(recs, 6, seed=1)[0] != evals
    if any("Question 4.0" in m["content"] for r in evals for m in r["messages"]):
        assert len(train) == 31 - 6 - 1  # the duplicate prompt is not trained on either
    with pytest.raises(WorkbookError, match="leaves no training data"):
        data.split_eval(recs[:3], 3, seed=0)


def test_loss_mask_covers_exactly_the_assistant_turns_on_smollm2(smol_tok):
    conv = chat(7, turns=2)["messages"]
    conv.insert(0, {"role": "system", "content": "You answer sums."})
    ids, mask = data.tokenize_conversation(smol_tok, conv, 10_000)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    trained = smol_tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert trained == "7 plus 0 is 7.<|im_end|>\n7 plus 1 is 8.<|im_end|>\n"
    context = smol_tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert "Question 7.0" in context and "assistant" in context and "plus 0 is" not in context
    # the whole sequence is the template's own tokenization
    assert ids == smol_tok.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]
    short_ids, short_mask = data.tokenize_conversation(smol_tok, conv, 40)
    assert short_ids == ids[:40] and short_mask == mask[:40]


def test_prepare_without_replies_asks_for_self_distillation(tmp_path, smollm2_dir):
    src = write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": f"Say {i}"}]} for i in range(6)])
    cfg = load_config(None, [f"data.sources=[{{kind: jsonl, path: {src}}}]", "data.self_distill=false",
                             "data.eval_samples=2"])
    with pytest.raises(WorkbookError, match="self_distill=true"):
        data.prepare(cfg, smollm2_dir, tmp_path / "data")


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
    p = data.prepare(cfg, smollm2_dir, ddir, progress=False)
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
    again = data.prepare(cfg, smollm2_dir, ddir, progress=False)
    assert again.stats["self_distill"] == {**again.stats["self_distill"], "generated": 0, "cached": 6}
    assert again.input_ids == p.input_ids and again.loss_mask == p.loss_mask
    # "France" is greedy SmolLM2's answer to one of them, if that prompt was not held out
    replies = {c[0]["content"]: c[-1]["content"] for c in p.conversations}
    if "What is the capital of France?" in replies:
        assert "Paris" in replies["What is the capital of France?"]


def test_unreachable_hub_dataset_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cfg = load_config(None, ["data.sources=[{kind: hf_hub, path: no-such-org/no-such-dataset-eagle3}]"])
    with pytest.raises(WorkbookError, match="cannot load dataset 'no-such-org/no-such-dataset-eagle3'.*hf_disk"):
        data.load_records(cfg)
