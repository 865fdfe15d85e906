"""The style measures of CONTRIBUTING.md for each algorithm file (and the verifiers), printed as a table.

    python tests/style_report.py               # the six algorithm files and the two verifiers
    python tests/style_report.py sgs.py        # some files

Measures, each over the whole file (the infrastructure block included) and, for `block`, over the block alone:
- lines: all lines; mean: the mean length of the non-blank lines, in characters;
- over 100: the share of lines longer than 100 characters;
- side effects: expression statements that are not a call, a docstring or an await: a comprehension, a conditional
  expression, `a and f()`, a tuple of calls (`f(), g()`) written as a statement for what it does;
- conditionals: conditional expressions (`a if c else b`);
- lambdas: lambdas that are not the `key=` of a call.

The targets (CONTRIBUTING.md): mean <= 55, over 100 <= 3%, no side-effect statement, at most 30 conditional
expressions a file, lambdas only as keys. Nothing here fails on size: the report is read, not asserted on growth.
"""

import ast
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
ALGORITHMS = ["sgs.py", "stp.py", "gasp.py", "eva.py", "coprover.py", "rir.py"]
VERIFIERS = ["lean_verify.py", "code_exec.py"]
START = "# ---- infrastructure (identical in every algorithm file) ----"
END = "# ---- end of infrastructure ----"
TARGETS = {
    "mean": 55.0,
    "over_100_share": 0.03,
    "side_effects": 0,
    "conditionals": 30,
    "lambdas": 0,
}
SIDE_EFFECT_NODES = (
    ast.ListComp,
    ast.SetComp,
    ast.DictComp,
    ast.GeneratorExp,
    ast.IfExp,
    ast.BoolOp,
    ast.Tuple,
)


def key_lambdas(tree: ast.AST) -> set[int]:
    """The ids of the lambdas passed as `key=` to a call."""
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        for keyword in node.keywords:
            if keyword.arg == "key" and isinstance(keyword.value, ast.Lambda):
                found.add(id(keyword.value))
    return found


def measure_source(text: str) -> dict:
    """The measures of one piece of Python source (a whole file, or the block parsed on its own)."""
    lines = text.splitlines()
    non_blank = [line for line in lines if line.strip()]
    tree = ast.parse(text)
    side_effects = 0
    conditionals = 0
    lambdas = 0
    keys = key_lambdas(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, SIDE_EFFECT_NODES):
            side_effects += 1
        if isinstance(node, ast.IfExp):
            conditionals += 1
        if isinstance(node, ast.Lambda) and id(node) not in keys:
            lambdas += 1
    mean = sum(len(line) for line in non_blank) / max(len(non_blank), 1)
    over_100 = sum(len(line) > 100 for line in lines)
    return {
        "lines": len(lines),
        "mean": mean,
        "over_100": over_100,
        "over_100_share": over_100 / max(len(lines), 1),
        "side_effects": side_effects,
        "conditionals": conditionals,
        "lambdas": lambdas,
    }


def block_text(text: str) -> str | None:
    """The infrastructure block of an algorithm file, or None where it has none."""
    if START not in text or END not in text:
        return None
    return text.split(START, 1)[1].split(END, 1)[0]


def measure_file(path: pathlib.Path) -> dict:
    text = path.read_text()
    result = measure_source(text)
    block = block_text(text)
    if block is not None:
        block_lines = block.strip("\n").splitlines()
        non_blank = [line for line in block_lines if line.strip()]
        result["block_lines"] = len(block_lines)
        result["block_mean"] = sum(len(line) for line in non_blank) / max(len(non_blank), 1)
    return result


def misses(result: dict) -> list[str]:
    """The targets a file's measures miss, as readable words (empty when it meets them all)."""
    missed = []
    for name, target in TARGETS.items():
        if result[name] > target:
            missed.append(f"{name} {result[name]:.3g} > {target}")
    return missed


def report(paths: list[pathlib.Path]) -> str:
    header = (
        f"{'file':16}{'lines':>7}{'mean':>7}{'>100':>6}{'share':>8}"
        f"{'side eff.':>11}{'cond.':>7}{'lambdas':>9}{'block':>7}{'b.mean':>8}"
    )
    rows = [header]
    for path in paths:
        result = measure_file(path)
        block_lines = result.get("block_lines", "")
        block_mean = result.get("block_mean")
        block_mean_text = f"{block_mean:.1f}" if block_mean is not None else ""
        row = (
            f"{path.name:16}{result['lines']:>7}{result['mean']:>7.1f}{result['over_100']:>6}"
            f"{result['over_100_share']:>8.1%}{result['side_effects']:>11}{result['conditionals']:>7}"
            f"{result['lambdas']:>9}{block_lines:>7}{block_mean_text:>8}"
        )
        rows.append(row)
    return "\n".join(rows)


def main() -> None:
    names = sys.argv[1:] or ALGORITHMS + VERIFIERS
    paths = [REPO / name for name in names]
    print(report(paths))
    for path in paths:
        if path.name in ALGORITHMS:
            missed = misses(measure_file(path))
            if missed:
                print(f"{path.name} misses: " + ", ".join(missed))


if __name__ == "__main__":
    main()
