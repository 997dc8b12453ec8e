"""Bad input gets one clear error that names the problem and the fix, and loses nothing already written.

Bad config: one line naming the problem and the fix, exit 2, nothing left behind (unknown keys, wrong types, layer
ids out of range / not increasing, a missing model: tests/unit/test_foundation.py). Bad data: property-based tests
of the data reader (prompts with no assistant turn and self-distillation off: tests/unit/test_data.py). Faults
really caused (a killed run, a full disk, corrupt shards) and untrusted files: test_reliability.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.rundir import REPO_ROOT

# ---------------------------------------------------------------------------------------------------------------------
# Bad config: one line naming the problem and the fix, exit 2, nothing left behind
# (unknown keys, wrong types, layer ids out of range / not increasing, a missing model: tests/unit/test_foundation.py)
# ---------------------------------------------------------------------------------------------------------------------


def _preflight_error(tmp_path, *overrides: str) -> str:
    from eagle3lib.runner import preflight

    with pytest.raises(WorkbookError) as err:
        preflight(None, [f"run.output_root={tmp_path / 'out'}", *overrides])
    assert not (tmp_path / "out").exists()  # checked before the run folder is made
    msg = str(err.value)
    assert "\n" not in msg and " — fix: " in msg
    return msg


def test_draft_vocab_larger_than_the_target_is_refused(tmp_path, tiny_llama_dir):
    msg = _preflight_error(tmp_path, f"target.model={tiny_llama_dir}", "target.layer_ids=[1, 2, 3]",
                           "verifier.draft_vocab_size=513")
    assert "draft_vocab_size=513 is larger than the target's vocabulary (512 tokens)" in msg and "at most 512" in msg


@pytest.mark.parametrize("content, expected", [
    ("not json {", "JSONDecodeError"),
    ("[1, 2]", "not an object"),
    ('{"model_type": "llama", "hidden_size": 64}', "no num_hidden_layers, vocab_size"),
    ('{"num_hidden_layers": "many", "hidden_size": 64, "vocab_size": 10}', "ValueError"),
])
def test_a_folder_whose_config_is_not_a_model_is_refused(tmp_path, content, expected):
    model = tmp_path / "not-a-model"
    model.mkdir()
    (model / "config.json").write_text(content)
    msg = _preflight_error(tmp_path, f"target.model={model}")
    assert "is not a language model's config" in msg and expected in msg, msg


def test_a_tokenizer_that_does_not_belong_to_the_model_is_refused(tmp_path, tiny_llama_dir, smollm2_dir):
    msg = _preflight_error(tmp_path, f"target.model={tiny_llama_dir}", "target.layer_ids=[1, 2, 3]",
                           "verifier.draft_vocab_size=256", f"target.tokenizer={smollm2_dir}")
    assert "has 49152 tokens but the model's vocabulary has 512" in msg and "target.tokenizer" in msg
    msg = _preflight_error(tmp_path, f"target.model={tiny_llama_dir}", "target.layer_ids=[1, 2, 3]",
                           "verifier.draft_vocab_size=256", f"target.tokenizer={tmp_path}")
    assert "no tokenizer loads from" in msg


def test_cli_bad_input_exits_2_with_one_line_and_no_run_folder(tmp_path, tiny_llama_dir):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "eagle3lib.cli", "run", "--config", "configs/demo.yaml", "-q",
                           "-p", f"run.output_root={out}", "-p", f"target.model={tiny_llama_dir}",
                           "-p", "target.layer_ids=[1, 2, 3]", "-p", "verifier.draft_vocab_size=100000"],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "draft_vocab_size=100000" in lines[0] and "fix:" in lines[0], proc.stderr
    assert not out.exists()


def test_the_shipped_configs_pass_the_new_checks(tmp_path, smollm2_dir):
    from eagle3lib.runner import preflight

    rd = preflight(REPO_ROOT / "configs/demo.yaml", [f"run.output_root={tmp_path}"])
    assert rd.root.is_dir()


# ---------------------------------------------------------------------------------------------------------------------
# Bad data: property-based (hypothesis) against eagle3lib.common.sources.normalize_record / read_jsonl
# (prompts with no assistant turn and self-distillation off: tests/unit/test_data.py; over-long conversations are
# truncated to data.max_length by design, tests/unit/test_data.py::test_loss_mask_covers_exactly_the_assistant_turns...)
# ---------------------------------------------------------------------------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402 - beside the tests that use it
from hypothesis import strategies as st  # noqa: E402

from eagle3lib.common import sources  # noqa: E402

CANONICAL = {"system", "user", "assistant"}
text = st.text(min_size=1, max_size=40).filter(lambda t: t.strip() != "")
role_names = st.sampled_from(sorted(sources.ROLE_ALIASES)).flatmap(
    lambda r: st.sampled_from([r, r.upper(), r.capitalize()]))


@st.composite
def valid_records(draw):
    """An OpenAI-messages or ShareGPT record with at least one user turn (roles in any known alias and case)."""
    turns = draw(st.lists(st.tuples(role_names, text), min_size=0, max_size=5))
    at = draw(st.integers(0, len(turns)))
    turns.insert(at, (draw(st.sampled_from(["user", "human", "USER"])), draw(text)))
    sharegpt = draw(st.booleans())
    key, rk, ck = ("conversations", "from", "value") if sharegpt else ("messages", "role", "content")
    rec = {key: [{rk: r, ck: c} for r, c in turns]}
    if draw(st.booleans()):
        rec["category"] = draw(st.sampled_from(["code", "math", None]))
    return rec, [(sources.ROLE_ALIASES[r.lower()], c) for r, c in turns]


def _break(rec: dict, how: str, j: int, junk: str) -> tuple[object, str]:
    """One malformation of a valid record, and the words the error must contain."""
    key = "conversations" if "conversations" in rec else "messages"
    rk, ck = ("from", "value") if key == "conversations" else ("role", "content")
    turns = [dict(t) for t in rec[key]]
    j = j % len(turns)
    if how == "unknown role":
        turns[j][rk] = junk
        return {key: turns}, f"turn {j}: unknown role"
    if how == "empty turn":
        turns[j][ck] = junk if not junk.strip() else "   "
        return {key: turns}, f"turn {j} ("
    if how == "content not text":
        turns[j][ck] = [junk]
        return {key: turns}, f"turn {j} ("
    if how == "turn not an object":
        turns[j] = junk
        return {key: turns}, f"turn {j}: expected an object"
    if how == "no turns":
        return {key: []}, "empty or not a list"
    if how == "no user turn":
        return {key: [{rk: "assistant", ck: "hi"}]}, "no user turn"
    if how == "no messages field":
        return {"text": junk}, "no 'messages'"
    return [rec], "expected a JSON object"  # "not an object"


BREAKS = ["unknown role", "empty turn", "content not text", "turn not an object", "no turns", "no user turn",
          "no messages field", "not an object"]
junk_role = st.text(max_size=12).filter(lambda r: r.lower() not in sources.ROLE_ALIASES)
HSETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@HSETTINGS
@given(valid_records())
def test_every_valid_record_round_trips(case):
    rec, expected = case
    out = sources.normalize_record(rec, "x.jsonl:1")
    assert [(m["role"], m["content"]) for m in out["messages"]] == expected
    assert {m["role"] for m in out["messages"]} <= CANONICAL
    assert sources.normalize_record(json.loads(json.dumps(out)), "again") == out  # normalizing twice changes nothing


@HSETTINGS
@given(st.lists(valid_records(), min_size=1, max_size=6), st.data())
def test_every_malformed_line_is_named_and_valid_files_round_trip(tmp_path, records, draw):
    import uuid

    path = tmp_path / f"{uuid.uuid4().hex}.jsonl"
    lines = [json.dumps(r, ensure_ascii=draw.draw(st.booleans())) for r, _ in records]
    path.write_text("\n".join(lines) + "\n")
    got = sources.read_jsonl(path)
    assert [[(m["role"], m["content"]) for m in g["messages"]] for g in got] == [e for _, e in records]

    bad_at = draw.draw(st.integers(0, len(lines)))  # 0-based position of the bad line
    how = draw.draw(st.sampled_from([*BREAKS, "not JSON"]))
    if how == "not JSON":
        bad, needle = draw.draw(st.sampled_from(['{"messages": [}', "{", "messages", '{"a": 1,}', "[1, 2"])), \
            "not valid JSON"
    else:
        junk = draw.draw(junk_role if how == "unknown role" else st.text(max_size=8))
        obj, needle = _break(records[bad_at % len(records)][0], how, draw.draw(st.integers(0, 9)), junk)
        bad = json.dumps(obj)
    path.write_text("\n".join([*lines[:bad_at], bad, *lines[bad_at:]]) + "\n")
    with pytest.raises(WorkbookError) as err:
        sources.read_jsonl(path)
    msg = str(err.value)
    assert f"{path}:{bad_at + 1}" in msg and needle in msg and " — fix: " in msg, (how, msg)
