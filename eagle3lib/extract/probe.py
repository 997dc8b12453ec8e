"""Stage 02's capture probe: a few real rows through the configured backend and engine, checked for self-consistency
before the first shard is written (seconds, not minutes). This module runs the rows and writes the report;
eagle3lib.extract.probe_checks judges what came back (which checks, their tolerances, why each).

Why: a capture can go wrong without an error, and CI's parity tests cover only tiny targets on one vLLM version.
Known silent failures: vLLM's extract_hidden_states dropped the final-layer state on the DeepSeek family (vllm#46973),
is off by one layer on MiniMax-M2 (vllm#43671), returns another number of states than tokens with prefix caching on
(vllm#44485), gives other states under chunked prefill at TP8/PP2 (vllm#52909); a decoder layer's `out[0]` without
the residual gives cos -0.28; vLLM's CPU rotary op on MLA gives cos 0.5-0.7 (docs/cpu.md#the-cpu-rotary-bug). So
stage 02 runs `extract.probe_rows` rows of the user's own data (the longest first: long prompts are where chunked
prefill splits) through the very backend that will run the extraction, and checks the final state against the
engine's own next-token distribution, each slot against its layer in a second capture path where one runs, and the
structure (probe_checks says each in full).

A failure stops the stage with one WorkbookError naming the check, the slot and layer id, the row, the measured
numbers against the tolerance and the likely causes; the full report goes to `<run>/capture_probe.failed.json` and
no shard is written. A pass writes `<run>/capture_probe.json` (notebook 02 shows it as a table, notebook 03 and the
report card in one line).

Cost: what the extraction waits for is the probe rows' capture (through the same engine, before the first
request of the extraction), not its judging. The probe rows are captured once: their captures (files or tensors) are
kept and become their shards (`Pending.kept`); the judging — the CPU reference, the checkpoint's head, the checks —
runs on a thread beside the extraction, and the shard writer holds every shard until the verdict
(shard_writer.ShardWriter's gate), so a failure still leaves no shard; reading the captures back (files, logprobs) is
part of the judging. For an 8B shape on an H200 the extraction waits 0.9-1.0 s (worker) / 1.4 s (native) for it,
net of the rows it no longer captures 0.7-0.8 s / 1.15 s, under 2% of the benchmark's run
(docs/capture.md#the-capture-probe says where the seconds go).
Data-parallel transformers capture probes on one more load of the target on the first GPU, before its processes
start, and waits for the verdict there (the processes write their shards themselves).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3lib.common import atomic
from eagle3lib.common.checkpoint_head import read_checkpoint_head
from eagle3lib.common.config import WorkbookConfig
from eagle3lib.common.errors import WorkbookError

# The judging lives in probe_checks; its names stay importable from here (eagle3lib.extract.probe.<name>).
from eagle3lib.extract.probe_checks import CAUSES as CAUSES
from eagle3lib.extract.probe_checks import FIRST_ROW_POSITIONS as FIRST_ROW_POSITIONS
from eagle3lib.extract.probe_checks import ORDER as ORDER
from eagle3lib.extract.probe_checks import POSITIONS_PER_ROW as POSITIONS_PER_ROW
from eagle3lib.extract.probe_checks import TOLERANCES as TOLERANCES
from eagle3lib.extract.probe_checks import TOP_K as TOP_K
from eagle3lib.extract.probe_checks import Check as Check
from eagle3lib.extract.probe_checks import EngineDist as EngineDist
from eagle3lib.extract.probe_checks import Observed as Observed
from eagle3lib.extract.probe_checks import SecondPath as SecondPath
from eagle3lib.extract.probe_checks import Tolerance as Tolerance
from eagle3lib.extract.probe_checks import check_final as check_final
from eagle3lib.extract.probe_checks import check_layers as check_layers
from eagle3lib.extract.probe_checks import check_structure as check_structure
from eagle3lib.extract.probe_checks import compared as compared
from eagle3lib.extract.probe_checks import failure as failure
from eagle3lib.extract.probe_checks import judge as judge
from eagle3lib.extract.probe_checks import positions as positions
from eagle3lib.extract.probe_checks import tolerance_class as tolerance_class

REPORT_FILE = "capture_probe.json"
FAILED_FILE = "capture_probe.failed.json"
REFERENCE_TOKENS = 256  # a second path's states are compared on each row's first tokens (causal: the row's own)
REFERENCE_AUTO_MAX_BYTES = 4 * 1024**3  # vLLM backends: a transformers reference on the CPU up to this checkpoint size


# ------------------------------------------------------------------------------------------------ what to probe
def probe_rows(input_ids: list[list[int]], n: int) -> list[int]:
    """`n` row indices: the longest row first (prompt logprobs cover its every position), then rows spread evenly
    over the length-sorted rest (short and long prompts, several sharing the chat template's prefix)."""
    order = sorted(range(len(input_ids)), key=lambda i: (-len(input_ids[i]), i))
    if n >= len(order):
        return order
    if n == 1:
        return order[:1]
    picked = [order[round(j * (len(order) - 1) / (n - 1))] for j in range(n)]
    return list(dict.fromkeys(picked))


def reference_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    """The ids a second path captures: each configured id and its neighbours (so a slot holding a neighbour is named
    as such), within 0..N (N = the last layer's pre-norm output)."""
    return sorted({j for k in layer_ids for j in (k - 1, k, k + 1) if 0 <= j <= num_layers})


def compute_dtype(cfg: WorkbookConfig, backend: Any) -> str:
    """The dtype the backend's forward runs in: the transformers backend's own, else what `target.dtype` gives a
    vLLM engine on this machine (eagle3lib.common.device)."""
    if isinstance(getattr(backend, "compute_dtype", None), torch.dtype):
        return str(backend.compute_dtype).removeprefix("torch.")
    from eagle3lib.common.device import dtype_name

    return dtype_name(cfg.target.dtype)


# ---------------------------------------------------------------------------------------------------- reading
def _read_states(captured: Iterable[tuple[int, Any]], file_ids: dict[int, list[int]],
                 keep: frozenset[int] = frozenset()) -> dict[int, torch.Tensor]:
    """Captured rows as tensors; a states file the backend handed on (its final shard-to-be) is read and its token
    ids kept for the check. A row in `keep` keeps its file (the extraction takes it as that row's shard once the
    probe passed); any other row's file is deleted."""
    from safetensors.torch import load_file

    out: dict[int, torch.Tensor] = {}
    for row, states in captured:
        if isinstance(states, Path):
            data = load_file(str(states))
            if row not in keep:
                states.unlink(missing_ok=True)
            file_ids[row] = data["token_ids"].tolist()
            states = data["hidden_states"]
        out[row] = states  # in the storage dtype: each check converts what it reads
    return out


def _dist_from_vllm(out: Any, length: int) -> EngineDist:
    """An output's logprobs by position q (the distribution after token q): prompt_logprobs[q + 1] for q < T - 1,
    the sampled token's logprobs for q = T - 1. Top-k entries only (vLLM adds the prompt token to each)."""
    by_pos: dict[int, Any] = {}
    prompt = getattr(out, "prompt_logprobs", None)
    if prompt:
        for q in range(length - 1):
            if q + 1 < len(prompt) and prompt[q + 1]:
                by_pos[q] = prompt[q + 1]
    sample = out.outputs[0].logprobs if out.outputs else None
    if sample:
        by_pos[length - 1] = sample[0]
    pos = sorted(by_pos)
    ids = torch.zeros(len(pos), TOP_K, dtype=torch.int64)
    lps = torch.full((len(pos), TOP_K), float("nan"))
    for i, q in enumerate(pos):
        entries = sorted(by_pos[q].items(), key=lambda kv: (getattr(kv[1], "rank", None) or 1 << 30,
                                                             -kv[1].logprob))[:TOP_K]
        for j, (tok, lp) in enumerate(entries):
            ids[i, j], lps[i, j] = int(tok), float(lp.logprob)
    return EngineDist(pos, ids, lps)


def _dist_from_logits(logits: torch.Tensor, pos: list[int]) -> EngineDist:
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = lp.topk(min(TOP_K, lp.shape[-1]), dim=-1)
    return EngineDist(list(pos), top.indices, top.values)


def observe(cfg: WorkbookConfig, backend: Any, model_dir: Path, layer_ids: list[int],
            rows: list[tuple[int, list[int]]], keep: frozenset[int] = frozenset()) -> tuple[Observed, dict[int, Any]]:
    """Run the probe rows through `backend` and the second paths that use it (everything that needs the backend:
    the extraction waits for this part); the checkpoint's head is read on a thread meanwhile and the CPU reference
    is left to `complete`. Returns the observations and the captures of the rows in `keep` (see `_read_states`)."""
    notes: list[str] = []
    n_layers = layer_ids[-1]
    ref_ids = reference_ids(layer_ids, n_layers)
    engine: dict[int, EngineDist] = {}
    paths: list[SecondPath] = []
    is_vllm = hasattr(backend, "logging")
    seconds: dict[str, float] = {}
    mark = time.perf_counter()

    def lap(phase: str) -> None:  # the seconds since the last lap, as `phase`
        nonlocal mark
        now = time.perf_counter()
        seconds[phase], mark = now - mark, now

    # the head (~2 GB bf16 for an 8B target: embedding and lm_head) is read while the engine captures the probe rows
    reading = ThreadPoolExecutor(1, thread_name_prefix="probe-head")
    head_future = reading.submit(read_checkpoint_head, model_dir)
    reading.shutdown(wait=False)
    captured, outputs = _capture_probe_rows(backend, rows, ref_ids, paths)
    lap("capture")
    kept = {r: c for r, c in captured.items() if r in keep}
    if is_vllm:  # the logprobs are parsed by `complete`
        engine_name = "vLLM logprobs of the same engine and forwards (prompt logprobs on the first row)"
    elif hasattr(backend, "reference_forward"):
        engine_name = "transformers logits of the same loaded model"
        engine = _transformers_distribution(backend, rows, [k for k in ref_ids if k < n_layers], paths, notes)
    else:
        engine_name = ""
        notes.append(f"final-state check skipped: the {type(backend).__name__} backend gives the probe no "
                     "next-token distribution (e.g. a vllm serve endpoint)")
    if not is_vllm:
        lap("engine_distribution")  # the transformers forwards (vLLM's logprobs came with the capture)
    obs = Observed(rows, {}, {}, engine, engine_name, paths, None, notes, seconds, head_reading=head_future,
                   cpu_reference_ids=ref_ids if is_vllm or not hasattr(backend, "reference_forward") else None,
                   captured=captured, kept_rows=frozenset(kept), outputs=outputs)
    return obs, kept


def _capture_probe_rows(backend: Any, rows: list[tuple[int, list[int]]], ref_ids: list[int],
                        paths: list[SecondPath]) -> tuple[dict[int, Any], dict[int, Any]]:
    """The probe rows through the backend: the first (longest) row alone with prompt logprobs, then the rest as the
    extraction runs them (they may read a prefix cache the first one filled). On the native vLLM engine the capture
    worker's hooks run beside its connector (a second path, appended to `paths`). Returns the captures and vLLM's
    request outputs (empty for other backends)."""
    is_vllm = hasattr(backend, "logging")
    captured: dict[int, Any] = {}
    outputs: dict[int, Any] = {}
    with ExitStack() as stack:
        hooks = None
        if hasattr(backend, "worker_hooks"):
            hook_path = SecondPath("vLLM capture worker hooks, same engine and forwards", ref_ids)
            paths.append(hook_path)
            try:
                hooks = stack.enter_context(backend.worker_hooks(ref_ids))
            except Exception as e:  # noqa: BLE001 - a reference that cannot run is reported; the capture goes on
                hook_path.note = f"could not run: {e}"
        for part, prompt_lp in ((rows[:1], True), (rows[1:], False)):
            if not part:
                continue
            try:
                if is_vllm:
                    with backend.logging(TOP_K, prompt_logprobs=prompt_lp) as log:
                        captured.update(backend.capture(part))
                    outputs.update(log.outputs)
                else:
                    captured.update(backend.capture(part))
            except WorkbookError as e:  # the backend's own message, said to come from the probe's rows
                raise WorkbookError(f"the capture probe failed before the first shard: capturing its rows "
                                    f"{[r for r, _ in part]} failed: {e.problem}", e.fix) from e
        if hooks is not None:
            try:
                got = hooks.collect(rows, [outputs[r].request_id for r, _ in rows])
                hook_path.states = _read_states(got.items(), {})
            except Exception as e:  # noqa: BLE001
                hook_path.note = f"could not run: {e}"
    return captured, outputs


def _transformers_distribution(backend: Any, rows: list[tuple[int, list[int]]], layer_ids: list[int],
                               paths: list[SecondPath], notes: list[str]) -> dict[int, EngineDist]:
    """The loaded model's own forward: its next-token distribution per row, and its output_hidden_states at
    `layer_ids` as a second path (appended to `paths`). A model that cannot run it (e.g. a class without
    logits_to_keep) is reported in the path's note and `notes`, not fatal."""
    path = SecondPath("transformers output_hidden_states, same loaded model", layer_ids)
    paths.append(path)
    engine: dict[int, EngineDist] = {}
    try:
        for r, t in rows:
            pos = positions(len(t))
            logits, hidden = backend.reference_forward(t, pos, path.layer_ids)
            engine[r] = _dist_from_logits(logits, pos)
            n = min(len(t), REFERENCE_TOKENS)
            path.states[r] = torch.stack([hidden[k][:n] for k in path.layer_ids], dim=1)
    except Exception as e:  # noqa: BLE001
        engine, path.states = {}, {}
        path.note = f"could not run: {e.__class__.__name__}: {e}"
        notes.append(f"final-state check skipped: the model's own forward failed ({e.__class__.__name__}: {e})")
    return engine


def complete(cfg: WorkbookConfig, obs: Observed, model_dir: Path) -> Observed:
    """What the probe needs besides the backend, so it can run beside the extraction: the captures read (states
    files loaded, a file not kept deleted; vLLM's logprobs parsed: 0.15 s of the 8B probe on the H200), the
    transformers reference on the CPU (a load of its own: vLLM backends, small checkpoints) and the checkpoint's
    head."""
    mark = time.perf_counter()
    obs.states = _read_states(obs.captured.items(), obs.file_ids, obs.kept_rows)
    obs.captured = {}
    obs.engine.update({r: _dist_from_vllm(obs.outputs[r], len(t)) for r, t in obs.rows if r in obs.outputs})
    t = time.perf_counter()
    obs.seconds["read_captures"], mark = t - mark, t
    if obs.cpu_reference_ids is not None:
        obs.paths.append(_transformers_reference(cfg, model_dir, obs.cpu_reference_ids, obs.rows))
    t = time.perf_counter()
    obs.seconds["transformers_reference"] = t - mark
    if obs.head_reading is not None:
        try:
            obs.head = obs.head_reading.result()  # the reader's own exception, re-raised here
        except WorkbookError as e:  # e.g. a quantized lm_head: stage 04 refuses it too, with its own message
            obs.notes.append(f"final-state, embedding and post-norm checks skipped: {e.problem}")
            obs.head = None
    obs.seconds["checkpoint_head"] = time.perf_counter() - t  # only what was left to read by then
    return obs


def _transformers_reference(cfg: WorkbookConfig, model_dir: Path, ids: list[int],
                            rows: list[tuple[int, list[int]]]) -> SecondPath:
    """The target loaded with transformers on the CPU (float32 states) over each row's first REFERENCE_TOKENS."""
    from eagle3lib.common.target import checkpoint_bytes

    path = SecondPath("transformers on the CPU (a second load of the target)", ids)
    size = checkpoint_bytes(model_dir)
    if cfg.extract.probe == "auto" and size > REFERENCE_AUTO_MAX_BYTES:
        path.note = (f"not run: the checkpoint is {size / 1e9:.1f} GB, above the {REFERENCE_AUTO_MAX_BYTES / 1e9:.1f} "
                     "GB that extract.probe: auto loads on the CPU (extract.probe: always does)")
        return path
    from eagle3lib.extract.backends.transformers_backend import TransformersBackend

    try:
        ref = TransformersBackend(cfg, model_dir, ids, device="cpu")
    except Exception as e:  # noqa: BLE001 - e.g. an architecture transformers cannot load: reported, not fatal
        path.note = f"could not run: {e.__class__.__name__}: {e}"
        return path
    try:
        ref.store_dtype = torch.float32
        path.states = {r: s.float().clone() for r, s in ref.capture([(r, t[:REFERENCE_TOKENS]) for r, t in rows])}
    finally:
        ref.close()
    return path


# ------------------------------------------------------------------------------------------------- the probe
@dataclass
class Pending:
    """A probe whose rows are captured and whose judging runs on a thread beside the extraction.

    `kept`: the captures of the probe rows the caller asked to keep (files or tensors, as the backend gave them),
    for the extraction to take as those rows' shards once the probe passed: the probe rows are captured once, not
    twice. `verdict`: the report, or the probe's WorkbookError. `blocking_s`: the seconds the probe held the backend
    (the extraction could not start before). The caller must not write a shard before `verdict` passed."""

    kept: dict[int, Any]
    verdict: Future
    blocking_s: float


def start(cfg: WorkbookConfig, backend: Any, model_dir: Path, layer_ids: list[int], hidden: int,
          input_ids: list[list[int]], run_root: Path, compute_dtype: str, progress: bool = True,
          keep: Iterable[int] = ()) -> Pending:
    """The probe on `backend` (started, not yet capturing): its rows through the backend now, the rest on a thread
    (`conclude`). Why a thread: on an 8B shape the judging (the head on the CPU, the cosines) was 40% of the probe
    and needs nothing of the engine, which can extract meanwhile (docs/capture.md#the-capture-probe)."""
    t0 = time.perf_counter()
    rows = [(i, list(input_ids[i])) for i in probe_rows(input_ids, cfg.extract.probe_rows)]
    obs, kept = observe(cfg, backend, Path(model_dir), list(layer_ids), rows, frozenset(keep))
    blocking = time.perf_counter() - t0
    judging = ThreadPoolExecutor(1, thread_name_prefix="probe-judge")
    verdict = judging.submit(conclude, cfg, obs, Path(model_dir), list(layer_ids), hidden, Path(run_root),
                             compute_dtype, _backend_name(cfg, backend), t0, blocking, progress)
    judging.shutdown(wait=False)
    return Pending(kept, verdict, round(blocking, 3))


def run(cfg: WorkbookConfig, backend: Any, model_dir: Path, layer_ids: list[int], hidden: int,
        input_ids: list[list[int]], run_root: Path, compute_dtype: str, progress: bool = True) -> dict[str, Any]:
    """The whole probe, waited for: writes `<run_root>/capture_probe.json` and returns it, or raises one
    WorkbookError (the report then in capture_probe.failed.json). The probe rows' captures are deleted."""
    return start(cfg, backend, model_dir, layer_ids, hidden, input_ids, run_root, compute_dtype, progress).verdict.result()


def conclude(cfg: WorkbookConfig, obs: Observed, model_dir: Path, layer_ids: list[int], hidden: int, run_root: Path,
             compute_dtype: str, backend_name: str, t0: float, blocking_s: float, progress: bool) -> dict[str, Any]:
    """Complete the observations, judge them, write the report: returns it on a pass, raises the one WorkbookError on
    a failure."""
    complete(cfg, obs, model_dir)
    rows = obs.rows
    tol_class = tolerance_class(compute_dtype, cfg.extract.dtype)
    t_checks = time.perf_counter()
    checks = judge(obs, list(layer_ids), hidden, tol_class)
    obs.seconds["checks"] = time.perf_counter() - t_checks
    passed = all(c.ok for c in checks)
    report = {
        "passed": passed, "seconds": round(time.perf_counter() - t0, 2), "blocking_seconds": round(blocking_s, 3),
        "phase_seconds": {k: round(v, 3) for k, v in obs.seconds.items()},
        "backend": backend_name, "rows": [r for r, _ in rows],
        "tokens": sum(len(t) for _, t in rows), "layer_ids": list(layer_ids),
        "dtype": {"compute": compute_dtype, "storage": cfg.extract.dtype, "tolerances": tol_class},
        "tolerance": asdict(TOLERANCES[tol_class]), "engine_distribution": obs.engine_name or None,
        "second_paths": [{"name": p.name, "ran": bool(p.states), "layer_ids": p.layer_ids,
                          "note": p.note or ("" if p.states else "did not run")} for p in obs.paths],
        "notes": obs.notes + ([] if any(p.states for p in obs.paths) else
                              ["no second capture path ran: the layers were checked only for structure"]),
        "checks": [asdict(c) for c in checks],
    }
    ok_path, failed_path = run_root / REPORT_FILE, run_root / FAILED_FILE
    if not passed:
        ok_path.unlink(missing_ok=True)  # nothing may claim a pass for this capture
        atomic.write_json(failed_path, report)
        raise failure(checks, failed_path)
    failed_path.unlink(missing_ok=True)
    atomic.write_json(ok_path, report)
    if progress:
        print(summary_line(report))
    return report


def _backend_name(cfg: WorkbookConfig, backend: Any) -> str:
    if cfg.extract.backend == "vllm":
        return f"vllm {'endpoint' if cfg.extract.vllm_endpoint and cfg.extract.strategy == 'native' else cfg.extract.strategy}"
    return cfg.extract.backend


# ------------------------------------------------------------------------------------------------- showing it
def read_report(run_root: Path) -> dict[str, Any] | None:
    import json

    path = Path(run_root) / REPORT_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def summary_line(report: dict[str, Any] | None) -> str:
    """One line for notebook 03 and the report card."""
    if not report:
        return "capture probe: not run (extract.probe: never, or every shard was kept from an earlier run)"
    final = next((c for c in report["checks"] if c["check"] == "final state"), None)
    layers = [c for c in report["checks"] if c["check"] == "layer"]
    parts = [f"capture probe {'passed' if report['passed'] else 'FAILED'} ({report['backend']}, "
             f"{len(report['rows'])} rows, {report['tokens']:,} tokens, {report['seconds']} s)"]
    if final:
        m = final["measured"]
        parts.append(f"final state top-1 {m['top1_agreement']:.3f}, logprob error {m['mean_logprob_error']:.2g}")
    else:
        parts.append("final state not checked")
    ran = [p["name"] for p in report["second_paths"] if p["ran"]]
    if layers and ran:
        parts.append(f"layers min cos {min(c['measured']['min_cos'] for c in layers):.5f} vs {'; '.join(ran)}")
    else:
        parts.append("layers: no second path ran (structure checks only)")
    return ": ".join(parts[:1]) + ": " + "; ".join(parts[1:])


def table(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per check, for notebook 02."""
    return [{"check": c["check"], "slot": "" if c["slot"] is None else c["slot"],
             "layer id": "" if c["layer_id"] is None else c["layer_id"], "ok": c["ok"],
             "measured": ", ".join(f"{k} {v}" for k, v in c["measured"].items()), "detail": c["detail"]}
            for c in report["checks"]]
