"""The project's layout rules (DESIGN.md): one identical infrastructure block in every algorithm file, no imports
between algorithm files, and a working `--help` for each."""

import ast
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
ALGORITHMS = ["sgs.py", "stp.py", "gasp.py", "eva.py", "coprover.py", "rir.py"]
VERIFIERS = {"lean_verify", "code_exec"}
START = "# ---- infrastructure (identical in every algorithm file) ----"
END = "# ---- end of infrastructure ----"


def present() -> list[pathlib.Path]:
    return [REPO / name for name in ALGORITHMS if (REPO / name).exists()]


def infrastructure_block(text: str) -> str:
    """The text between the two markers; ValueError when a marker is missing, out of order or repeated."""
    if text.count(START) != 1 or text.count(END) != 1:
        raise ValueError("each marker must appear exactly once")
    head, rest = text.split(START)
    if END not in rest:
        raise ValueError("end marker before start marker")
    return rest.split(END)[0]


def block_problems(paths: list[pathlib.Path]) -> list[str]:
    """Every way the given files break the identical-block rule, as readable lines (empty when they agree)."""
    problems, blocks = [], {}
    for path in paths:
        try:
            blocks[path.name] = infrastructure_block(path.read_text())
        except ValueError as e:
            problems.append(f"{path.name}: {e}")
    if blocks:
        reference_name, reference = next(iter(blocks.items()))
        for name, block in blocks.items():
            if block != reference:
                a, b = reference.splitlines(), block.splitlines()
                line = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                problems.append(f"{name}: block differs from {reference_name} at block line {line + 1}")
    return problems


def project_imports(path: pathlib.Path) -> set[str]:
    """Top-level names of project modules (files at the repo root) that `path` imports."""
    project = {p.stem for p in REPO.glob("*.py")} - {path.stem}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & project


def test_infrastructure_blocks_identical():
    assert block_problems(present()) == []


def test_block_check_catches_a_difference(tmp_path):
    block = f"{START}\nimport torch\n\ndef f():\n    return 1\n{END}\n"
    a, b, c = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    a.write_text("x = 1\n" + block + "main()\n")
    b.write_text("y = 2\n" + block)
    c.write_text("y = 2\n" + block.replace("return 1", "return 2"))
    assert block_problems([a, b]) == []  # outside the block files may differ
    problems = block_problems([a, b, c])
    assert problems == ["c.py: block differs from a.py at block line 5"]
    d = tmp_path / "d.py"
    d.write_text(block.replace(END, ""))
    assert block_problems([a, d]) == ["d.py: each marker must appear exactly once"]
    e = tmp_path / "e.py"
    e.write_text(block.replace("\n    return 1", "\n    return 1 "))  # trailing space: still a difference
    assert block_problems([a, e])


@pytest.mark.parametrize("path", present(), ids=lambda p: p.name)
def test_imports_only_the_verifiers(path):
    assert project_imports(path) <= VERIFIERS


@pytest.mark.parametrize("path", present(), ids=lambda p: p.name)
def test_help(path):
    done = subprocess.run([sys.executable, path.name, "--help"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage" in done.stdout.lower()


def test_ci_runs_the_readme_test_commands():
    """.ci/run installs with the README's flags and runs each command of the README's '# tests' and '# vLLM tests'
    lines, in that order."""
    readme = (REPO / "README.md").read_text()
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    commands = [m.group(1).strip() for m in re.finditer(r"^# (?:vLLM )?tests\b.*\n(.+)$", readme, re.MULTILINE)]
    assert len(commands) == 2, "the README's Quickstart has '# tests' and '# vLLM tests' lines, each followed by the command"
    assert [line for line in ci if line in commands] == commands
    assert "bash setup.sh --vllm-cpu" in ci


def test_block_length():
    """The block is plumbing a reader skims: at most 300 lines (DESIGN.md). The count is printed with -s / -rA."""
    if not present():
        pytest.skip("no algorithm file yet")
    lines = len(infrastructure_block(present()[0].read_text()).splitlines())
    print(f"infrastructure block: {lines} lines")
    assert lines <= 300
