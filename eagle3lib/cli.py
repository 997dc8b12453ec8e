"""`eagle3`: the command line of the workbook.

    eagle3 run --config configs/demo.yaml [--run NAME] [--stages 00,02-04] [-p section.key=value ...]
    eagle3 stages
    eagle3 lab [--port 8888]      JupyterLab on the notebooks, bound to 127.0.0.1

A mistake the user can fix prints one line (the problem and the fix) and exits 2; a failing stage exits 1.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from eagle3lib.errors import WorkbookError
from eagle3lib.stages import ALL_STAGES, NOTEBOOK_DIR, available_stages


def _cmd_run(args: argparse.Namespace) -> int:
    from eagle3lib.runner import run_stages

    rd = run_stages(args.config, run=args.run, stages=args.stages, overrides=args.param, log_output=not args.quiet)
    report = rd.path("report.md")
    print(f"finished: {rd.root}" + (f"\nreport card: {report}" if report.is_file() else ""))
    return 0


def _cmd_stages(_: argparse.Namespace) -> int:
    built = {s.id for s in available_stages()}
    for s in ALL_STAGES:
        print(f"{s.id}  {s.name:<24} {'built' if s.id in built else 'not built yet':<14} {s.title}")
    return 0


def _cmd_lab(args: argparse.Namespace) -> int:
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.ip={args.ip}", f"--ServerApp.port={args.port}",
           f"--ServerApp.root_dir={NOTEBOOK_DIR.parent}", "--no-browser",
           f"--LabApp.default_url=/lab/tree/{NOTEBOOK_DIR.name}"]
    return subprocess.call(cmd)


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
    lab = sub.add_parser("lab", help="open the workbook in JupyterLab (127.0.0.1, with a token)")
    lab.add_argument("--ip", default="127.0.0.1")
    lab.add_argument("--port", type=int, default=8888)
    lab.set_defaults(func=_cmd_lab)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except WorkbookError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1 if str(e).startswith("stage ") else 2
    except KeyboardInterrupt:
        print("interrupted: files already written are complete; rerun the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
