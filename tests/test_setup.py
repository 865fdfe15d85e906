"""setup.sh never pip-installs into an interpreter outside a virtualenv (PEP 668: Debian's and Ubuntu's python3 refuse
it): with such an interpreter it makes the project's .venv and installs there; an active environment is used as is."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def base_python() -> str:
    """An interpreter outside any virtualenv: the one this test's virtualenv was made from."""
    base = getattr(sys, "_base_executable", sys.executable)
    done = subprocess.run(
        [base, "-c", "import sys; print(sys.prefix == sys.base_prefix)"],
        capture_output=True,
        text=True,
    )
    if done.stdout.strip() != "True":
        pytest.skip("no interpreter outside a virtualenv here")
    return base


@pytest.fixture
def checkout(tmp_path) -> pathlib.Path:
    shutil.copy(REPO / "setup.sh", tmp_path / "setup.sh")
    return tmp_path


def managed_stand_in(tmp_path: pathlib.Path, real: str) -> pathlib.Path:
    """An externally managed interpreter: `-m pip` fails as Debian's does; everything else runs the real one."""
    script = tmp_path / "managed-python3"
    script.write_text(f"""#!/bin/sh
case " $* " in *" -m pip "*) echo "error: externally-managed-environment" >&2; echo pip >> {tmp_path}/pip-calls; exit 1;; esac
exec {real} "$@"
""")  # noqa: E501
    script.chmod(0o755)
    return script


def test_a_managed_interpreter_gets_a_project_virtualenv(checkout):
    stand_in = managed_stand_in(checkout, base_python())
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX")}
    done = subprocess.run(
        ["bash", "setup.sh", "--python"],
        cwd=checkout,
        env={**env, "PYTHON": str(stand_in)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(checkout / ".venv" / "bin" / "python")
    assert "creating the project virtualenv .venv" in done.stderr
    venv_python = checkout / ".venv" / "bin" / "python"
    check = subprocess.run(
        [str(venv_python), "-c", "import sys; print(sys.prefix != sys.base_prefix)"],
        capture_output=True,
        text=True,
    )
    assert check.stdout.strip() == "True"
    assert not (checkout / "pip-calls").exists(), "pip was called on the managed interpreter"
    again = subprocess.run(
        ["bash", "setup.sh", "--python"],
        cwd=checkout,
        env={**env, "PYTHON": str(stand_in)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (
        again.returncode == 0 and "creating" not in again.stderr
    )  # idempotent: the .venv is reused


def test_an_active_virtualenv_is_used_as_is(checkout):
    if sys.prefix == sys.base_prefix:
        pytest.skip("the tests do not run in a virtualenv")
    done = subprocess.run(
        ["bash", "setup.sh", "--python"],
        cwd=checkout,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == sys.executable and not (checkout / ".venv").exists()


def test_every_pip_call_goes_through_the_chosen_interpreter():
    """After the environment is chosen, setup.sh calls pip only as `$PYTHON -m pip` (pip_install) or through
    .venv-vllm's own python: no bare pip, no `python3 -m pip`, no --break-system-packages."""
    text = (REPO / "setup.sh").read_text()
    chosen = text.index("pip_install() {")
    assert "pip install" not in text[:chosen].replace("Debian's and Ubuntu's", "")
    for line in text[chosen:].splitlines():
        code = line.split("#")[0]
        if "pip" in code and "install" in code:
            assert "pip_install" in code or '"$PYTHON" -m pip install' in code or "vpip" in code, (
                line
            )
    assert "break-system-packages" not in text
