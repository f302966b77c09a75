"""One rank of a two-rank job exercising ``TorchGroup.exchange`` of a group forked with two lanes (gloo on
localhost; over the streams it makes one).

Rank 0's ``on_received`` fails on the second buffer: rank 0 must still send everything and raise only after,
rank 1 must get every byte, and the group must stay in step. Before the exchange, rank 0 connects to rank 1's
stream socket as a stranger would (a greeting that is not tierfs's). With ``NO_STREAMS_RANK`` set, that rank
turns streams off (``TIERFS_STREAMS=0``). Prints one JSON line.
"""

import os
import socket
import threading

import numpy as np
import torch.distributed as dist

from tierfs.ranks import GATHER_WIDTH, TorchGroup

from _child import finish  # tests/children/ is the script's directory, first on sys.path


def main() -> None:
    if os.environ.get("NO_STREAMS_RANK") == os.environ["RANK"]:
        os.environ["TIERFS_STREAMS"] = "0"
    dist.init_process_group("gloo")
    g = TorchGroup().fork(lanes=2)
    me, other = g.rank, 1 - g.rank
    out: dict = {"rank": me, "streams": g._link is not None, "lanes": len(g._lanes)}
    if me == 0 and g._link is not None:  # a stranger's greeting: rank 1 closes the connection unread
        from tierfs.ranks import diagnosis, plane

        host, port = bytes(diagnosis.job_store(dist).get(plane.key(g._link.launch, 1))).decode().rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as c:
            c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 2)
            out["stranger_closed"] = c.recv(1) == b""
    sizes = [1000, 0, 300_000, 7, 65_536]
    out_bufs = [np.random.default_rng(10 * me + k).integers(0, 255, n, dtype=np.uint8) for k, n in enumerate(sizes)]
    in_bufs = [np.zeros(n, np.uint8) for n in sizes]
    seen, threads = [], set()

    def on_received(i: int) -> None:
        seen.append(i)
        threads.add(threading.get_ident())
        if me == 0 and i == 1:
            raise RuntimeError("check failed")

    paced = []
    try:
        g.exchange([(other, b) for b in out_bufs], [(other, b) for b in in_bufs], pace=paced.append,
                   on_received=on_received)
        out["raised"] = None
    except RuntimeError as e:
        out["raised"] = str(e)
    # the exchange was one message each way on the pair's streams (the collectives after it add more)
    streamed = g._link is not None and (g._link._sent.get(other), g._link._got.get(other)) == (1, 1)
    want = [np.random.default_rng(10 * other + k).integers(0, 255, n, dtype=np.uint8) for k, n in enumerate(sizes)]
    out.update(exact=all(a.tobytes() == b.tobytes() for a, b in zip(in_bufs, want)), seen=seen, paced=paced,
               off_thread=threading.get_ident() not in threads, after=g.all_gather(me),
               streamed=streamed, tree=g._tree,
               # JSON of any length: one rank's over the first collective's width takes a second round
               gathered=[g.all_gather(x) for x in ("é" * GATHER_WIDTH if me else [me], {"r": me}, "x" * me)])
    finish(out)


if __name__ == "__main__":
    main()
