"""`eagle3`: the command line of the workbook.

    eagle3 run --config configs/demo.yaml [--run NAME] [--stages 00,02-04] [-p section.key=value ...]
    eagle3 stages
    eagle3 lab [--port 8888]      JupyterLab on the notebooks, bound to 127.0.0.1

A mistake the user can fix prints one line (the problem and the fix) and exits 2; a failing stage exits 1.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import sys
from pathlib import Path

from eagle3lib.common.errors import StageFailed, WorkbookError
from eagle3lib.common.stages import ALL_STAGES, NOTEBOOK_DIR, available_stages


def _interrupt_on_sigterm() -> None:
    """SIGTERM (`timeout`, a job scheduler, `kill`) ends a run like Ctrl-C: the notebook's kernel is shut down with
    its whole process group. Python's default SIGTERM exit skips that, and a vLLM engine the kernel had spawned
    lived on holding 120 GiB of an H200 (seen on the lent GPU host)."""
    def handler(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def _cmd_run(args: argparse.Namespace) -> int:
    from eagle3lib.runner import run_stages

    _interrupt_on_sigterm()

    rd = run_stages(args.config, run=args.run, stages=args.stages, overrides=args.param, log_output=not args.quiet)
    report = rd.path("report.md")
    print(f"finished: {rd.root}" + (f"\nreport card: {report}" if report.is_file() else ""))
    return 0


def _cmd_stages(_: argparse.Namespace) -> int:
    built = {s.id for s in available_stages()}
    for s in ALL_STAGES:
        print(f"{s.id}  {s.name:<24} {'built' if s.id in built else 'not built yet':<14} {s.title}")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from eagle3lib.evaluate.compare import compare_runs

    missing = [str(r) for r in args.runs if not (r / "manifests").is_dir()]
    if missing:
        raise WorkbookError(f"not a run folder (no manifests/): {', '.join(missing)}",
                            "pass run folders such as outputs/demo")
    print(compare_runs(list(args.runs)))
    return 0


def lab_argv(root_dir: Path, *, ip: str, port: int, token: str, default_url: str) -> list[str]:
    """The JupyterLab command line `eagle3 lab` runs; the browser test starts the same one on a copy of the notebooks.

    Why these flags: the venv's own python runs the server, so the notebooks' "python3" kernelspec (argv "python")
    starts this venv's interpreter, which sees eagle3lib; the token is given explicitly so the URL we print is the one
    that works; port_retries=0 because a server that silently moved to another port would make that URL wrong;
    --allow-root only where we are root (containers, CI), which Jupyter otherwise refuses outright.
    """
    root = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    return [sys.executable, "-m", "jupyterlab", f"--ServerApp.ip={ip}", f"--ServerApp.port={port}",
            "--ServerApp.port_retries=0", f"--ServerApp.root_dir={root_dir}", "--no-browser",
            f"--IdentityProvider.token={token}", f"--LabApp.default_url={default_url}",
            "--ContentsManager.pre_save_hook=eagle3lib.cli.keep_notebooks_clean", *root]


def keep_notebooks_clean(model: dict, path: str, **_: object) -> None:
    """JupyterLab pre-save hook: the committed stage notebooks (notebooks/*.ipynb) are saved without outputs.

    Why: a person stepping through the workbook would otherwise autosave outputs into the tracked notebooks. What a
    run shows is kept where it belongs: figures and manifests in the run directory, executed copies for headless runs.
    """
    if model.get("type") != "notebook" or not path.lstrip("/").startswith(f"{NOTEBOOK_DIR.name}/"):
        return
    for cell in model["content"].get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None


def _free_port(ip: str, start: int) -> int:
    """The first port from `start` that can be bound on `ip` (8888 is often taken by another Jupyter)."""
    for port in range(start, start + 50):
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
            try:
                s.bind((ip, port))
            except OSError:
                continue
            return port
    raise WorkbookError(f"no free port on {ip} in {start}-{start + 49}", "pass another one: eagle3 lab --port 9000")


def _cmd_lab(args: argparse.Namespace) -> int:
    """JupyterLab on the notebooks, printing the one URL (with its token) to open.

    The server process replaces this one (exec), so Ctrl+C and a terminating signal reach JupyterLab itself, which
    shuts its kernels down; no orphaned server is left behind by a killed `eagle3 lab`.
    """
    port = _free_port(args.ip, args.port or 8888)
    token = os.environ.get("JUPYTER_TOKEN") or secrets.token_hex(24)
    host = f"[{args.ip}]" if ":" in args.ip else args.ip
    default_url = f"/lab/tree/{NOTEBOOK_DIR.name}"
    url = f"http://{host}:{port}{default_url}?token={token}"
    if args.ip not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: listening on {args.ip}: anyone who can reach it and has the token runs code as you",
              file=sys.stderr)
    print(f"eagle3 lab: open {url}\n(stop with Ctrl+C twice; notebooks: {NOTEBOOK_DIR})", flush=True)
    sys.stderr.flush()
    argv = lab_argv(NOTEBOOK_DIR.parent, ip=args.ip, port=port, token=token, default_url=default_url)
    os.execv(argv[0], argv)
    return 0  # not reached


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3", description="Train EAGLE-3 drafts, stage by stage.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the numbered notebooks headless with papermill")
    run.add_argument("--config", required=True, help="YAML config, e.g. configs/demo.yaml")
    run.add_argument("--run", help="run name (default: run.name from the config)")
    run.add_argument("--stages", help="e.g. 00,02-04 (default: every built stage)")
    run.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config value, e.g. -p train.epochs=2 (repeatable)")
    run.add_argument("-q", "--quiet", action="store_true", help="do not stream the notebooks' output")
    run.set_defaults(func=_cmd_run)
    stages = sub.add_parser("stages", help="list the stages")
    stages.set_defaults(func=_cmd_stages)
    compare = sub.add_parser("compare", help="tau per method, benchmark and category, serving speedup and wall time "
                             "across runs (markdown)")
    compare.add_argument("runs", nargs="+", type=Path, help="run folders, e.g. outputs/a outputs/b")
    compare.set_defaults(func=_cmd_compare)
    lab = sub.add_parser("lab", help="open the workbook in JupyterLab (127.0.0.1, with a token)")
    lab.add_argument("--ip", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    lab.add_argument("--port", type=int, default=8888, help="first port to try (default 8888; the next free one)")
    lab.set_defaults(func=_cmd_lab)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except StageFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except WorkbookError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: files already written are complete; rerun the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
