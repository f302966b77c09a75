"""One rank of the coordination-scale measurement (benchmarks/_scale.py runs it, one process per rank).

    scale_child.py JOB[:replicated] RAMROOT URL ENDPOINT TIMEOUT
    scale_child.py --zygote        (forks ranks on request: see zygote())
JOB: ``save`` (open, first save, two more saves, steady save (its retention deletes as every later one does), the training thread's part of a blocking=False
save, close), ``restore`` (open, restore the newest step, close: a plain restart) or ``node_loss`` (the
same, after the parent removed the last rank's RAM directory). RAMROOT/node<N> is the rank's RAM
directory; URL the object tier's (shared by every rank); ENDPOINT the rank's own port on the
request-counting proxy in front of the S3 server (its ``/__scale__/counts`` says what this rank asked for).

Before tierfs is imported, every call into torch.distributed is wrapped to be counted (module functions
and ``ProcessGroup`` methods, a call inside another counted once, by its outermost function; its tensor
bytes by the innermost call that moved tensors). The job's TCPStore is hosted by the parent (as torchrun's
agent does) and each rank reaches it through a port of its own (``MASTER_PORT``) on a proxy that counts its
operations, gloo's from C++ included (a Python wrapper store would not do: gloo's lazily connected groups
clone the store, which a Python store cannot). Each operation is measured on every rank between two snapshots (``Meter.op``), with a barrier
before it that is not counted. Prints one JSON line last: ``{"rank", "world", "ops": {op: figures},
"calls": {op: {function: n}}, "sites": {op: {site: n}}, "info": ...}``.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import sys
import threading
import time
import urllib.request

import torch
import torch.distributed as dist

# -- counting calls into torch.distributed ---------------------------------------------------------------
_P2P = {"send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list",
        "recv_anysource"}
_FUNCS = ("all_gather", "all_gather_object", "all_gather_into_tensor", "all_reduce", "all_to_all",
          "all_to_all_single", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "gather",
          "gather_object", "scatter", "scatter_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor",
          "send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list")
_PG_METHODS = ("allgather", "allgather_coalesced", "allgather_into_tensor_coalesced", "_allgather_base",
               "allreduce", "allreduce_coalesced", "broadcast", "barrier", "monitored_barrier", "gather",
               "scatter", "reduce", "reduce_scatter", "_reduce_scatter_base", "alltoall", "alltoall_base",
               "send", "recv", "recv_anysource")

_lock = threading.Lock()
_local = threading.local()
_MAIN = threading.main_thread().ident
#: counters: (scope, key) -> n; scope "all" (every thread) or "main" (the training thread)
_counts: collections.Counter = collections.Counter()
_paused = threading.Event()  # set: nothing counted (the meter's own barriers)
_TIERFS = os.sep + "tierfs" + os.sep
_RANKS = os.sep + "tierfs" + os.sep + "ranks" + os.sep


def _add(key: str, n: int = 1) -> None:
    if _paused.is_set() or not n:
        return
    main = threading.get_ident() == _MAIN
    with _lock:
        _counts[("all", key)] += n
        if main:
            _counts[("main", key)] += n


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.nelement() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0


def _site() -> str:
    """Where tierfs called from: its innermost frame outside tierfs/ranks/ (the caller of the collective),
    and the tierfs/ranks/ function it called (the outermost frame there)."""
    f = sys._getframe(2)
    prim = caller = ""
    while f is not None:
        fn = f.f_code.co_filename
        if _TIERFS in fn:
            rel = fn[fn.rindex(_TIERFS) + 1:]
            if _RANKS in fn:  # the outermost frame in tierfs/ranks/: the entry the caller used
                prim = f"{rel}:{f.f_code.co_name}"
            else:
                caller = f"{rel}:{f.f_code.co_name}"
                break
        f = f.f_back
    return f"{caller or '(not tierfs)'} <- {prim or '-'}"


def _bytes_of(name: str, args: tuple, kwargs: dict) -> tuple[int, int]:
    """(sent, received) tensor bytes of one call, as the caller sees them (a collective's logical bytes)."""
    a0 = args[0] if args else kwargs.get("tensor", kwargs.get("tensors"))
    if name in ("send", "isend"):
        return _nbytes(a0), 0
    if name in ("recv", "irecv", "recv_anysource"):
        return 0, _nbytes(a0)
    if name == "all_gather":  # (tensor_list, tensor)
        mine = _nbytes(args[1]) if len(args) > 1 else _nbytes(kwargs.get("tensor"))
        out = _nbytes(a0)
        return mine * max(0, (len(a0) if isinstance(a0, list) else 1) - 1), max(0, out - mine)
    if name in ("allgather",):  # ProcessGroup.allgather(output_lists, input_list)
        return _nbytes(args[1]) if len(args) > 1 else 0, _nbytes(a0)
    if name in ("barrier", "monitored_barrier"):
        return 0, 0
    n = _nbytes(a0)
    return n, n


def _wrap(owner, name: str, label: str, p2p: bool):
    orig = getattr(owner, name, None)
    if orig is None or getattr(orig, "_scale_counted", False):
        return

    def counted(*args, **kwargs):
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        outer = not stack
        if outer:
            _add("calls")
            _add("p2p_calls" if p2p else "collective_calls")
            _add(f"fn:{label}")
            _add(f"site:{_site()} [{label}]")
        frame = [False]  # an inner call counted bytes
        stack.append(frame)
        try:
            return orig(*args, **kwargs)
        finally:
            stack.pop()
            if not frame[0]:
                try:
                    sent, got = _bytes_of(name, args[1:] if owner is _PG else args, kwargs)
                except Exception:  # noqa: BLE001 - an unusual signature: no bytes
                    sent = got = 0
                if sent or got:
                    _add("bytes_sent", sent)
                    _add("bytes_recv", got)
                    if stack:
                        stack[-1][0] = True

    counted._scale_counted = True  # type: ignore[attr-defined]
    counted.__wrapped__ = orig  # type: ignore[attr-defined]
    setattr(owner, name, counted)


_PG = torch._C._distributed_c10d.ProcessGroup


def _wrap_new_group() -> None:
    orig = dist.new_group
    if getattr(orig, "_scale_counted", False):
        return

    def new_group(*args, **kwargs):
        _add("groups_created")
        _add(f"site:{_site()} [new_group]")
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        stack.append([True])  # what it does inside (its barrier) is part of creating the group
        try:
            return orig(*args, **kwargs)
        finally:
            stack.pop()

    new_group._scale_counted = True  # type: ignore[attr-defined]
    dist.new_group = new_group


def _wrap_streams() -> None:
    """Count tierfs's collectives over its streams (a tree of the ranks, tierfs.ranks.tree) and their
    messages (each rank's depend on its place in the tree: how many children it has, not the job's size),
    and the buffers its exchanges move over them (point to point)."""
    from tierfs.ranks import streams, tree

    orig = tree.up_and_down
    if getattr(orig, "_scale_counted", False):
        return

    def up_and_down(*args, **kwargs):
        _add("stream_collectives")
        _add(f"fn:tree.{sys._getframe(1).f_code.co_name}")
        _add(f"site:{_site()} [tree]")
        return orig(*args, **kwargs)

    def send(self, io, dst, data, _send=streams.Link.send):
        _add("stream_messages")
        _add("stream_bytes_sent", len(data))
        return _send(self, io, dst, data)

    def receive(self, io, src, _receive=streams.Link.receive):
        out = _receive(self, io, src)
        _add("stream_messages")
        _add("stream_bytes_recv", len(out))
        return out

    def run(self, io, sends, recvs, *args, _run=streams.Link.run):
        _add("stream_p2p", len(sends) + len(recvs))
        _add("stream_p2p_bytes_sent", sum(b.nbytes for _, b in sends))
        _add("stream_p2p_bytes_recv", sum(b.nbytes for _, b in recvs))
        return _run(self, io, sends, recvs, *args)

    up_and_down._scale_counted = True  # type: ignore[attr-defined]
    tree.up_and_down = up_and_down
    streams.Link.send, streams.Link.receive, streams.Link.run = send, receive, run


def install() -> None:
    """Wrap torch.distributed's functions and ProcessGroup's methods (before tierfs is imported; its
    collectives over its streams once it is)."""
    for name in _FUNCS:
        _wrap(dist, name, name, name in _P2P)
    for name in _PG_METHODS:
        _wrap(_PG, name, f"ProcessGroup.{name}", name in _P2P)
    _wrap_new_group()
    _wrap_streams()


# -- what the process holds ------------------------------------------------------------------------------
def sockets(store_port: int, s3_port: int) -> dict[str, int]:
    """Socket descriptors this process holds, and of its TCP sockets: established connections, listening
    ones, connections to the rendezvous store (TCPStore) and to the object store."""
    inodes = set()
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            fds += 1
            inodes.add(link[8:-1])
    est = listen = store = s3 = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    p = line.split()
                    if p[9] not in inodes:
                        continue
                    rport, st = int(p[2].rsplit(":", 1)[1], 16), p[3]
                    if st == "0A":
                        listen += 1
                    elif st == "01":
                        est += 1
                        store += rport == store_port
                        s3 += rport == s3_port
        except OSError:
            pass
    threads = len(os.listdir("/proc/self/task"))
    return {"socket_fds": fds, "tcp_established": est, "tcp_listening": listen,
            "tcp_to_store": store, "tcp_to_object_store": s3, "threads": threads}


class Meter:
    """Per operation: counters before and after, on every thread or only the training thread."""

    def __init__(self, endpoint: str, store_port: int) -> None:
        """``endpoint``: this rank's port on the counting proxy (object store requests; its counts include
        this rank's TCPStore operations, ``store_*``); ``store_port``: its port to the TCPStore."""
        self.endpoint = endpoint.rstrip("/")
        self.store_port = store_port
        self.s3_port = int(self.endpoint.rsplit(":", 1)[1])
        self.ops: dict[str, dict[str, float]] = {}
        self.barrier()  # the job's own group connected: what it holds is not tierfs's
        self.own = sockets(store_port, self.s3_port)
        self.calls: dict[str, dict[str, int]] = {}
        self.sites: dict[str, dict[str, int]] = {}
        self.objects_by: dict[str, dict[str, int]] = {}  # per operation: bytes by kind, requests by key prefix

    def objects(self) -> dict[str, int]:
        with urllib.request.urlopen(f"{self.endpoint}/__scale__/counts", timeout=60) as r:
            return json.loads(r.read())

    def barrier(self) -> None:
        _paused.set()
        try:
            dist.barrier()
        finally:
            _paused.clear()

    def run(self, name: str, fn, *, scope: str = "all", after=None):
        """Measure ``fn()`` (then ``after()``, untimed but counted) as operation ``name``; with scope
        "main", only what the training thread did (the object store's requests are the whole process's)."""
        self.barrier()
        o0 = self.objects()
        with _lock:
            c0 = collections.Counter(_counts)
        t0 = time.perf_counter()
        out = fn()
        if after is not None:
            after()
        dt = time.perf_counter() - t0
        socks = sockets(self.store_port, self.s3_port)
        with _lock:
            c1 = collections.Counter(_counts)
        o1 = self.objects()
        d = {k: c1[(s, k)] - c0[(s, k)] for (s, k) in set(c1) | set(c0) if s == scope}
        figures = {k: v for k, v in d.items() if ":" not in k}
        for k in ("calls", "collective_calls", "p2p_calls", "bytes_sent", "bytes_recv", "groups_created",
                  "stream_collectives", "stream_messages", "stream_bytes_sent", "stream_bytes_recv", "stream_p2p",
                  "stream_p2p_bytes_sent", "stream_p2p_bytes_recv"):
            figures.setdefault(k, 0)
        figures.update(socks)
        figures["tierfs_socket_fds"] = socks["socket_fds"] - self.own["socket_fds"]
        figures["tierfs_tcp_established"] = socks["tcp_established"] - self.own["tcp_established"]
        proxied = {k: o1.get(k, 0) - o0.get(k, 0) for k in set(o0) | set(o1)}
        figures.update({k if k.startswith("store_") else f"s3_{k}": v for k, v in proxied.items() if ":" not in k})
        self.objects_by[name] = {k: v for k, v in proxied.items() if k.startswith(("bytes:", "prefix:")) and v}
        figures["seconds"] = dt
        self.ops[name] = figures
        self.calls[name] = {k[3:]: v for k, v in d.items() if k.startswith("fn:") and v}
        self.calls[name].update({k: v for k, v in proxied.items() if k.startswith("store:") and v})
        self.sites[name] = {k[5:]: v for k, v in d.items() if k.startswith("site:") and v}
        return out


# -- the rank's work -------------------------------------------------------------------------------------
def model_state(rank: int, mib: float) -> dict:
    """A torch.nn MLP with its AdamW state after a step, about ``mib`` MiB in all (3x the parameters):
    layers of 256 wide, as many as the size needs, each a weight and a bias."""
    import torch

    torch.manual_seed(rank)
    width = 256
    layers = max(1, round(mib * (1 << 20) / 3 / 4 / (width * width + width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def state_bytes(state) -> int:
    import torch

    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return state.numel() * state.element_size() if isinstance(state, torch.Tensor) else 0


def state_for(rank: int, step: int, replicated: object = None) -> dict:
    """A tiny state: a few small arrays (sizes differ by rank) and a number; with ``replicated``, also an
    array every rank holds alike ("shared")."""
    import numpy as np

    rng = np.random.default_rng(1000 * rank + step)
    state = {"w": rng.standard_normal(4096 + rank).astype(np.float32),
             "b": rng.integers(0, 255, 1000 + rank, dtype=np.uint8),
             "m": {"mean": rng.standard_normal(256).astype(np.float32), "count": np.arange(8, dtype=np.int64)},
             "step": step}
    if replicated:
        state["shared"] = np.random.default_rng(step).standard_normal(2048).astype(np.float32)
    return state


def same(a, b) -> bool:
    import numpy as np

    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


#: steps the save job saves: the first, two more (the second's retention deletes the first's marker, the
#: ranks take back its files at the next save's), the steady one, the one saved with blocking=False
FIRST, STEADY, NONBLOCKING = 1, 4, 5


def main() -> None:
    job, ramroot, url, endpoint, timeout = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
    job, _, variant = job.partition(":")  # "save:replicated": an array every rank holds alike, declared so
    replicated = ["shared"] if variant == "replicated" else None
    install()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    port = int(os.environ["MASTER_PORT"])  # this rank's own port to the TCPStore, which the parent hosts
    tcp = dist.TCPStore(os.environ["MASTER_ADDR"], port, world, False, timeout=datetime.timedelta(seconds=timeout),
                        wait_for_workers=False)
    dist.init_process_group("gloo", store=tcp, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout))

    from tierfs import TieredStore  # after the wrappers: whatever it binds is the counted function
    from tierfs.policies import LatestN
    from tierfs.tiers import MemoryTier, ObjectTier, PeerTier

    meter = Meter(endpoint, port)
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
               "config_kwargs": {"read_timeout": 60, "connect_timeout": 30, "retries": {"max_attempts": 3}}}

    def tiers():
        return [MemoryTier(os.path.join(ramroot, f"node{os.environ['TIERFS_NODE_RANK']}"), keep=LatestN(2)),
                PeerTier(replicas=1),
                ObjectTier(url, storage_options=options, keep=LatestN(2))]

    def open_store() -> TieredStore:
        return TieredStore(tiers(), timeout=timeout, background_bandwidth=None)

    import tierfs

    info: dict = {"tierfs": os.path.dirname(os.path.dirname(os.path.abspath(tierfs.__file__)))}
    store = meter.run("open", open_store)
    if job == "save":
        meter.run("first_save", lambda: store.save(FIRST, state_for(rank, FIRST, replicated), replicated=replicated),
                  after=store.wait_until_finished)
        meter.barrier()
        for s in range(FIRST + 1, STEADY):
            store.save(s, state_for(rank, s, replicated), replicated=replicated)
            store.wait_until_finished()
        meter.run("steady_save", lambda: store.save(STEADY, state_for(rank, STEADY, replicated), blocking=True,
                                                    replicated=replicated),
                  after=store.wait_until_finished)
        meter.run("save_nonblocking", lambda: store.save(NONBLOCKING, state_for(rank, NONBLOCKING, replicated),
                                                         blocking=False, replicated=replicated),
                  scope="main")
        store.wait_until_finished()
        info["steps"] = {str(k): v for k, v in store.steps().items()}
    elif job == "requests":  # the object store's side of a save: RAM + S3, a model's state of a given size
        store.close()
        mib = float(os.environ.get("SCALE_STATE_MIB", "4"))
        store = TieredStore([MemoryTier(os.path.join(ramroot, f"node{os.environ['TIERFS_NODE_RANK']}"), keep=LatestN(1)),
                             ObjectTier(url, storage_options=options, keep=LatestN(2),
                                        part_size=int(float(os.environ.get("SCALE_PART_MIB", "16")) * (1 << 20)))],
                            timeout=timeout, background_bandwidth=None,
                            file_size=int(float(os.environ.get("SCALE_FILE_MIB", "16")) * (1 << 20)))
        state = model_state(rank, mib)
        info["state_bytes"] = state_bytes(state)
        for s in range(FIRST, STEADY):  # retention on the object tier starts deleting at the third
            store.save(s, state)
            store.wait_until_finished()
        meter.run("steady_save", lambda: store.save(STEADY, state), after=store.wait_until_finished)
        step_dir = os.path.join(ramroot, f"node{os.environ['TIERFS_NODE_RANK']}", f"step_{STEADY:012d}")
        info["files"] = sorted(os.path.getsize(os.path.join(step_dir, n))  # the shard's data files' sizes
                               for n in os.listdir(step_dir) if n.endswith(".bin"))
    elif job in ("restore", "node_loss"):
        state, got = meter.run(job, lambda: store.restore(), after=store.wait_until_finished)
        info.update({"step": got.step, "tier": got.tier, "peer": got.peer})
        if not same(state, state_for(rank, got.step, replicated)):
            raise AssertionError(f"rank {rank}: the restored state differs from step {got.step}'s")
    else:
        raise SystemExit(f"unknown job {job!r}")
    meter.run("close", store.close)
    meter.barrier()
    print(json.dumps({"rank": rank, "world": world, "ops": meter.ops, "calls": meter.calls, "sites": meter.sites,
                      "objects": meter.objects_by, "info": info}, default=str), flush=True)
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: torch's gloo teardown aborts now and then after the work is done


def run() -> None:
    """main(), ending the process: exit 0 from main, or the traceback and exit 1."""
    try:
        main()
    except BaseException:  # noqa: BLE001 - the traceback, then a failed exit the parent sees at once
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def zygote() -> None:
    """Import torch, the S3 client and tierfs once, counting wrappers installed, then fork a rank per request
    (one JSON line on stdin: ``{"id", "argv", "env", "stdout", "stderr"}``), answering ``{"id", "pid"}``, and
    ``{"pid", "rc"}`` when a rank ends. A rank is a new process that starts with everything imported, so a
    job of 64 ranks starts in a second on 2 cores instead of importing torch 64 times; the zygote runs no
    thread and no torch work, so forking it is safe."""
    import select

    install()
    import numpy  # noqa: F401
    import s3fs  # noqa: F401

    import tierfs.tiers  # noqa: F401
    from tierfs import TieredStore  # noqa: F401

    if threading.active_count() != 1:
        raise SystemExit(f"the zygote holds {threading.active_count()} threads after its imports: not forking")
    children: set[int] = set()
    print(json.dumps({"ready": os.getpid()}), flush=True)
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.05)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            print(json.dumps({"pid": pid, "rc": os.waitstatus_to_exitcode(status)}), flush=True)
        if not ready:
            continue
        line = sys.stdin.readline()
        if not line:
            return
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
                    f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    os.dup2(f, fd)
                    os.close(f)
                os.environ.clear()
                os.environ.update(req["env"])
                sys.argv = [__file__, *req["argv"]]
            except BaseException:  # noqa: BLE001
                os._exit(3)
            run()
        children.add(pid)
        print(json.dumps({"id": req["id"], "pid": pid}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--zygote"]:
        zygote()
    else:
        run()
