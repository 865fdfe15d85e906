"""Load the infrastructure block on its own, as a module, from the first algorithm file that has it."""

import os
import pathlib
import sys
import types

REPO = pathlib.Path(__file__).resolve().parent.parent
ALGORITHMS = ["gasp.py", "sgs.py", "stp.py", "eva.py", "coprover.py", "rir.py"]
START = "# ---- infrastructure (identical in every algorithm file) ----"
END = "# ---- end of infrastructure ----"


def block_source() -> tuple[str, str]:
    """(text of the block, where it came from). INFRA_BLOCK overrides the source file (for work on the block)."""
    candidates = [pathlib.Path(os.environ["INFRA_BLOCK"])] if os.environ.get("INFRA_BLOCK") else []
    candidates += [REPO / name for name in ALGORITHMS]
    for path in candidates:
        if path.exists() and START in path.read_text():
            text = path.read_text()
            return START + text.split(START, 1)[1].split(END, 1)[0] + END + "\n", str(path)
    raise FileNotFoundError("no algorithm file with an infrastructure block")


def load_block() -> types.ModuleType:
    source, origin = block_source()
    module = types.ModuleType("infrastructure")
    sys.modules["infrastructure"] = module
    module.__file__ = origin
    exec(compile(source, origin, "exec"), module.__dict__)
    return module
