"""One rank of a job (gloo on localhost, each process its own node, RAM in SHM/node<N>) that opens a store of
a RAM tier and an object tier at URL (its storage options as JSON in ``TIERFS_TEST_STORAGE_OPTIONS``) and
reports what the open raised: ``[error class, message]``, or None. Prints one JSON line.

    open_child.py SHM URL
"""

import json
import os
import sys

import torch.distributed as dist

from tierfs import TieredStore
from tierfs.tiers import MemoryTier, ObjectTier

from _child import finish  # tests/children/ is the script's directory, first on sys.path


def main() -> None:
    shm, url = sys.argv[1:3]
    dist.init_process_group("gloo")
    opts = json.loads(os.environ["TIERFS_TEST_STORAGE_OPTIONS"])
    node = os.path.join(shm, f"node{os.environ['TIERFS_NODE_RANK']}")
    raised = None
    try:
        with TieredStore([MemoryTier(node), ObjectTier(url, opts)], timeout=60):
            pass
    except Exception as e:  # noqa: BLE001 - what the user would see
        raised = [type(e).__name__, str(e)]
    finish({"rank": dist.get_rank(), "raised": raised})


if __name__ == "__main__":
    main()
