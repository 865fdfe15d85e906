"""Run by tests/test_infrastructure.py under `torchrun --nproc_per_node 2`: results gathered after long per-rank work.

argv: out_dir, seconds. Tensor collectives time out after 15 s here (the default group); rank 1's share of the work
takes `seconds` longer than rank 0's, and map_sharded must still gather it (on a group of its own, with a timeout of
days)."""

import json
import pathlib
import sys
import time

import torch
from _block import load_block

B = load_block()
out, seconds = pathlib.Path(sys.argv[1]), float(sys.argv[2])
dist = B.setup_distributed(seed=1, timeout_minutes=0.25)


def work(share):
    time.sleep(
        seconds if dist.rank == 1 else 0.0
    )  # e.g. one rank's proof searches run for hours longer
    return [x * 10 for x in share]


start = time.monotonic()
results = B.map_sharded(work, [1, 2, 3], dist)
waited = time.monotonic() - start
tensor = torch.ones(1) * (dist.rank + 1)
B.tdist.all_reduce(tensor)  # tensor collectives still work on the default group afterwards
if dist.is_main:
    (out / "result.json").write_text(
        json.dumps({"results": results, "waited": waited, "sum": tensor.item()})
    )
