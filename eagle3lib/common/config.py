"""The one typed config that flows through every stage: WorkbookConfig, its loading and its overrides.

Why one object: each stage reads the sections it needs and records their hash in its manifest, so a later stage can
tell whether what it reads was made with the same settings. Loaded from YAML (`configs/*.yaml`), overridden by
`section.key=value` strings (the CLI's `-p`, a notebook's `overrides` parameter). Unknown keys and wrong types are
rejected with one line that names the key and the fix. The sections themselves: config_data.py (stages 00-04) and
config_draft.py (stages 05-06).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from eagle3lib.common.config_base import (  # noqa: F401 - the names every stage reads from here
    BENCHMARK_KINDS,
    EMBEDDED_TARGET,
    GENERATED_KINDS,
    PACKAGE_SOURCES,
    Section,
    benchmark_name,
)
from eagle3lib.common.config_data import (  # noqa: F401
    DataSection,
    DataSource,
    ExtractSection,
    InspectSection,
    RunSection,
    TargetSection,
    VerifierSection,
)
from eagle3lib.common.config_draft import (  # noqa: F401
    SERVE_GRID_BOOLS,
    SERVE_GRID_INTS,
    EvaluateSection,
    TrainSection,
)
from eagle3lib.common.errors import WorkbookError

# Where a run lives does not shape what it computes: a run copied under another name (e.g. to train a second draft
# on the same hidden states) keeps valid manifests.
LOCATION_FIELDS = {"run": {"name", "output_root"}}


class WorkbookConfig(Section):
    """Every knob of the pipeline. Sections are named after what they configure; stages declare which they read."""

    run: RunSection = Field(default_factory=RunSection)
    target: TargetSection = Field(default_factory=TargetSection)
    data: DataSection = Field(default_factory=DataSection)
    extract: ExtractSection = Field(default_factory=ExtractSection)
    inspect: InspectSection = Field(default_factory=InspectSection)
    verifier: VerifierSection = Field(default_factory=VerifierSection)
    train: TrainSection = Field(default_factory=TrainSection)
    evaluate: EvaluateSection = Field(default_factory=EvaluateSection)

    @model_validator(mode="after")
    def _cross_checks(self) -> WorkbookConfig:
        if self.extract.backend == "transformers" and (
            self.extract.tensor_parallel_size > 1 or self.extract.pipeline_parallel_size > 1
        ):
            raise ValueError("tensor/pipeline parallel sizes > 1 need extract.backend: vllm")
        if self.train.hidden_states == "spool" and self.train.nproc_per_node > 1:
            raise ValueError("train.hidden_states: spool trains in one process (one loader asks one producer for its "
                             "batches): set train.nproc_per_node: 1, or train.hidden_states: offline to train in "
                             "several")
        if self.evaluate.benchmarks and not {"embedded", "offline", "serve"} & set(self.evaluate.methods):
            raise ValueError("evaluate.benchmarks are measured by the embedded, offline and serve methods: add one of "
                             "them to evaluate.methods")
        if any(src.replies > 1 for src in self.data.sources) and not (
                self.data.self_distill and max(self.data.gen_temperatures or [self.data.gen_temperature]) > 0):
            raise ValueError("data.sources[].replies > 1 samples more replies: it needs data.self_distill: true and a "
                             "temperature above 0 in data.gen_temperatures (e.g. [0.0, 0.0, 0.7])")
        if self.data.gen_engines > 1 and self.data.generator != "vllm":
            raise ValueError(f"data.gen_engines: {self.data.gen_engines} starts that many vLLM engines, but "
                             f"data.generator is {self.data.generator}: set data.generator: vllm, or "
                             "data.gen_engines: 1")
        return self

    def section_hash(self, sections: list[str] | tuple[str, ...]) -> str:
        """A short stable hash of the named sections (or single fields, "section.key": stage 02 reads
        evaluate.benchmarks and nothing else of stage 06's section): what a manifest records so a later stage can
        check it."""
        payload = {name: self._dump(name) for name in sorted(sections)}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def _dump(self, name: str) -> Any:
        section, _, key = name.partition(".")
        dumped = getattr(self, section).model_dump(mode="json", exclude=LOCATION_FIELDS.get(section))
        return dumped[key] if key else dumped

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def closest_key(loc: tuple[Any, ...]) -> str | None:
    """The real key nearest to an unknown one (`train.epochz` → `train.epochs`), from the section it was given in."""
    import difflib

    model: Any = WorkbookConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part)) if isinstance(part, str) else None
        inner = getattr(field, "annotation", None) if field else None
        if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
            return None
        model = inner
    names = list(model.model_fields) + [a for f in model.model_fields.values()
                                        for a in getattr(f.validation_alias, "choices", []) or []]
    match = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6)
    return ".".join([*map(str, loc[:-1]), match[0]]) if match else None


def _format_validation_error(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    if first["type"] == "extra_forbidden":
        near = closest_key(first["loc"])
        fix = f"write '{near}', the nearest key" if near else "remove it or correct its spelling"
        return f"{source}: unknown key '{where}' — fix: {fix} (every key, its default and why: eagle3lib/common/config_data.py and config_draft.py)"
    got = first.get("input")
    got_s = f" (got {got!r})" if got is not None and not isinstance(got, dict) else ""
    msg = first["msg"][:1].lower() + first["msg"][1:]  # pydantic's "Value error, ..."; names and paths as written
    return f"{source}: '{where}' {msg}{got_s} — fix: set {where} to a valid value in {source}"


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise WorkbookError(f"override '{dotted}': '{key}' is not a section", "use section.key=value")
        node = child
    node[keys[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """'train.lr=3e-4' → ('train.lr', 0.0003): the value is read as YAML so numbers, lists and null work."""
    if "=" not in item:
        raise WorkbookError(f"override {item!r} has no '='", "write overrides as section.key=value, e.g. train.epochs=2")
    key, raw = item.split("=", 1)
    return key.strip(), yaml.safe_load(raw) if raw.strip() else ""


REPO_ROOT = Path(__file__).resolve().parents[2]


def resolve_config_path(config: str | Path | None) -> Path | None:
    """A config path as a person gives it: absolute, relative to the current folder, or (as a notebook opened from
    notebooks/ gives it) relative to the repo root; made absolute, so every process of a run reads the same file."""
    if config is None:
        return None
    path = Path(config).expanduser()
    if not path.is_absolute() and not path.exists():
        path = REPO_ROOT / path
    return path.resolve()


def run_overrides(run: str | None, overrides: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The overrides of a run: `overrides`, then `run.name=RUN` when a run name is given (`--run`, a notebook's
    `run` parameter), so that the run name wins over the config's."""
    return list(overrides) + ([f"run.name={run}"] if run else [])


def load_run_config(config: str | Path | None, run: str | None = None,
                    overrides: list[str] | tuple[str, ...] = ()) -> WorkbookConfig:
    """The config of a run as the CLI, a notebook and a torchrun process all name it: path, run name, overrides."""
    return load_config(resolve_config_path(config), run_overrides(run, overrides))


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> WorkbookConfig:
    """Read YAML (or nothing = all defaults), apply `section.key=value` overrides, validate. One clear error on misuse."""
    tree: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        path = Path(path)
        source = str(path)
        if not path.is_file():
            raise WorkbookError(f"config file {path} does not exist", "pass an existing YAML, e.g. configs/demo.yaml")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise WorkbookError(f"{path} is not valid YAML ({e.__class__.__name__})", "fix the YAML syntax") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise WorkbookError(f"{path} must hold a mapping of sections", "see configs/demo.yaml for the layout")
        tree = loaded or {}
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(tree, key, value)
    try:
        return WorkbookConfig.model_validate(tree)
    except ValidationError as e:
        raise WorkbookError(_format_validation_error(e, source if not overrides else f"{source} + overrides")) from None
