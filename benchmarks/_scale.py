"""Coordination at scale: what each rank does per operation, counted, for a job of N processes.

    from _scale import Harness, measure
    with Harness() as h:                          # moto S3 (a subprocess), its counting proxy, the zygotes
        two = measure(2, ["steady_save"], harness=h)
        six = measure(6, ["steady_save"], harness=h)
    six[rank]["steady_save"]["calls"]             # figures per rank and operation (FIGURES)

(A test can compare ``two`` and ``six``: a figure per rank that is flat does not change from 2 to 6 ranks.
Both together take a few seconds: ranks are forked from a zygote that imported everything once.)

``measure(n, ops)`` runs ``tests/children/scale_child.py`` as a gloo job of ``n`` processes on this machine,
each its own node (``TIERFS_NODE_RANK`` = rank, its own RAM directory under /dev/shm), with a RAM tier,
``PeerTier(replicas=1)`` and an S3 object tier, every tier keeping 2 steps. Up to three jobs run, as many as
``ops`` need: ``save`` (``open``, ``first_save``, ``steady_save``, ``save_nonblocking``, ``close``), then
``restore`` (new processes restore the newest step), then ``node_loss`` (new processes, the last rank's RAM
directory removed first: its shard comes from its peer).

How each rank's part is told apart: the child counts its own calls into torch.distributed (wrappers
installed before tierfs is imported) and reads its sockets in /proc; each rank talks to S3 through its own
port of the tests' request-counting HTTP proxy (``tests/_faultproxy.py``'s ``FaultProxy``, no faults set),
and to the job's TCPStore, which this process hosts as torchrun's agent does, through its own port of a
proxy that counts TCPStore requests (:class:`StoreProxy`: gloo's rendezvous runs in C++, out of reach of a
Python wrapper). The child asks the proxy for its counts before and after each operation.

Figures per rank and operation (:data:`FIGURES`): calls into torch.distributed (collectives and
point-to-point messages) and the tensor bytes they moved, process groups created, TCPStore requests,
sockets, connections and threads the process holds after it, object-store requests by kind and keys listed,
seconds. ``save_nonblocking`` counts only the training thread's calls, bytes and groups (until ``save``
returns); its TCPStore and object-store requests are whatever the process sent meanwhile.

:func:`analyse`, :func:`report` and :func:`compare` turn the counts of several N into the tables
``bench_scale.py`` prints: the median over ranks and rank 0 per N, the growth from 4 to 64 ranks, and a
least-squares fit ``a + b*N`` per rank extrapolated to 1,024 and 8,192 ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from typing import Iterable, Mapping, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TESTS = os.path.join(REPO, "tests")
if TESTS not in sys.path:  # the object store's proxy is the tests' (tests/_faultproxy.py)
    sys.path.append(TESTS)

from _faultproxy import FaultProxy  # noqa: E402
from _httpwire import close_quietly  # noqa: E402

CHILD = os.path.join(REPO, "tests", "children", "scale_child.py")
BUCKET = "tierfs-scale"

#: operations, in the order the jobs do them, and the job each belongs to
OPS = ("open", "first_save", "steady_save", "save_nonblocking", "close", "restore", "node_loss")
JOB_OPS = {"save": ("open", "first_save", "steady_save", "save_nonblocking", "close"),
           "restore": ("restore",), "node_loss": ("node_loss",)}
OP_LABELS = {
    "open": "open (TieredStore constructor, first job)",
    "first_save": "first save (blocking, then wait_until_finished)",
    "steady_save": "steady save (3rd save, blocking, then wait_until_finished: replication and upload included)",
    "save_nonblocking": "save(blocking=False): the training thread's part, until save returns",
    "close": "close (first job)",
    "restore": "restore on restart (new processes, newest step, then wait_until_finished)",
    "node_loss": "restore after a node loss (last rank's RAM directory removed; then wait_until_finished)",
}
#: (figure, what it is) in table order
FIGURES = (
    ("calls", "calls into torch.distributed (outermost; collectives + point-to-point)"),
    ("collective_calls", "collective calls (all_gather, barrier, ...)"),
    ("p2p_calls", "point-to-point messages (isend/irecv/send/recv)"),
    ("bytes_sent", "tensor bytes sent"),
    ("bytes_recv", "tensor bytes received"),
    ("groups_created", "process groups created (dist.new_group)"),
    ("stream_collectives", "collectives over tierfs's streams (a tree of the ranks)"),
    ("stream_messages", "their messages (sent + received; 3 neighbours at most)"),
    ("stream_bytes_sent", "their bytes sent"),
    ("stream_bytes_recv", "their bytes received"),
    ("stream_p2p", "buffers sent + received point to point over tierfs's streams (exchanges)"),
    ("stream_p2p_bytes_sent", "their bytes sent"),
    ("stream_p2p_bytes_recv", "their bytes received"),
    ("store_writes", "TCPStore writes (set/add/compare_set/append/delete/multi_set)"),
    ("store_reads", "TCPStore reads (get/multi_get/check/num_keys)"),
    ("store_waits", "TCPStore waits (every get is a wait, then the get)"),
    ("store_connects", "new TCPStore clients (a clone per lazily connected group)"),
    ("socket_fds", "socket descriptors held after"),
    ("tcp_established", "TCP connections held after"),
    ("tierfs_socket_fds", "socket descriptors held after, less the job's own (its default group, the TCPStore)"),
    ("tierfs_tcp_established", "TCP connections held after, less the job's own"),
    ("tcp_listening", "listening TCP sockets after"),
    ("tcp_to_store", "connections to the TCPStore after"),
    ("tcp_to_object_store", "connections to the object store after"),
    ("threads", "threads after"),
    ("s3_LIST", "object store LIST requests"),
    ("s3_keys_listed", "keys listed (KeyCount)"),
    ("s3_PUT", "PUT requests (parts, multipart start/end included)"),
    ("s3_HEAD", "HEAD requests"),
    ("s3_GET", "GET object reads"),
    ("s3_DELETE", "DELETE requests (single and bulk)"),
    ("s3_keys_deleted", "keys deleted"),
    ("s3_OTHER", "other requests"),
    ("seconds", "wall seconds (this machine, 2 cores shared: indicative only)"),
)
#: figures that are levels held after the operation (not counts of what it did)
LEVELS = {"socket_fds", "tcp_established", "tierfs_socket_fds", "tierfs_tcp_established", "tcp_listening", "tcp_to_store", "tcp_to_object_store",
          "threads"}
S3_KINDS = ("LIST", "keys_listed", "PUT", "HEAD", "GET", "DELETE", "keys_deleted", "OTHER")

_AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
_AWS_ENV_DROP = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_REGION",
                 "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")


# -- the TCPStore's counting proxy ----------------------------------------------------------------------
#: TCPStore's client requests (torch 2.13: a command byte, then its arguments: strings and byte strings as
#: a uint64 length and the bytes, counts as uint64, numbers as int64/uint32), by command byte: (name, kind,
#: arguments) where kind is write, read, wait or connect, and each argument s (a string), b (bytes), i8
#: (8 bytes), i4 (4 bytes), n (a count of the strings that follow) or kv (a count of key, value pairs)
STORE_COMMANDS = {
    0: ("VALIDATE", "connect", ("i4",)),
    1: ("SET", "write", ("s", "b")),
    2: ("COMPARE_SET", "write", ("s", "b", "b")),
    3: ("GET", "read", ("s",)),
    4: ("ADD", "write", ("s", "i8")),
    5: ("CHECK", "read", ("n",)),
    6: ("WAIT", "wait", ("n",)),
    7: ("GETNUMKEYS", "read", ()),
    8: ("DELETE_KEY", "write", ("s",)),
    9: ("APPEND", "write", ("s", "b")),
    10: ("MULTI_GET", "read", ("n",)),
    11: ("MULTI_SET", "write", ("kv",)),
    12: ("CANCEL_WAIT", "wait", ()),
    13: ("PING", "connect", ("i4",)),
    14: ("QUEUE_PUSH", "write", ("s", "b")),
}


def parse_store_requests(buf: bytes) -> tuple[list[str], int, bool]:
    """The complete requests at the start of ``buf``: (their names, bytes they take, False when a command
    byte is unknown: the stream cannot be followed further)."""
    names, pos = [], 0

    def u64(at: int) -> int | None:
        return int.from_bytes(buf[at:at + 8], "little") if at + 8 <= len(buf) else None

    while pos < len(buf):
        cmd = STORE_COMMANDS.get(buf[pos])
        if cmd is None:
            return names, pos, False
        at, complete = pos + 1, True
        for arg in cmd[2]:
            if arg in ("s", "b"):
                n = u64(at)
                if n is None or at + 8 + n > len(buf):
                    complete = False
                    break
                at += 8 + n
            elif arg in ("i8", "i4"):
                at += 8 if arg == "i8" else 4
                if at > len(buf):
                    complete = False
                    break
            else:  # n strings, or n (string, bytes) pairs
                count = u64(at)
                if count is None:
                    complete = False
                    break
                at += 8
                for _ in range(count * (2 if arg == "kv" else 1)):
                    n = u64(at)
                    if n is None or at + 8 + n > len(buf):
                        complete = False
                        break
                    at += 8 + n
                if not complete:
                    break
        if not complete:
            break
        names.append(cmd[0])
        pos = at
    return names, pos, True


class StoreProxy:
    """A TCP proxy per rank in front of a TCPStore server, counting each rank's requests by command (into
    ``counts``'s ``count(rank, key, n)``): ``store_writes``, ``store_reads``, ``store_waits``,
    ``store_connects`` (new clients: gloo's lazily connected groups clone the store) and ``store:<COMMAND>``.
    Bytes pass unchanged; a request is counted before the server gets it."""

    def __init__(self, upstream_port: int, ranks: int, count) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.count = count
        self._listeners = [socket.create_server(("127.0.0.1", 0), backlog=256) for _ in range(ranks)]
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        for r, lst in enumerate(self._listeners):
            threading.Thread(target=self._serve, args=(lst, r), daemon=True).start()

    def port(self, rank: int) -> int:
        return self._listeners[rank].getsockname()[1]

    def _serve(self, lst: socket.socket, rank: int) -> None:
        while True:
            try:
                client, _ = lst.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(self.upstream)
            except OSError:
                close_quietly(client)
                continue
            for s in (client, up):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._socks += [client, up]
            threading.Thread(target=self._requests, args=(client, up, rank), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, client), daemon=True).start()

    def _requests(self, client: socket.socket, up: socket.socket, rank: int) -> None:
        buf, follow = b"", True
        try:
            while True:
                data = client.recv(1 << 16)
                if not data:
                    break
                if follow:
                    buf += data
                    names, used, follow = parse_store_requests(buf)
                    buf = buf[used:]
                    for name in names:
                        kind = next(v[1] for v in STORE_COMMANDS.values() if v[0] == name)
                        self.count(rank, f"store_{kind}s")
                        self.count(rank, f"store:{name}")
                    if not follow:
                        self.count(rank, "store_unparsed")
                up.sendall(data)
        except OSError:
            pass
        finally:
            try:
                up.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self) -> None:
        for s in self._listeners:
            close_quietly(s)
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            close_quietly(s)


# -- moto S3 in a process of its own, the proxy in front ------------------------------------------------
_MOTO = """
import logging, sys
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
s = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
s.start()
print(s.get_host_and_port()[1], flush=True)
sys.stdin.read()
s.stop()
"""


def aws_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _AWS_ENV_DROP}
    return env | _AWS_ENV


class Harness:
    """moto's S3 server (a subprocess: its CPU is not under this process's GIL) with bucket
    :data:`BUCKET`, the counting proxy (:class:`FaultProxy`, one port per rank) in front of it, and the
    zygotes that fork ranks. Use as a context manager."""

    def __init__(self, ranks: int = 2) -> None:
        self.moto = subprocess.Popen([sys.executable, "-c", _MOTO], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=aws_env(), text=True)
        port = self.moto.stdout.readline().strip()
        if not port:
            raise RuntimeError("moto's S3 server did not start")
        self.endpoint = f"http://127.0.0.1:{port}"
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=self.endpoint, key="testing",
                               secret="testing")
        for k, v in _AWS_ENV.items():
            os.environ.setdefault(k, v)
        fs.mkdir(BUCKET)
        self.proxy = FaultProxy(self.endpoint, ports=ranks, keep_alive=True)
        self._zygotes: dict[str | None, Zygote] = {}

    def keys(self, url: str) -> list[str]:
        """Every object under ``url`` (an ``s3://`` URL in :data:`BUCKET`), relative to it, sorted."""
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=self.endpoint, key="testing",
                               secret="testing")
        root = url.removeprefix("s3://").rstrip("/") + "/"
        return sorted(k[len(root):] for k in fs.find(root))

    def zygote(self, tierfs_root: str | None) -> "Zygote":
        """The zygote that forks ranks importing tierfs from ``tierfs_root`` (started on first use)."""
        if tierfs_root not in self._zygotes:
            self._zygotes[tierfs_root] = Zygote(tierfs_root)
        return self._zygotes[tierfs_root]

    def close(self) -> None:
        for z in self._zygotes.values():
            z.close()
        self.proxy.close()
        try:
            self.moto.stdin.close()
            self.moto.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.moto.kill()
            self.moto.wait()

    def __enter__(self) -> "Harness":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- the jobs --------------------------------------------------------------------------------------------
class JobError(RuntimeError):
    pass


def run_job(n: int, job: str, ramroot: str, url: str, harness: Harness, timeout: float,
            logdir: str, tierfs_root: str | None = None, fork: bool = True) -> list[dict]:
    """Run ``scale_child.py JOB`` as ``n`` ranks; every rank's JSON line, in rank order. A rank that fails
    (or a job past ``timeout`` seconds) kills the others and raises :class:`JobError` with stderr tails."""
    import datetime

    import torch.distributed as dist

    harness.proxy.ensure(n)
    wait_s = max(60.0, timeout)  # every wait of a rank on the others (store, gloo, tierfs)
    # the job's TCPStore, hosted here as torchrun's agent hosts it; each rank reaches it through its own
    # port on the counting proxy
    server = dist.TCPStore("127.0.0.1", 0, n, True, timeout=datetime.timedelta(seconds=wait_s),
                           wait_for_workers=False)
    stores = StoreProxy(server.port, n, harness.proxy.count)
    try:
        return _run_ranks(n, job, ramroot, url, harness, timeout, logdir, tierfs_root, stores, wait_s, fork)
    finally:
        stores.close()
        del server


def child_env(tierfs_root: str | None) -> dict[str, str]:
    """The environment every rank starts from (then its RANK, TIERFS_NODE_RANK and MASTER_PORT)."""
    return aws_env() | {"MASTER_ADDR": "127.0.0.1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "OMP_NUM_THREADS": "1", "TIERFS_EXIT_TIMEOUT": "0",
                        "PYTHONPATH": os.pathsep.join(p for p in (tierfs_root or REPO, os.environ.get("PYTHONPATH"))
                                                      if p)}


class _Popen:
    """A rank started as a process of its own (``fork=False``)."""

    def __init__(self, argv: list[str], env: dict[str, str], out: str, err: str) -> None:
        with open(out, "w") as o, open(err, "w") as e:
            self.p = subprocess.Popen([sys.executable, CHILD, *argv], stdout=o, stderr=e, env=env)

    def poll(self) -> int | None:
        return self.p.poll()

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


class Zygote:
    """``scale_child.py --zygote``: imports torch, the S3 client and tierfs (from ``tierfs_root``) once and
    forks a rank per request, so that starting a job of N ranks costs no N imports of torch."""

    def __init__(self, tierfs_root: str | None) -> None:
        self.p = subprocess.Popen([sys.executable, CHILD, "--zygote"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  env=child_env(tierfs_root) | {"WORLD_SIZE": "1", "RANK": "0"}, text=True)
        first = self.p.stdout.readline()
        if not first.startswith('{"ready"'):
            raise RuntimeError(f"the zygote did not start: {first!r}")
        self._lock = threading.Condition()
        self._pids: dict[int, int] = {}  # request id -> pid
        self._rcs: dict[int, int] = {}  # pid -> exit code
        self._next = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            msg = json.loads(line)
            with self._lock:
                if "rc" in msg:
                    self._rcs[msg["pid"]] = msg["rc"]
                else:
                    self._pids[msg["id"]] = msg["pid"]
                self._lock.notify_all()

    def spawn(self, argv: list[str], env: dict[str, str], out: str, err: str) -> "_Forked":
        with self._lock:
            rid = self._next
            self._next += 1
        self.p.stdin.write(json.dumps({"id": rid, "argv": argv, "env": env, "stdout": out, "stderr": err}) + "\n")
        self.p.stdin.flush()
        with self._lock:
            if not self._lock.wait_for(lambda: rid in self._pids, timeout=60):
                raise RuntimeError("the zygote did not fork a rank within 60 s")
            return _Forked(self, self._pids.pop(rid))

    def rc(self, pid: int) -> int | None:
        with self._lock:
            return self._rcs.get(pid)

    def wait(self, pid: int, timeout: float) -> None:
        with self._lock:
            self._lock.wait_for(lambda: pid in self._rcs, timeout=timeout)

    def close(self) -> None:
        try:
            self.p.stdin.close()
            self.p.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.p.kill()
            self.p.wait()


class _Forked:
    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.z, self.pid = zygote, pid

    def poll(self) -> int | None:
        return self.z.rc(self.pid)

    def kill(self) -> None:
        if self.z.rc(self.pid) is None:
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass
            self.z.wait(self.pid, 10)


def _run_ranks(n: int, job: str, ramroot: str, url: str, harness: Harness, timeout: float, logdir: str,
               tierfs_root: str | None, stores: StoreProxy, wait_s: float, fork: bool) -> list[dict]:
    base = child_env(tierfs_root) | {"WORLD_SIZE": str(n)}
    os.makedirs(logdir, exist_ok=True)
    zygote = harness.zygote(tierfs_root) if fork else None
    procs = []
    outs = [os.path.join(logdir, f"{job}-rank{r}.out") for r in range(n)]
    errs = [os.path.join(logdir, f"{job}-rank{r}.err") for r in range(n)]
    deadline = time.monotonic() + timeout
    problem = None
    try:
        for r in range(n):
            argv = [job, ramroot, url, harness.proxy.url_of(r), str(wait_s)]
            env = base | {"RANK": str(r), "TIERFS_NODE_RANK": str(r), "MASTER_PORT": str(stores.port(r))}
            procs.append(zygote.spawn(argv, env, outs[r], errs[r]) if zygote else _Popen(argv, env, outs[r], errs[r]))
        while problem is None and any(p.poll() is None for p in procs):
            bad = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if bad:
                problem = f"rank {bad[0]} of {n} ({job}) exited with {procs[bad[0]].poll()}"
            elif time.monotonic() > deadline:
                running = [r for r, p in enumerate(procs) if p.poll() is None]
                problem = (f"the {job} job of {n} ranks did not finish within {timeout:g} s "
                           f"({len(running)} ranks still running: {running[:10]})")
            else:
                time.sleep(0.1)
        if problem is None:
            bad = [r for r, p in enumerate(procs) if p.poll() != 0]
            if bad:
                problem = f"rank {bad[0]} of {n} ({job}) exited with {procs[bad[0]].poll()}"
    finally:
        for p in procs:
            p.kill()

    def read(path: str) -> str:
        try:
            with open(path) as f:
                return f.read()
        except OSError:
            return ""

    if problem:
        tails = []
        for r in range(n):
            text = read(errs[r])
            if text.strip() and len(tails) < 3:
                tails.append(f"\n--- rank {r} stderr ---\n{text[-3000:]}")
        raise JobError(problem + "".join(tails))
    results = []
    for r in range(n):
        lines = read(outs[r]).strip().splitlines()
        try:
            results.append(json.loads(lines[-1]))
        except (IndexError, ValueError) as e:
            raise JobError(f"rank {r} of {n} ({job}) printed no JSON line last") from e
    return results


def jobs_for(ops: Iterable[str]) -> list[str]:
    ops = set(ops)
    bad = ops - set(OPS)
    if bad:
        raise ValueError(f"unknown operations {sorted(bad)}; known: {', '.join(OPS)}")
    need = [j for j, o in JOB_OPS.items() if ops & set(o)]
    if need and "save" not in need:
        need.insert(0, "save")  # a restore needs steps saved first
    return need


def measure(n: int, ops: Sequence[str] = OPS, workdir: str | None = None, *, harness: Harness | None = None,
            timeout: float | None = None, timings: dict | None = None, detail: dict | None = None,
            tierfs_root: str | None = None, fork: bool = True,
            replicated: bool = False) -> dict[int, dict[str, dict[str, float]]]:
    """Per rank, per operation in ``ops``, the figures (:data:`FIGURES`) of a job of ``n`` processes.

    ``workdir`` holds the RAM directories (a fresh one under /dev/shm by default, removed after) and the
    ranks' stderr. ``harness``: a running :class:`Harness` (else one is started and stopped here).
    ``timeout``: seconds each job may take (default grows with ``n``). ``timings`` gets each job's
    seconds; ``detail`` gets, per operation, every rank's calls by function and by tierfs call site, and
    each rank's ``info``; and under ``"keys"``, per job, the object tier's keys after it. ``tierfs_root``: the directory the ranks import tierfs from (default: this
    checkout; see :func:`_common.export_tierfs`). ``fork``: ranks are forked from a zygote that imported
    everything once (:class:`Zygote`; fast, and light on memory), else each is started as a process of its own.
    ``replicated``: the state has an array every rank holds alike, declared ``replicated`` (data parallelism:
    stored once, and checked along each group's ranks at every commit).
    """
    if n < 2:
        raise ValueError("a job of at least 2 ranks (the peer tier needs another node)")
    own_harness = harness is None
    h = harness or Harness(n)
    own_dir = workdir is None
    workdir = workdir or _fresh_shm("tierfs-scale-")
    timeout = timeout if timeout is not None else 120.0 + 8.0 * n
    run = f"{uuid.uuid4().hex[:8]}-n{n}"
    ramroot = os.path.join(workdir, f"ram-{run}")
    url = f"s3://{BUCKET}/{run}"
    os.makedirs(ramroot, mode=0o700)
    out: dict[int, dict[str, dict[str, float]]] = {r: {} for r in range(n)}
    try:
        for job in jobs_for(ops):
            if job == "node_loss":
                shutil.rmtree(os.path.join(ramroot, f"node{n - 1}"), ignore_errors=True)
            t0 = time.perf_counter()
            res = run_job(n, f"{job}:replicated" if replicated else job, ramroot, url, h, timeout,
                          os.path.join(workdir, f"logs-{run}"), tierfs_root, fork)
            if timings is not None:
                timings[job] = time.perf_counter() - t0
            if detail is not None:
                detail.setdefault("keys", {})[job] = h.keys(url)
            for r, rr in enumerate(res):
                for op, figs in rr["ops"].items():
                    if op in ops:
                        out[r][op] = figs
                        if detail is not None:
                            d = detail.setdefault(op, {"calls": {}, "sites": {}, "info": {}})
                            d["calls"][r] = rr["calls"].get(op, {})
                            d["sites"][r] = rr["sites"].get(op, {})
                            d["info"][r] = rr.get("info", {})
    finally:
        shutil.rmtree(ramroot, ignore_errors=True)
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
        if own_harness:
            h.close()
    return out


def _fresh_shm(prefix: str) -> str:
    import tempfile

    return tempfile.mkdtemp(dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None, prefix=prefix)


# -- analysis --------------------------------------------------------------------------------------------
Counts = Mapping[int, Mapping[str, Mapping[str, float]]]  # rank -> op -> figure -> value


def summarize(counts: Counts, op: str, figure: str, lost: int | None = None) -> dict[str, float]:
    """Over the ranks of one job: ``median`` (every rank), ``rank0``, ``others`` (median of the ranks but
    0 and ``lost``), ``max``, and ``lost`` (the rank whose node was lost, for node_loss)."""
    vals = {int(r): float(c[op].get(figure, 0)) for r, c in counts.items() if op in c}
    if not vals:
        return {}
    others = [v for r, v in vals.items() if r != 0 and r != lost]
    out = {"median": statistics.median(vals.values()), "rank0": vals.get(0, float("nan")),
           "others": statistics.median(others) if others else float("nan"), "max": max(vals.values())}
    if lost is not None and lost in vals:
        out["lost"] = vals[lost]
    return out


def fit(ns: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares ``y = a + b*N``: (a, b)."""
    if len(ns) == 1:
        return ys[0], 0.0
    mn, my = statistics.fmean(ns), statistics.fmean(ys)
    sxx = sum((x - mn) ** 2 for x in ns)
    b = sum((x - mn) * (y - my) for x, y in zip(ns, ys)) / sxx if sxx else 0.0
    return my - b * mn, b


def num(x: float) -> str:
    if x != x:
        return "-"
    if x in (float("inf"), float("-inf")):
        return "inf" if x > 0 else "-inf"
    ax = abs(x)
    if ax < 1e-9:
        return "0"
    if ax >= 1e9:
        return f"{x / 1e9:.3g}G"
    if ax >= 1e6:
        return f"{x / 1e6:.3g}M"
    if ax >= 1e4:
        return f"{x / 1e3:.3g}k"
    if ax >= 100 or ax == int(ax):
        return f"{x:.0f}"
    return f"{x:.3g}"


def growth(lo: float, hi: float) -> float:
    if lo == 0:
        return 1.0 if hi == 0 else float("inf")
    return hi / lo


def ratio(x: float) -> str:
    return "new" if x == float("inf") else f"{x:.2f}x"


#: a figure that grows more than this from 4 to 64 ranks is flagged
GROWS = 1.2


def analyse(by_n: Mapping[int, Counts], op: str, lo: int = 4, hi: int = 64) -> list[dict]:
    """Per figure: the summaries per N, the growth ``hi``/``lo`` (the smallest and largest N measured when
    those were not), the fit of the per-rank median and of rank 0 (over N >= ``lo`` when two such N exist)
    and their values at 1,024 and 8,192."""
    ns = sorted(n for n in by_n if any(op in c for c in by_n[n].values()))
    rows: list[dict] = []
    if not ns:
        return rows
    top = hi if hi in ns else ns[-1]
    base = lo if lo in ns and lo < top else ns[0]
    fit_ns = [n for n in ns if n >= lo] if len([n for n in ns if n >= lo]) >= 2 else ns
    for fig, what in FIGURES:
        per = {n: summarize(by_n[n], op, fig, lost=n - 1 if op == "node_loss" else None) for n in ns}
        if not all(per.values()):
            continue
        a, b = fit(fit_ns, [per[n]["median"] for n in fit_ns])
        a0, b0 = fit(fit_ns, [per[n]["rank0"] for n in fit_ns])
        g_med = growth(per[base]["median"], per[top]["median"])
        g_r0 = growth(per[base]["rank0"], per[top]["rank0"])
        rows.append({"figure": fig, "what": what, "per": per, "lo": base, "hi": top, "growth": g_med,
                     "growth_rank0": g_r0, "fit": (a, b), "fit_rank0": (a0, b0),
                     "at": {k: a + b * k for k in (1024, 8192)}, "at_rank0": {k: a0 + b0 * k for k in (1024, 8192)},
                     "grows": (g_med > GROWS or g_r0 > GROWS) and fig != "seconds"})
    return rows


def summary(by_n: Mapping[int, Counts], ops: Sequence[str]) -> list[str]:
    """One table of the figures that grow, every operation."""
    rows = [(op, row) for op in ops for row in analyse(by_n, op)]
    lo, hi = (rows[0][1]["lo"], rows[0][1]["hi"]) if rows else (4, 64)
    lines = [f"| operation | figure (per rank) | at N={lo} (med; r0) | at N={hi} (med; r0) | growth (med; r0) | "
             "fit a + b*N (median) | at 1,024 (med; r0) | at 8,192 (med; r0) |", "|" + "---|" * 8]
    grows = [(op, row) for op, row in rows if row["grows"]]
    for op, row in grows:
        p_lo, p_hi = row["per"][row["lo"]], row["per"][row["hi"]]
        a, b = row["fit"]
        lines.append(f"| {op} | {row['figure']} | {num(p_lo['median'])}; {num(p_lo['rank0'])} | "
                     f"{num(p_hi['median'])}; {num(p_hi['rank0'])} | {ratio(row['growth'])}; "
                     f"{ratio(row['growth_rank0'])} | {num(a)} + {b:.4g}*N | {num(row['at'][1024])}; "
                     f"{num(row['at_rank0'][1024])} | {num(row['at'][8192])}; {num(row['at_rank0'][8192])} |")
    if not grows:
        lines.append("| (none) | | | | | | | |")
    if (lo, hi) != (4, 64):
        lines += ["", f"(growth from N={lo} to N={hi}: the sizes measured do not include both 4 and 64)"]
    return lines


def aggregate_details(detail: Mapping[str, Mapping]) -> dict[str, dict[str, dict[str, list[float]]]]:
    """A job's per-rank breakdowns (``measure``'s ``detail``) as {op: {"calls"|"sites": {key: [median over
    ranks, rank 0]}}}; call sites summed over the functions they call (``caller <- entry``, then the
    functions seen)."""
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    for op, d in detail.items():
        for kind in ("calls", "sites"):
            per_rank: dict[int, dict[str, float]] = {}
            fns: dict[str, set[str]] = {}
            for r, counts in d.get(kind, {}).items():
                acc = per_rank.setdefault(int(r), {})
                for k, v in counts.items():
                    if kind == "sites":
                        site, _, fn = k.rpartition(" [")
                        fns.setdefault(site, set()).add(fn.rstrip("]"))
                        k = site
                    acc[k] = acc.get(k, 0) + v
            keys = set().union(*per_rank.values()) if per_rank else set()
            agg = {}
            for k in keys:
                vals = [per_rank[r].get(k, 0) for r in sorted(per_rank)]
                label = f"{k} [{', '.join(sorted(fns[k]))}]" if kind == "sites" else k
                agg[label] = [statistics.median(vals), per_rank.get(0, {}).get(k, 0)]
            out.setdefault(op, {})[kind] = agg
    return out


def report(by_n: Mapping[int, Counts], ops: Sequence[str], details: Mapping[int, Mapping] | None = None,
           top_sites: int = 10) -> str:
    """Markdown: the figures that grow (all operations), then per operation a table of every figure per
    rank (median over ranks; rank 0) for each N, the growth from 4 to 64, the fit and its extrapolation
    (GROWS: more than 1.2x), rank 0 against the others, and at the largest N the calls by function and by
    tierfs call site. ``details``: per N, :func:`aggregate_details` of ``measure``'s ``detail``."""
    ns = sorted(by_n)
    lines = ["## Figures that grow more than 1.2x from 4 to 64 ranks", ""] + summary(by_n, ops) + [""]
    unparsed = sorted({n for n in ns for c in by_n[n].values() for figs in c.values() if figs.get("store_unparsed")})
    if unparsed:
        lines += [f"WARNING: at N={unparsed}, TCPStore requests the proxy could not follow (a torch whose store "
                  "protocol differs from STORE_COMMANDS): the store figures are too low.", ""]
    for op in ops:
        rows = analyse(by_n, op)
        if not rows:
            continue
        lost = op == "node_loss"
        lines += [f"## {OP_LABELS.get(op, op)}", ""]
        head = ["figure (per rank)"] + [f"N={n}" for n in ns] + ["growth 4->64 (med; r0)", "fit a + b*N (median)",
                                                                 "at 1,024 (med; r0)", "at 8,192 (med; r0)"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for row in rows:
            cells = ["**" + row["figure"] + "** GROWS" if row["grows"] else row["figure"]]
            for n in ns:
                p = row["per"].get(n)
                if not p:
                    cells.append("")
                    continue
                c = f"{num(p['median'])}; {num(p['rank0'])}"
                if lost and "lost" in p:
                    c += f"; lost {num(p['lost'])}"
                cells.append(c)
            g = f"{ratio(row['growth'])}; {ratio(row['growth_rank0'])}"
            if row["hi"] != 64 or row["lo"] != 4:
                g += f" ({row['lo']}->{row['hi']})"
            a, b = row["fit"]
            cells += [g, f"{num(a)} + {b:.4g}*N", f"{num(row['at'][1024])}; {num(row['at_rank0'][1024])}",
                      f"{num(row['at'][8192])}; {num(row['at_rank0'][8192])}"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        grows = [r["figure"] for r in rows if r["grows"]]
        lines.append(f"Grows more than {GROWS}x from {rows[0]['lo']} to {rows[0]['hi']} ranks: "
                     f"{', '.join(grows) if grows else 'nothing'}.")
        big = ns[-1]
        extra = []
        for row in rows:
            p = row["per"].get(big)
            if p and row["figure"] != "seconds" and p["others"] == p["others"] and p["rank0"] != p["others"]:
                r = ratio(p["rank0"] / p["others"]) if p["others"] else "rank 0 only"
                extra.append(f"{row['figure']} {num(p['rank0'])} vs {num(p['others'])} ({r})")
        lines.append(f"Rank 0 against the median of the other ranks at N={big}: "
                     f"{'; '.join(extra) if extra else 'the same'}.")
        most = [f"{row['figure']} " + ", ".join(num(row["per"][n]["max"]) for n in ns if row["per"].get(n))
                for row in rows if row["figure"] != "seconds"
                and any(p and p["max"] != p["median"] for p in row["per"].values())]
        if most:  # a tree's inner ranks do more than its leaves: the most of any rank, at each N
            lines.append(f"The most of any rank at N={', '.join(str(n) for n in ns)}: {'; '.join(most)}.")
        d = (details or {}).get(big, {}).get(op) or (details or {}).get(str(big), {}).get(op)
        if d:
            lines += ["", f"At N={big}, calls by function (median over ranks; rank 0), TCPStore requests as "
                          "`store:<request>`:", ""]
            lines += _breakdown(d.get("calls", {}), top=20)
            lines += ["", f"At N={big}, calls into torch.distributed by tierfs call site (`caller <- the "
                          "tierfs/ranks/ function it called [torch.distributed functions]`):", ""]
            lines += _breakdown(d.get("sites", {}), top=top_sites)
        lines.append("")
    return "\n".join(lines)


def _breakdown(agg: Mapping[str, Sequence[float]], top: int) -> list[str]:
    rows = sorted(((m, r0, k) for k, (m, r0) in agg.items()), key=lambda t: (-max(t[0], t[1]), t[2]))
    out = ["| what | median | rank 0 |", "|---|---|---|"]
    out += [f"| `{k}` | {num(m)} | {num(r0)} |" for m, r0, k in rows[:top]]
    if len(rows) > top:
        out.append(f"| ({len(rows) - top} more) | | |")
    if not rows:
        out.append("| (none) | | |")
    return out


def compare(base: Mapping[int, Counts], new: Mapping[int, Counts], ops: Sequence[str]) -> str:
    """Markdown: each figure's median per rank (and rank 0) at every N both runs measured, before -> after,
    and each run's growth from 4 to 64; only figures that differ somewhere."""
    ns = sorted(set(base) & set(new))
    if not ns:
        return "## Against the baseline\n\n(no size measured in both)\n"
    lo, hi = (4 if 4 in ns and 4 < ns[-1] else ns[0]), (64 if 64 in ns else ns[-1])
    lines = ["## Against the baseline", "",
             "| operation | figure | " + " | ".join(f"N={n} (med; r0), baseline -> now" for n in ns)
             + f" | growth {lo}->{hi} (median), baseline -> now |", "|" + "---|" * (len(ns) + 3)]
    for op in ops:
        rows_b = {r["figure"]: r for r in analyse({n: base[n] for n in ns}, op)}
        rows_n = {r["figure"]: r for r in analyse({n: new[n] for n in ns}, op)}
        for fig, _ in FIGURES:
            if fig == "seconds" or fig not in rows_b or fig not in rows_n:
                continue
            pb, pn = rows_b[fig]["per"], rows_n[fig]["per"]
            if all(pb[n]["median"] == pn[n]["median"] and pb[n]["rank0"] == pn[n]["rank0"] for n in ns):
                continue
            cells = [f"{num(pb[n]['median'])} -> {num(pn[n]['median'])}; {num(pb[n]['rank0'])} -> "
                     f"{num(pn[n]['rank0'])}" for n in ns]
            lines.append(f"| {op} | {fig} | " + " | ".join(cells) + f" | {ratio(rows_b[fig]['growth'])} -> "
                         f"{ratio(rows_n[fig]['growth'])} |")
    return "\n".join(lines) + "\n"
