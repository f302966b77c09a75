"""One rank of a job training a small torch.nn model and saving every step to RAM and to an S3 object tier
that throttles (gloo on localhost, each process its own node, RAM in SHM/node<N>).

    throttle_child.py SHM URL ENDPOINT DIRECT STEPS RPS

RPS: the job's request budget (``ObjectTier(requests_per_second=)``), or 0 for none. Trains STEPS steps,
saving each without blocking through ENDPOINT (the throttling proxy), waits until every save is on the
object tier, then restores each step from the object tier alone, through DIRECT (the store itself), into a
fresh store and compares it bit for bit. Prints one JSON line.
"""

import copy
import os
import sys
import time

import torch
import torch.distributed as dist

from tierfs import TieredStore
from tierfs.policies import LatestN
from tierfs.tiers import MemoryTier, ObjectTier

from _child import finish  # tests/children/ is the script's directory, first on sys.path


def main() -> None:
    shm, url, endpoint, direct = sys.argv[1:5]
    steps, rps = int(sys.argv[5]), float(sys.argv[6])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # botocore's own retries off: s3fs still retries a SlowDown a few times, tierfs waits out the rest
    opts = {"endpoint_url": endpoint, "key": "testing", "secret": "testing", "skip_instance_cache": True,
            "config_kwargs": {"connect_timeout": 5, "read_timeout": 30, "retries": {"max_attempts": 0}}}
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    node = os.path.join(shm, f"node{os.environ['TIERFS_NODE_RANK']}")
    saved, errors = {}, []
    t0 = time.monotonic()
    obj = ObjectTier(url, opts, retries=2, requests_per_second=rps or None, keep=LatestN(steps))
    with TieredStore([MemoryTier(node, keep=LatestN(1)), obj]) as store:
        for step in range(1, steps + 1):
            loss = model(torch.randn(16, 32)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            saved[step] = copy.deepcopy(state)
            try:
                store.save(step, state, blocking=False)
            except Exception as e:  # noqa: BLE001 - what training would see
                errors.append(f"{type(e).__name__}: {e}")
        store.wait_until_finished()
        elapsed = time.monotonic() - t0
        on_object = sorted(s for s, tiers in store.steps().items() if obj.name in tiers)
    exact = {}
    with TieredStore([MemoryTier(os.path.join(node, "fresh")), ObjectTier(url, {**opts, "endpoint_url": direct})]) \
            as store:
        for step in range(1, steps + 1):
            got, _ = store.restore(step, tiers=[obj.name])
            exact[step] = all(torch.equal(a, b) for a, b in zip(_tensors(got), _tensors(saved[step])))
    finish({"rank": rank, "errors": errors, "on_object": on_object, "exact": exact, "elapsed": elapsed,
            "t0": t0, "t1": t0 + elapsed})


def _tensors(state):
    if isinstance(state, dict):
        for k in sorted(state, key=str):
            yield from _tensors(state[k])
    elif isinstance(state, (list, tuple)):
        for v in state:
            yield from _tensors(v)
    elif isinstance(state, torch.Tensor):
        yield state


if __name__ == "__main__":
    main()
