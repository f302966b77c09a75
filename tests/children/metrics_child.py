"""One rank of a job with metrics on (``TIERFS_METRICS_PORT``, each rank on that port plus its LOCAL_RANK):
a torch.nn MLP with AdamW saved to a RAM tier and an S3 object tier (its storage options as JSON in
``TIERFS_TEST_STORAGE_OPTIONS``). The test scrapes the ranks between the phases; each phase ends with a
line on stdout and waits for ``go`` on the rank's FIFO (FIFOS/go<rank>):

1. saves steps 1 and 2, each durable on both tiers: ``SAVED 2``;
2. saves step 3, committed in RAM, its upload left to the background: ``SAVED 3``;
3. waits until it is on the object tier: ``DURABLE 3``;
4. restores step 3 from the object tier: ``RESTORED``; then prints one JSON line.

    metrics_child.py SHM URL FIFOS
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from tierfs import TieredStore
from tierfs.tiers import MemoryTier, ObjectTier

from _child import finish  # tests/children/ is the script's directory, first on sys.path


def main() -> None:
    shm, url, fifos = sys.argv[1:4]
    rank = int(os.environ["RANK"])
    go = open(os.path.join(fifos, f"go{rank}"))  # the test holds the other end

    def phase(line: str) -> None:
        print(line, flush=True)
        assert go.readline().strip() == "go"

    dist.init_process_group("gloo")
    opts = json.loads(os.environ["TIERFS_TEST_STORAGE_OPTIONS"])
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64))
    opt = torch.optim.AdamW(model.parameters())

    def state(step: int) -> dict:
        model(torch.randn(8, 256)).pow(2).mean().backward()
        opt.step()
        return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}

    with TieredStore([MemoryTier(os.path.join(shm, f"rank{rank}")), ObjectTier(url, opts, retries=3)]) as store:
        for step in (1, 2):
            store.save(step, state(step))
            store.wait_until_finished()
        phase("SAVED 2")
        store.save(3, state(3))  # blocking: committed in RAM; the upload follows in the background
        phase("SAVED 3")
        store.wait_until_finished()
        phase("DURABLE 3")
        _, info = store.restore(3, tiers=["s3"])
        phase("RESTORED")
    finish({"rank": rank, "restored_from": info.tier})


if __name__ == "__main__":
    main()
