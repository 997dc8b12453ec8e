"""The workbook as a person uses it: JupyterLab in a real browser (Debian's chromium, driven by Playwright).

What a headless papermill run cannot catch and this does: the notebook opens in JupyterLab with the workbook's kernel
(the venv's python, which sees eagle3lib), "Run All Cells" from the Run menu runs every cell without an error, the
kernel's working directory is the notebooks folder (relative config paths still resolve against the repo root),
tqdm.auto draws a widget (not the "IProgress not found" text fallback), and `eagle3 lab` prints a URL with its token
and listens on 127.0.0.1 only.

The browser works on COPIES of the notebooks in a temp folder: JupyterLab autosaves outputs into the notebooks it
has open, and the committed notebooks must stay output-free. Each copy's parameters cell gets the same kind of
literal values papermill would inject (an output root in the temp folder, a run name), so nothing lands in outputs/.
A screenshot of each notebook after "Run All" goes to $EAGLE3_TEST_ARTIFACTS (default tests/artifacts/).

Needs /usr/bin/chromium (scripts/install-browser.sh; CI runs it) and playwright (the `dev` extra). Playwright never
downloads a browser here: it drives Debian's build through executable_path.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from eagle3lib.cli import lab_argv
from eagle3lib.common.stages import NOTEBOOK_DIR

pytestmark = pytest.mark.slow  # JupyterLab in a real browser, notebook by notebook

REPO_ROOT = NOTEBOOK_DIR.parent
CHROMIUM = Path(os.environ.get("EAGLE3_CHROMIUM", "/usr/bin/chromium"))
ARTIFACTS = Path(os.environ.get("EAGLE3_TEST_ARTIFACTS", REPO_ROOT / "tests" / "artifacts"))
# Flags that keep chromium off the network (this machine has none but the package registries) and out of the way.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]

# The notebooks the browser runs, and on what: "demo" = configs/demo.yaml (relative, as committed) with the run in a
# temp output root; "tiny" = a run whose stage 02 outputs come from a tiny random Llama (conftest.make_tiny_run), for
# the stages that build on stage 02 and are quick on it. A notebook not on disk yet is skipped.
BROWSER_NOTEBOOKS: dict[str, str] = {
    "00_environment": "demo",
    "01_patches": "demo",
    "03_inspect_tensors": "tiny",
    "04_verifier_weights": "tiny",
}
RUN_ALL_TIMEOUT_S = 420  # generous: a loaded 2-core machine runs 03 in ~2.5 min
STDERR_MIME = "application/vnd.jupyter.stderr"
# Appended to the copy of notebook 00 only: the committed notebooks have no bar that short, and a bar must be seen.
TQDM_PROBE = ("# browser-test probe (not in the committed notebook): tqdm.auto must draw a widget in JupyterLab,\n"
              "# and the notebooks' python3 kernel must be the venv's python that runs JupyterLab\n"
              "import sys\n"
              "print(\"kernel python:\", sys.executable)\n"
              "from tqdm.auto import tqdm\n"
              "for _ in tqdm(range(3), desc=\"tqdm-probe\"):\n"
              "    pass")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _jupyter_env(home: Path) -> dict[str, str]:
    """Jupyter, JupyterLab, IPython and matplotlib state in a temp folder: the test reads and writes nothing of the
    user's (~/.jupyter, ~/.ipython, workspaces), and a stale workspace cannot change what the browser sees."""
    env = dict(os.environ)
    dirs = {"JUPYTER_CONFIG_DIR": "config", "JUPYTER_RUNTIME_DIR": "runtime", "JUPYTER_DATA_DIR": "data",
            "JUPYTERLAB_SETTINGS_DIR": "lab-settings", "JUPYTERLAB_WORKSPACES_DIR": "lab-workspaces",
            "IPYTHONDIR": "ipython", "MPLCONFIGDIR": "mpl"}
    for var, sub in dirs.items():
        (home / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(home / sub)
    env.pop("JUPYTER_TOKEN", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _lab_settings(settings_dir: Path) -> None:
    """Every cell in the DOM (no windowing: the test reads all outputs and the screenshot shows them) and no news or
    update checks (no network here; their toasts would cover the notebook)."""
    files = {
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                            "checkForUpdates": False},
    }
    for rel, value in files.items():
        path = settings_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))


def _get(url: str, token: str | None = None, timeout: float = 5) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"token {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


def _wait_for_server(base: str, token: str, proc: subprocess.Popen, log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"JupyterLab exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if _get(f"{base}/api/status", token)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"JupyterLab did not answer within {timeout} s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (JupyterLab shuts its kernels down), then SIGKILL of the process group if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


# ---------------------------------------------------------------------------------------------------------- `eagle3 lab`

def _listening_addresses(port: int) -> list[str]:
    """Local addresses of the sockets listening on `port` (Linux /proc; hex IPv4 such as 0100007F = 127.0.0.1)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).is_file():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            addr, port_hex = fields[1].rsplit(":", 1)
            if int(port_hex, 16) == port and fields[3] == "0A":  # 0A = LISTEN
                found.append(addr)
    return found


def test_eagle3_lab_prints_a_token_url_and_listens_on_loopback_only(tmp_path):
    env = _jupyter_env(tmp_path / "jupyter")
    port = _free_port()
    eagle3 = Path(sys.executable).parent / "eagle3"
    cmd = [str(eagle3)] if eagle3.is_file() else [sys.executable, "-m", "eagle3lib.cli"]
    proc = subprocess.Popen([*cmd, "lab", "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=tmp_path, start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    seen: list[str] = []
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                assert proc.poll() is None, "eagle3 lab exited:\n" + "".join(seen)
                continue
            m = re.search(r"http://127\.0\.0\.1:(\d+)/lab/tree/notebooks\?token=([0-9A-Za-z_-]{32,})", seen[-1])
            url = m and (int(m.group(1)), m.group(2))
        assert url, "eagle3 lab printed no http://127.0.0.1:PORT/lab/tree/notebooks?token=... line:\n" + "".join(seen)
        printed_port, token = url
        assert printed_port == port
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        status = 0
        while status != 200 and time.monotonic() < deadline:
            assert proc.poll() is None, "JupyterLab exited:\n" + "".join(seen)
            try:
                status, body = _get(f"{base}/api/status", token)
            except OSError:
                time.sleep(0.5)
        assert status == 200, "".join(seen)
        assert "started" in json.loads(body)
        assert _get(f"{base}/api/status")[0] == 403  # the token is required
        assert _get(f"{base}/api/status", "not-the-token")[0] == 403
        assert _listening_addresses(port) == ["0100007F"], "JupyterLab must listen on 127.0.0.1 only"
        # The notebooks ask for kernelspec "python3"; the install also registers "eagle3" in the venv (--sys-prefix).
        specs = json.loads(_get(f"{base}/api/kernelspecs", token)[1])
        assert "python3" in specs["kernelspecs"] and "eagle3" in specs["kernelspecs"], specs["kernelspecs"].keys()
        for nb in NOTEBOOK_DIR.glob("*.ipynb"):
            assert json.loads(nb.read_text())["metadata"]["kernelspec"]["name"] in specs["kernelspecs"], nb.name
    finally:
        _stop(proc)  # eagle3 lab exec'd JupyterLab: this pid IS the server, so nothing is left orphaned
    assert proc.returncode is not None


# ------------------------------------------------------------------------------------------------------------- browser

@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Iterator[dict]:
    """JupyterLab (started as `eagle3 lab` starts it) on a temp folder that receives copies of the notebooks."""
    # A bare pytest without chromium skips; `make test` and CI install it first (CI=true: a missing one fails).
    missing = pytest.fail if os.environ.get("CI") == "true" else pytest.skip
    if not CHROMIUM.is_file():
        missing(f"no chromium at {CHROMIUM}: run make browser (make test and CI do)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing("playwright is not installed: pip install -e '.[dev]'")
    home = tmp_path_factory.mktemp("browser")
    root = home / "workbook"
    (root / "notebooks").mkdir(parents=True)
    env = _jupyter_env(home / "jupyter")
    _lab_settings(Path(env["JUPYTERLAB_SETTINGS_DIR"]))
    port, token = _free_port(), "browser-test-" + os.urandom(12).hex()
    log = home / "jupyterlab.log"
    argv = lab_argv(root, ip="127.0.0.1", port=port, token=token, default_url="/lab")
    with open(log, "w") as log_file:
        proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=root,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_for_server(base, token, proc, log)
        yield {"base": base, "token": token, "root": root, "home": home, "log": log}
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def browser(lab) -> Iterator:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def _parameters(nb: dict, values: dict[str, str]) -> None:
    """Rewrite the literal values of the parameters cell, keeping each line's comment (what papermill would do)."""
    cell = next(c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", []))
    lines = "".join(cell["source"]).splitlines()
    out = []
    for line in lines:
        name, _, rest = line.partition(" = ")
        comment = rest[rest.index("  #"):] if "  #" in rest else ""
        out.append(f"{name} = {values[name]}{comment}" if name in values else line)
    assert {ln.partition(" = ")[0] for ln in out} >= set(values), f"parameters cell lacks one of {list(values)}"
    cell["source"] = "\n".join(out)


def _prepare_copy(key: str, mode: str, lab: dict, request) -> tuple[Path, Path]:
    """Copy notebook `key` into the lab folder with test parameters. Returns (copy, expected manifest path)."""
    nb = json.loads((NOTEBOOK_DIR / f"{key}.ipynb").read_text())
    if mode == "demo":
        out_root = lab["home"] / "outputs"
        # config stays relative as committed: the kernel's cwd is the notebooks folder, open_stage must find it
        _parameters(nb, {"run": '"browser"', "overrides": json.dumps([f"run.output_root={out_root}"])})
        run_root = out_root / "browser"
    else:
        run_root = _tiny_run(lab, request)
        _parameters(nb, {"config": json.dumps(str(run_root / "config.yaml")), "run": "None", "overrides": "[]"})
    if key == "00_environment":
        nb["cells"].append({"cell_type": "code", "execution_count": None, "id": "tqdm-probe", "metadata": {},
                            "outputs": [], "source": TQDM_PROBE})
    copy = lab["root"] / "notebooks" / f"{key}.ipynb"
    copy.write_text(json.dumps(nb, indent=1))
    return copy, run_root / "manifests" / f"{key}.json"


def _tiny_run(lab: dict, request) -> Path:
    """One tiny run (stage 02 done on a tiny random Llama) shared by the browser's "tiny" notebooks."""
    if "tiny_run" not in lab:
        from conftest import make_tiny_run

        model_dir = request.getfixturevalue("tiny_llama_dir")
        _, rd = make_tiny_run(lab["home"] / "tiny-outputs", model_dir, run="browser-tiny")
        lab["tiny_run"] = rd.root
    return lab["tiny_run"]


# Evaluated in the page: the state of the open notebook, read from JupyterLab's DOM.
NOTEBOOK_STATE_JS = """() => {
  const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
  if (!panel) return null;
  const cells = [...panel.querySelectorAll('.jp-Notebook .jp-CodeCell')];
  const prompts = cells.map(c => (c.querySelector('.jp-InputPrompt')?.textContent || '').trim());
  const indicator = panel.querySelector('.jp-Notebook-ExecutionIndicator');
  const outputs = [...panel.querySelectorAll('.jp-OutputArea-output')].map(o => ({
    mime: o.getAttribute('data-mime-type') || '', text: o.textContent || ''}));
  return {prompts, status: indicator ? indicator.getAttribute('data-status') : null, outputs,
          widgets: panel.querySelectorAll('.jp-OutputArea-output .widget-progress, ' +
                                          '.jp-OutputArea-output .jupyter-widgets .progress-bar').length};
}"""


def _kernel(lab: dict, notebook: str) -> dict | None:
    """The server's view of the notebook's kernel (execution_state, connections): the page's status indicator reads
    "idle" before any kernel exists, so "the kernel is idle" is asked of the server too."""
    status, body = _get(f"{lab['base']}/api/sessions", lab["token"])
    sessions = [s for s in json.loads(body) if s.get("path", "").endswith(notebook)] if status == 200 else []
    return sessions[0]["kernel"] if sessions and sessions[0].get("kernel") else None


def _wait_state(page, predicate, timeout: float, what: str, lab: dict, notebook: str) -> dict:
    deadline = time.monotonic() + timeout
    state = None
    stable = 0
    while time.monotonic() < deadline:
        state = page.evaluate(NOTEBOOK_STATE_JS)
        if state is not None:
            state["kernel"] = _kernel(lab, notebook)
        stable = stable + 1 if state and predicate(state) else 0
        if stable >= 3:  # the same answer three polls in a row: not a gap between two queued cells
            return state
        page.wait_for_timeout(500)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; last state: "
                         f"{json.dumps(state)[:3000] if state else None}")


def _screenshot(page, path: Path) -> None:
    """The whole notebook from its top: JupyterLab scrolls inside the page, so the viewport grows to the notebook's
    height (the file browser is folded away to give the cells the width)."""
    scroller = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer"
    sidebar_tab = ".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current"
    if page.locator(sidebar_tab).count():
        page.locator(sidebar_tab).first.click()
    height = page.evaluate(f"() => {{ const n = document.querySelector('{scroller}'); return n ? n.scrollHeight : 900; }}")
    page.set_viewport_size({"width": 1280, "height": int(min(max(height + 150, 900), 16000))})
    page.wait_for_timeout(800)
    page.evaluate(f"() => {{ const n = document.querySelector('{scroller}'); if (n) n.scrollTop = 0; }}")
    page.wait_for_timeout(300)
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path))


@pytest.mark.parametrize("key", list(BROWSER_NOTEBOOKS))
def test_run_all_cells_in_jupyterlab(key, lab, browser, request):
    """Open the copy, Run -> Run All Cells, wait for idle; no error output, every cell ran, the manifest is written."""
    if not (NOTEBOOK_DIR / f"{key}.ipynb").is_file():
        pytest.skip(f"notebooks/{key}.ipynb is not built yet")
    committed = (NOTEBOOK_DIR / f"{key}.ipynb").read_bytes()
    copy, manifest = _prepare_copy(key, BROWSER_NOTEBOOKS[key], lab, request)
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    console_errors: list[str] = []
    page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
    shot = ARTIFACTS / f"browser_{key}.png"
    try:
        page.goto(f"{lab['base']}/lab/tree/notebooks/{copy.name}?reset&token={lab['token']}",
                  wait_until="domcontentloaded", timeout=60_000)
        page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-CodeCell", timeout=60_000)
        idle = lambda s: (s["status"] == "idle" and s["kernel"] is not None  # noqa: E731
                          and s["kernel"]["execution_state"] == "idle" and s["kernel"]["connections"] >= 1)
        _wait_state(page, idle, 180, "the kernel to start (idle)", lab, copy.name)
        # Run -> Run All Cells, through the menus as a person would
        page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
        page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
        _wait_state(page, lambda s: any("*" in p for p in s["prompts"]) or any(re.search(r"\d", p)
                    for p in s["prompts"]), 30, "Run All to start", lab, copy.name)
        state = _wait_state(page, lambda s: idle(s) and not any("*" in p for p in s["prompts"]),
                            RUN_ALL_TIMEOUT_S, "Run All to finish and the kernel to go idle", lab, copy.name)
    finally:
        _screenshot(page, shot)
    try:
        errors = [o["text"] for o in state["outputs"] if o["mime"] == STDERR_MIME and "Traceback" in o["text"]]
        assert not errors, f"{key}: a cell failed in JupyterLab (screenshot {shot}):\n" + "\n".join(errors)[-4000:]
        unrun = [i for i, p in enumerate(state["prompts"]) if not re.search(r"\[\d+\]", p)]
        assert not unrun, f"{key}: code cells {unrun} did not run (prompts {state['prompts']}; screenshot {shot})"
        stderr = "\n".join(o["text"] for o in state["outputs"] if o["mime"] == STDERR_MIME)
        assert "IProgress not found" not in stderr, "tqdm.auto fell back to text: ipywidgets is not usable"
        if key == "00_environment":
            assert state["widgets"] >= 1, f"the tqdm probe drew no progress widget (screenshot {shot})"
            assert f"kernel python: {sys.executable}" in "".join(o["text"] for o in state["outputs"]), (
                "the notebook's python3 kernel is not the python that runs JupyterLab")
        # outputs landed in <output_root>/<run>/ as in a headless run, with this stage's manifest
        assert manifest.is_file(), f"{key}: no manifest at {manifest}"
        assert json.loads(manifest.read_text())["stage"] == key
    finally:
        page.close()
    assert (NOTEBOOK_DIR / f"{key}.ipynb").read_bytes() == committed, "the committed notebook changed: it must not"
