"""Load the infrastructure block on its own, as a module, from the first algorithm file that has it: the file's import
header (the block's imports are there), without the verifiers, then the block."""

import dataclasses
import os
import pathlib
import sys
import types

REPO = pathlib.Path(__file__).resolve().parent.parent
ALGORITHMS = ["gasp.py", "sgs.py", "stp.py", "eva.py", "coprover.py", "rir.py"]
START = "# ---- infrastructure (identical in every algorithm file) ----"
END = "# ---- end of infrastructure ----"
VERIFIERS = ("lean_verify", "code_exec")


def import_header(text: str) -> str:
    """The file's imports, from `from __future__ import annotations` to the first other statement, but the
    verifiers'."""
    out, depth, skipping = [], 0, False
    for line in text[text.index("from __future__ import annotations") :].splitlines():
        if depth == 0:
            if line.strip() and not line.startswith(("import ", "from ")):
                break
            skipping = any(line.startswith((f"import {v}", f"from {v} ")) for v in VERIFIERS)
        if not skipping:
            out.append(line)
        depth += line.count("(") - line.count(")")
    return "\n".join(out) + "\n"


def block_source() -> tuple[str, str]:
    """(the file's imports and its block, where they came from). INFRA_BLOCK overrides the file (work on the block)."""
    candidates = [pathlib.Path(os.environ["INFRA_BLOCK"])] if os.environ.get("INFRA_BLOCK") else []
    candidates += [REPO / name for name in ALGORITHMS]
    for path in candidates:
        if path.exists() and START in path.read_text():
            text = path.read_text()
            block = START + text.split(START, 1)[1].split(END, 1)[0] + END + "\n"
            return import_header(text) + "\n\n" + block, str(path)
    raise FileNotFoundError("no algorithm file with an infrastructure block")


def load_block() -> types.ModuleType:
    source, origin = block_source()
    module = types.ModuleType("infrastructure")
    sys.modules["infrastructure"] = module
    module.__file__ = origin
    # the block ends by giving the file's Args its CPU_DEFAULTS (with_cpu_defaults): here, an empty pair
    module.Args = dataclasses.make_dataclass("Args", [])
    module.CPU_DEFAULTS = {}
    exec(compile(source, origin, "exec"), module.__dict__)
    return module
