"""The real Kimina Lean Server, started for a test with the stand-in REPL behind it.

`bash setup.sh --kimina` installs PyPI's kimina-ast-server 2.1.3 (with kimina-ast-client 0.2.2) into the
virtualenv .venv-kimina. `KiminaServer` runs it on 127.0.0.1 (a free port) in a temporary directory:

* The server starts every REPL as `lake env <LEAN_SERVER_REPL_PATH>` in `LEAN_SERVER_PROJECT_DIR`, with
  `lake` taken from PATH. Here `lake` is a two-line script that drops `env` and runs the rest, and the REPL
  path is a script that runs tests/fake_lean_repl.py with this interpreter. That script first appends its
  process id to `repl-pids`, so every REPL the server ever started can be found and stopped.
* No database (`LEAN_SERVER_DATABASE_URL` unset), no path checks (`LEAN_SERVER_SKIP_VALIDATION`: there is
  no Lean workspace), the working directory has no `.env` for the server's settings to read.
* `stop()` sends SIGTERM and waits 2 s (uvicorn waits for a request in flight, and 2.1.3 goes on with a
  request whose client left), then SIGKILL; then it kills the process group of every REPL it recorded (each
  REPL runs in a session of its own), since a forced stop leaves them running.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAKE_REPL = ROOT / "tests" / "fake_lean_repl.py"
KIMINA_VENV = ROOT / ".venv-kimina"
SERVER_BIN = KIMINA_VENV / "bin" / "kimina-ast-server"
SKIP_REASON = "the real Kimina Lean Server is not installed (bash setup.sh --kimina)"
READY_LINE = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


def server_installed() -> bool:
    return SERVER_BIN.exists()


class KiminaServer:
    """One kimina-ast-server process. `repl_args` go to the stand-in REPL (`--import-delay 5`, ...);
    `settings` are the server's own, without the LEAN_SERVER_ prefix (MAX_REPLS=1, API_KEY=...,
    INIT_REPLS={"import Mathlib": 1} as a dict)."""

    def __init__(self, workdir: Path, repl_args: tuple = (), **settings):
        self.workdir = Path(workdir)
        self.repl_args = [str(a) for a in repl_args]
        self.settings = settings
        self.proc = None
        self.url = ""
        self.log_path = self.workdir / "server.log"
        self.pid_file = self.workdir / "repl-pids"

    def start(self, ready_timeout: float = 60.0) -> KiminaServer:
        bin_dir = self.workdir / "bin"
        project = self.workdir / "project"
        bin_dir.mkdir(parents=True, exist_ok=True)
        project.mkdir(exist_ok=True)
        lake = bin_dir / "lake"
        lake.write_text('#!/bin/sh\nif [ "$1" = env ]; then shift; fi\nexec "$@"\n')
        lake.chmod(0o755)
        repl_argv = [sys.executable, str(FAKE_REPL), *self.repl_args]
        repl = self.workdir / "repl"
        pid_file = shlex.quote(str(self.pid_file))
        repl.write_text(f'#!/bin/sh\necho $$ >> {pid_file}\nexec {shlex.join(repl_argv)} "$@"\n')
        repl.chmod(0o755)

        env = {
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "HOME": os.environ.get("HOME", str(self.workdir)),
            "COLUMNS": "200",  # rich wraps its log lines at the terminal's width
            "LEAN_SERVER_HOST": "127.0.0.1",
            "LEAN_SERVER_PORT": "0",
            "LEAN_SERVER_ENVIRONMENT": "dev",
            "LEAN_SERVER_SKIP_VALIDATION": "1",
            "LEAN_SERVER_REPL_PATH": str(repl),
            "LEAN_SERVER_PROJECT_DIR": str(project),
        }
        for name, value in self.settings.items():
            if isinstance(value, dict):
                value = json.dumps(value)
            env["LEAN_SERVER_" + name] = str(value)
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [str(SERVER_BIN)],
            cwd=self.workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            found = READY_LINE.search(self.log_text())
            if found:
                self.url = f"http://127.0.0.1:{found.group(1)}"
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the Kimina server did not start:\n{self.log_text()[-3000:]}")

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def repl_pids(self) -> list:
        """Every REPL process the server started, in order (some may have ended)."""
        try:
            lines = self.pid_file.read_text().split()
        except OSError:
            return []
        pids = []
        for line in lines:
            pids.append(int(line))
        return pids

    def live_repls(self) -> list:
        live = []
        for pid in self.repl_pids():
            if _is_our_repl(pid, self.workdir / "repl"):
                live.append(pid)
        return live

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                # uvicorn waits for a request in flight, which 2.1.3 keeps running after its client left
                self.proc.kill()
                self.proc.wait()
        # A REPL the server forked just before it ended records its id a moment later: look again briefly.
        for _ in range(5):
            self.kill_repls()
            time.sleep(0.05)
        self.kill_repls()

    def kill_repls(self) -> None:
        for pid in self.live_repls():
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __enter__(self) -> KiminaServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _is_our_repl(pid: int, repl_script: Path) -> bool:
    """Whether `pid` is still one of this server's REPLs: the REPL script (before it runs the stand-in) or the
    stand-in, and not another process that reuses the number."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    if state == "Z":  # a zombie holds no resources; its parent reaps it
        return False
    if str(repl_script).encode() in cmdline:
        return True
    return str(FAKE_REPL).encode() in cmdline
