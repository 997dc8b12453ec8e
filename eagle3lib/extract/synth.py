"""Stage 02, synthetic prompts (`data.sources: [{kind: self_instruct | magpie, limit: N}]`): the target writes user
requests.

Why: a few hundred bundled prompts do not teach a draft the target's distribution; no dataset can be downloaded.
The target itself writes the requests, so the training set is as large and varied as the budget allows.

How: the target does not follow a meta-instruction ("write a request about X") well at 135M parameters (measured:
most replies were answers, greetings or stories). What it does well is what it was trained on — continue a chat. So
the rendered chat is cut open right at the start of a USER turn (`open_user_turn`): the target writes that user
turn. The two kinds differ only in what comes before the cut:
- `self_instruct`: a system turn describes the conversation ("the user, a student, asks you to explain a concept,
  about black holes"), seeded by a topic list (eagle3lib/assets/topics.json: ~280 topics in 23 areas, 26 task types,
  16 personas): steered, spread over the topics;
- `magpie` (Xu et al. 2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with
  Nothing"; how speculators built the data of its Qwen3-8B draft): nothing but the chat template's own prefix up to a
  user turn (its default system turn included, where it inserts one): the requests the target itself expects, with
  no seed text in them.
Both share one loop (`write_requests`): cleaning, dedup, the cache, rounds to top up. Multi-turn follow-ups use the
same trick on a distilled conversation (`add_followups`).

Strictly apart from evaluation: generated prompts are training-only (the eval split is taken from the other sources
before any generation), and a generated prompt that overlaps a held-out or benchmark prompt (eagle3lib.extract.dedup:
normalized text, equal or one inside the other) is dropped. Every draw is cached (data/self_instruct_cache.jsonl,
both kinds) keyed by its settings (its kind among them) and draw index.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterable
from importlib import resources
from pathlib import Path
from typing import Any

from eagle3lib.common.config import DataSource, WorkbookConfig
from eagle3lib.common.errors import WorkbookError
from eagle3lib.extract.dedup import EvalIndex, normalize
from eagle3lib.extract.generators import Generator, cache_key, finish_stats, generate_cached, new_stats, read_cache

TOPICS = "topics.json"
SENTINEL = "\x00EAGLE3-OPEN-TURN\x00"
MIN_CHARS, MAX_CHARS, MIN_WORDS = 16, 2000, 4
ROUNDS = 6  # generation rounds to top up after cleaning drops some draws

_LABEL = re.compile(r"^\s*(?:\*\*)?(?:user|request|prompt|question|query|input|output|task|example|message|q|a)"
                    r"(?:\s*\d+)?\s*(?:\*\*)?\s*:\s*(?:\*\*)?\s*", re.IGNORECASE)
_HERE = re.compile(r"^\s*(?:sure|okay|ok|certainly|here(?:'s| is| are)[^:\n]{0,60}):\s*\n*", re.IGNORECASE)
# the target answering instead of asking (it sometimes takes the assistant's voice in the user turn)
_ASSISTANT_VOICE = re.compile(r"^(?:i'?m (?:sure|happy|glad|ready) (?:i can|to)|i'?d be (?:happy|glad)|of course|"
                              r"absolutely|as an ai|great question|what a (?:great|delightful|wonderful)|(?:yes|no)\b[,.!])",
                              re.IGNORECASE)
_TRAILING_ANSWER = re.compile(r"\s*(?:A|Answer|Assistant)\s*:\s*$")  # "...? A:" (the template of a Q&A dataset)
# the target writing a question AND its answer, Q&A-dataset style ("...?\nA: Vienna", "...\n\nAssistant: The..."):
# a quarter of Qwen2.5-Coder-1.5B's magpie requests in the 4x data's run (docs/results.md); the question is kept,
# the answer it brought is cut.
# Not when a "B" line follows: lettered choices
_EMBEDDED_ANSWER = re.compile(r"\n\s*(?:A|Answer|Assistant)\s*:", re.IGNORECASE)
_CHOICE_B = re.compile(r"\n\s*\(?B\s*[:.)]")
_QUOTES = "\"'“”‘’`«»"


def topics_path(src: DataSource | None = None) -> Path:
    if src is not None and src.path:
        return Path(src.path).expanduser()
    return Path(str(resources.files("eagle3lib") / "assets" / TOPICS))


def load_seeds(path: Path) -> dict[str, list[str]]:
    """{"topics": [...], "tasks": [...], "personas": [...]} from a topics JSON (topics: a list or {area: list})."""
    if not path.is_file():
        raise WorkbookError(f"self_instruct topics file {path} does not exist",
                            "point data.sources[].path at a JSON like eagle3lib/assets/topics.json (or leave it null)")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise WorkbookError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})", "fix the file") from None
    topics = obj.get("topics") if isinstance(obj, dict) else None
    if isinstance(topics, dict):
        topics = [t for area in topics.values() for t in area]
    tasks = obj.get("tasks") if isinstance(obj, dict) else None
    if not (isinstance(topics, list) and topics and isinstance(tasks, list) and tasks):
        raise WorkbookError(f"{path}: needs non-empty 'topics' (list or {{area: list}}) and 'tasks' lists",
                            "see eagle3lib/assets/topics.json for the layout")
    personas = obj.get("personas") or ["a user"]
    return {"topics": [str(t) for t in topics], "tasks": [str(t) for t in tasks], "personas": [str(p) for p in personas]}


def open_user_turn(tok: Any, messages: list[dict[str, str]]) -> str:
    """The chat rendered up to the first character of a new user turn (its role header included): the target's
    continuation is that user's message. Works for any template that puts a turn's content in verbatim."""
    full = tok.apply_chat_template([*messages, {"role": "user", "content": SENTINEL}], tokenize=False)
    cut = full.find(SENTINEL)
    if cut < 0:
        raise WorkbookError("the chat template does not render a user turn's content verbatim",
                            "use a target with a standard chat template for self_instruct and magpie sources")
    return full[:cut]


def request_system(topic: str, task: str, persona: str) -> str:
    return (f"You are a helpful AI assistant. In this conversation the user, {persona}, asks you to {task}, "
            f"about {topic}.")


def clean_request(text: str, finished: bool) -> tuple[str | None, str]:
    """(cleaned request or None, reason). Drops cut-off, too short/long and degenerate (repetitive) text; strips
    labels ("Request:", "Here's a possible question:"), an answer written after the question ("\nA: ...") and
    surrounding quotes the target sometimes adds."""
    if not finished:
        return None, "truncated"
    t = text.strip()
    for _ in range(3):
        t = _HERE.sub("", _LABEL.sub("", t)).strip()
    t = _TRAILING_ANSWER.sub("", t)
    answer = _EMBEDDED_ANSWER.search(t)
    if answer and not _CHOICE_B.search(t, answer.end()):
        t = t[:answer.start()].rstrip()
    if len(t) >= 2 and t[0] in _QUOTES and t[-1] in _QUOTES:
        t = t[1:-1].strip()
    words = t.split()
    if _ASSISTANT_VOICE.match(t):
        return None, "assistant_voice"
    if len(t) < MIN_CHARS or len(words) < MIN_WORDS:
        return None, "short"
    if len(t) > MAX_CHARS:
        return None, "long"
    lines = [ln.strip() for ln in t.splitlines() if ln.strip()]
    if (len(words) >= 20 and len({w.lower() for w in words}) / len(words) < 0.35) or \
            (len(lines) >= 4 and len(set(lines)) / len(lines) < 0.5):
        return None, "degenerate"
    return t, "kept"


def eval_index(evals: EvalIndex | Iterable[str]) -> EvalIndex:
    """The evaluation prompts a generated text must not overlap: stage 02's index, or texts (held-out prompts)."""
    return evals if isinstance(evals, EvalIndex) else EvalIndex().add("held_out", evals)


def draw(seed: int, src_index: int, i: int, seeds: dict[str, list[str]]) -> tuple[str, str, str]:
    """(topic, task, persona) of draw i: its own RNG, so a draw never depends on how many came before it."""
    rng = random.Random(f"{seed}:{src_index}:{i}")
    return rng.choice(seeds["topics"]), rng.choice(seeds["tasks"]), rng.choice(seeds["personas"])


def self_instruct(cfg: WorkbookConfig, src: DataSource, src_index: int, gen: Generator, tok: Any,
                  evals: EvalIndex | Iterable[str], train_texts: list[str], cache_path: Path,
                  progress: bool = True) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`src.limit` requests (`write_requests`), each draw's chat opened under a system turn that describes it (a
    topic, task and persona drawn from the topics file); the records name the topic and the task."""
    seeds = load_seeds(topics_path(src))

    def prompt(j: int) -> tuple[str, dict[str, str]]:
        topic, task, persona = draw(cfg.run.seed, src_index, j, seeds)
        system = {"role": "system", "content": request_system(topic, task, persona)}
        return open_user_turn(tok, [system]), {"topic": topic, "task": task}

    return write_requests(cfg, src, src_index, gen, evals, train_texts, cache_path, prompt, progress)


def magpie(cfg: WorkbookConfig, src: DataSource, src_index: int, gen: Generator, tok: Any,
           evals: EvalIndex | Iterable[str], train_texts: list[str], cache_path: Path,
           progress: bool = True) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`src.limit` requests (`write_requests`) from nothing but the chat template's own prefix up to a user turn (a
    default system turn included where the template inserts one): Magpie (Xu et al. 2024), the target's own
    distribution of requests, with no seed text to steer or narrow it. Every draw sees the same text: its index in
    the cache key tells the draws apart, sampling makes them differ (hence a temperature above 0, config.py)."""
    text = open_user_turn(tok, [])
    return write_requests(cfg, src, src_index, gen, evals, train_texts, cache_path, lambda j: (text, {}), progress)


WRITERS = {"self_instruct": self_instruct, "magpie": magpie}  # config.GENERATED_KINDS: the prompt of each draw


def write_requests(cfg: WorkbookConfig, src: DataSource, src_index: int, gen: Generator,
                   evals: EvalIndex | Iterable[str], train_texts: list[str], cache_path: Path,
                   prompt: Callable[[int], tuple[str, dict[str, Any]]],
                   progress: bool = True) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`src.limit` cleaned, unique user requests written by the target (records of kind `src.kind`) and stats;
    `prompt(j)` is draw j's rendered text, cut open at a user turn, and the fields its record adds.

    Draws are generated in rounds until enough survive cleaning (at most ROUNDS rounds, each asking for the
    missing number plus a margin), so the result is the same for a seed however often the run was killed. A draw
    is cached by its text, its index and the source's settings (its kind among them).
    """
    import time

    from tqdm.auto import tqdm

    if src.limit is None or src.limit <= 0:
        raise WorkbookError(f"a {src.kind} data source needs limit: how many prompts to generate",
                            f"set data.sources[].limit, e.g. {{kind: {src.kind}, limit: 2000}}")
    settings = {"model": cfg.target.model, "kind": src.kind, "temperature": src.temperature,
                "max_new_tokens": src.max_new_tokens, "seed": cfg.run.seed, "dtype": cfg.target.dtype}
    cache = read_cache(cache_path)
    index = eval_index(evals)
    seen = {normalize(t) for t in train_texts}
    reasons = ("truncated", "short", "long", "degenerate", "assistant_voice", "duplicate", "eval_overlap")
    stats: dict[str, Any] = {**new_stats(), "kind": src.kind, "requested": src.limit, "draws": 0,
                             "dropped": dict.fromkeys(reasons, 0)}
    out: list[dict[str, Any]] = []
    bar = tqdm(total=0, desc=src.kind.replace("_", "-"), unit="draw", disable=not progress)  # generated or cached
    t0 = time.time()
    i = 0
    try:
        for rnd in range(ROUNDS):
            need = src.limit - len(out)
            if need <= 0:
                break
            # on SmolLM2 ~75% of self_instruct draws survive cleaning, ~94% of magpie's at 0.8
            n = 2 * need + 2 if rnd else need + max(2, need // 4)
            items, meta = [], {}
            for j in range(i, i + n):
                text, fields = prompt(j)
                key = cache_key([text, j], settings)
                items.append((key, text, src.temperature))
                meta[key] = fields
            i += n
            bar.total += n
            bar.refresh()
            replies = generate_cached(gen, items, src.max_new_tokens, cfg.run.seed, cache, cache_path, stats, bar)
            for key, _, _ in items:
                if len(out) >= src.limit:
                    break
                r = replies[key]
                stats["draws"] += 1
                req, why = clean_request(r.text, r.finished)
                if req is not None:
                    norm = normalize(req)
                    why = "duplicate" if norm in seen else "eval_overlap" if index.matches(req) else "kept"
                if why != "kept":
                    stats["dropped"][why] += 1
                    continue
                seen.add(norm)
                out.append({"messages": [{"role": "user", "content": req}], "category": src.kind,
                            "source": src.kind, **meta[key], "synth_source": src_index,
                            **({"replies": src.replies} if src.replies > 1 else {})})
            bar.set_postfix_str(f"{len(out)}/{src.limit} kept")
    finally:
        bar.close()
    stats["kept"] = len(out)
    return out, finish_stats(stats, t0)


def add_followups(cfg: WorkbookConfig, gen: Generator, tok: Any, convs: list[list[dict[str, str]]],
                  chosen: list[int], evals: EvalIndex | Iterable[str], cache_path: Path, temperature: float,
                  max_new_tokens: int) -> tuple[list[list[dict[str, str]]], dict[str, Any]]:
    """A second user turn, written by the target after the distilled first reply, for the conversations `chosen`
    (cleaned like a request; dropped when unusable). The caller self-distills again: turn 1 comes from the cache."""
    import time

    settings = {"model": cfg.target.model, "kind": "followup", "temperature": temperature,
                "max_new_tokens": max_new_tokens, "seed": cfg.run.seed, "dtype": cfg.target.dtype}
    cache = read_cache(cache_path)
    index = eval_index(evals)
    stats: dict[str, Any] = {**new_stats(), "asked": len(chosen), "added": 0}
    t0 = time.time()
    items = []
    for ci in chosen:
        text = open_user_turn(tok, convs[ci])
        items.append((cache_key(text, settings), text, temperature))
    replies = generate_cached(gen, items, max_new_tokens, cfg.run.seed, cache, cache_path, stats)
    out = list(convs)
    for ci, (key, _, _) in zip(chosen, items, strict=True):
        req, _why = clean_request(replies[key].text, replies[key].finished)
        if req is None or index.matches(req):
            continue
        out[ci] = [*convs[ci], {"role": "user", "content": req}]
        stats["added"] += 1
    return out, finish_stats(stats, t0)
