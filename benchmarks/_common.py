"""Helpers shared by the benchmarks: states, timing, tables, scratch directories, a moto S3 server.

Nothing in here is part of tierfs; the benchmarks use only tierfs's public API.
"""

from __future__ import annotations

import gc
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

GB = 1e9
MiB = 1 << 20
GiB = 1 << 30


def log(msg: str) -> None:
    """Progress line on stderr (stdout carries only the result table)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def launch_ranks(script: str, argv: list[str], world: int) -> int:
    """Run ``script --worker argv...`` as ``world`` ranks of a gloo job on 127.0.0.1, each its own node
    (``TIERFS_NODE_RANK``); returns the worst exit code. A rank that fails would leave the others
    waiting in a collective, so they are stopped."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, script, "--worker", *argv], env=os.environ | {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r), "WORLD_SIZE": str(world),
        "LOCAL_RANK": "0", "TIERFS_NODE_RANK": str(r)}) for r in range(world)]
    codes: dict[int, int] = {}
    while len(codes) < len(procs):
        pid, status = os.wait()
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid]:
            for p in procs:
                if p.pid not in codes:
                    p.kill()
    return max(abs(c) for c in codes.values())


def export_tierfs(rev: str, dest: str) -> str:
    """tierfs as committed at ``rev`` (``git archive``), unpacked under ``dest``: a directory to put first on
    the ranks' ``PYTHONPATH`` (a ``tierfs_root``), so a measurement is of that commit whatever the working
    tree holds meanwhile."""
    import io
    import subprocess
    import tarfile

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    data = subprocess.run(["git", "-C", repo, "archive", "--format=tar", rev, "tierfs"], check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def interleaved(script: str, revs: list[str], runs: int, world: int,
                jobs: Callable[[str, str], list[tuple[str, list[str]]]]) -> dict[str, list[dict]]:
    """Jobs of ``world`` ranks (:func:`launch_ranks`) for each revision in ``revs`` (a git revision,
    exported with :func:`export_tierfs`; ``"."`` the working tree) in each of ``runs`` rounds, revisions
    interleaved so that the machine's load falls on all alike. ``jobs(rev, tmp)`` gives a revision's jobs
    of a round, ``(key, argv)`` each: every rank writes its figures to ``<--json>.<rank>`` (``--json``
    is added to ``argv``), gathered under ``key``."""
    import json

    tmp = tempfile.mkdtemp(prefix="bench-revs-")
    base_path = os.environ.get("PYTHONPATH")
    got: dict[str, list[dict]] = {}
    try:
        roots = {r: (None if r == "." else export_tierfs(r, os.path.join(tmp, f"src{i}"))) for i, r in enumerate(revs)}
        for k in range(runs):
            for i, rev in enumerate(revs):
                os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (roots[rev], base_path) if p)
                for j, (key, argv) in enumerate(jobs(rev, tmp)):
                    out = os.path.join(tmp, f"r{k}-{i}-{j}.json")
                    log(f"round {k + 1}/{runs}: {key}")
                    code = launch_ranks(script, ["--json", out, *argv], world)
                    if code:
                        raise SystemExit(f"the ranks failed (exit {code})")
                    for r in range(world):
                        with open(f"{out}.{r}") as f:
                            got.setdefault(key, []).append(json.load(f))
    finally:
        if base_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = base_path
        shutil.rmtree(tmp, ignore_errors=True)
    return got


def write_results(bench: str, lines: list[str], data: dict) -> None:
    """The report to ``benchmarks/results/<bench>-<day>-<k>.md`` and ``data`` beside it as ``.json``."""
    import json

    path = results_path(bench)
    with open(path + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(path + ".json", "w") as f:
        json.dump(data, f)
    log(f"written: {path}.md (and .json)")


def results_path(bench: str) -> str:
    """``benchmarks/results/<bench>-<day>-<k>`` (no extension) for the next run of the day: k counts up."""
    here = os.path.dirname(os.path.abspath(__file__))
    day, k = time.strftime("%Y%m%d"), 1
    while os.path.exists(os.path.join(here, "results", f"{bench}-{day}-{k}.md")):
        k += 1
    return os.path.join(here, "results", f"{bench}-{day}-{k}")


def machine_note() -> str:
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = f"{int(line.split()[1]) / (1 << 20):.1f} GiB RAM"
    except OSError:
        pass
    import torch

    return (f"{os.cpu_count()} CPUs, {mem}, Python {platform.python_version()}, torch {torch.__version__}, "
            f"torch threads {torch.get_num_threads()}, {platform.machine()} {platform.release()}")


# -- states --------------------------------------------------------------------------------------------
def transformer_state(size_bytes: int, seed: int = 0, hidden: int = 2048, ffn: int = 5632,
                      vocab: int = 8192) -> dict:
    """A fp32 state shaped like a small transformer, about ``size_bytes`` in total.

    Embedding and LM head (vocab x hidden, 64 MiB each at the defaults), then per layer: QKV (48 MiB),
    attention out (16 MiB), MLP up/gate-free (44 MiB), MLP down (44 MiB), and small biases and norm
    weights (8-24 KiB). Layers are added until the size is reached. Filled from a fixed seed.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (vocab, hidden))]
    per_layer = [("attn.qkv.weight", (3 * hidden, hidden)), ("attn.qkv.bias", (3 * hidden,)),
                 ("attn.out.weight", (hidden, hidden)), ("attn.out.bias", (hidden,)),
                 ("norm1.weight", (hidden,)), ("norm1.bias", (hidden,)),
                 ("mlp.up.weight", (ffn, hidden)), ("mlp.up.bias", (ffn,)),
                 ("mlp.down.weight", (hidden, ffn)), ("mlp.down.bias", (hidden,)),
                 ("norm2.weight", (hidden,)), ("norm2.bias", (hidden,))]
    tail = [("final_norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]

    def nbytes(shape):
        n = 4
        for s in shape:
            n *= s
        return n

    layer_bytes = sum(nbytes(s) for _, s in per_layer)
    fixed = nbytes((vocab, hidden)) * 2 + nbytes((hidden,))
    layers = max(1, round((size_bytes - fixed) / layer_bytes))
    for i in range(layers):
        shapes += [(f"layers.{i}.{n}", s) for n, s in per_layer]
    shapes += tail
    state = {}
    for name, shape in shapes:
        t = torch.empty(shape, dtype=torch.float32)
        t.normal_(generator=g)
        state[name] = t
    return state


def flat_state(n_tensors: int, tensor_bytes: int, seed: int = 0) -> dict:
    """``n_tensors`` fp32 tensors of ``tensor_bytes`` each (fixed seed)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {f"w{i:02d}": torch.empty(tensor_bytes // 4, dtype=torch.float32).normal_(generator=g)
            for i in range(n_tensors)}


def state_bytes(state: dict) -> int:
    return sum(t.nelement() * t.element_size() for t in state.values())


def like(state: dict, fill: float | None = 0.0) -> dict:
    """Preallocated tensors of the same shapes, pages faulted in (filled) so timings exclude first touch."""
    import torch

    out = {k: torch.empty_like(v) for k, v in state.items()}
    if fill is not None:
        for t in out.values():
            t.fill_(fill)
    return out


def same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def copy_into(dst: dict, src: dict) -> None:
    for k, t in dst.items():
        t.copy_(src[k])


# -- timing and tables --------------------------------------------------------------------------------
@dataclass
class Result:
    name: str
    nbytes: int
    times: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")

    @property
    def gbps(self) -> float:
        return self.nbytes / self.median / GB if self.times else float("nan")


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def fmt_times(ts: Iterable[float]) -> str:
    return " ".join(f"{t:.3f}" for t in ts)


def table(title: str, rows: list[Result], floor: Result | None = None, ratio_label: str = "x floor",
          extra: dict[str, str] | None = None) -> str:
    """A markdown table: seconds (median), GB/s, ratio to ``floor`` (by GB/s), every repeat."""
    head = f"| {'operation':<52} | median s | GB/s  | {ratio_label:>8} | repeats (s) |"
    lines = [f"### {title}", "", head, "|" + "---|" * 5]
    for r in rows:
        ratio = f"{r.gbps / floor.gbps:.2f}" if floor is not None and floor.times and r.times else "-"
        name = r.name + (f" ({r.note})" if r.note else "")
        lines.append(f"| {name:<52} | {r.median:8.3f} | {r.gbps:5.2f} | {ratio:>8} | {fmt_times(r.times)} |")
    if extra:
        lines.append("")
        lines += [f"- {k}: {v}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def verdict(label: str, value: float, target: float, higher_is_better: bool = True) -> str:
    ok = value >= target if higher_is_better else value <= target
    op = ">=" if higher_is_better else "<="
    return f"| {label} | {value:.3f} | {op} {target} | {'MET' if ok else 'MISSED'} |"


# -- scratch directories ------------------------------------------------------------------------------
class Scratch:
    """Private directories under /dev/shm, all removed by ``cleanup()`` (call it in ``finally``)."""

    def __init__(self, prefix: str) -> None:
        base = "/dev/shm"
        if not (os.path.isdir(base) and os.access(base, os.W_OK)):
            raise RuntimeError("/dev/shm is not available or not writable")
        self.root = tempfile.mkdtemp(dir=base, prefix=prefix)

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def fresh(self, name: str) -> str:
        p = self.path(name)
        shutil.rmtree(p, ignore_errors=True)
        os.makedirs(p, mode=0o700)
        return p

    def remove(self, name: str) -> None:
        p = self.path(name)
        if os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.exists(p):
            os.unlink(p)

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


# -- moto S3 server -------------------------------------------------------------------------------------
_AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
_AWS_ENV_DROP = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_REGION",
                 "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")


class ByteCounter:
    """WSGI middleware on the moto server: counts request and response body bytes per HTTP method.

    This is what crossed the (loopback) wire, whatever the client library did: ranged GETs, read-ahead,
    retries and listings are all included.
    """

    def __init__(self, app) -> None:
        import threading

        self.app = app
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.requests: dict[str, int] = {}
            self.sent: dict[str, int] = {}  # response bodies, by request method
            self.received: dict[str, int] = {}  # request bodies (Content-Length), by method
            self.ranged_gets = 0

    def snapshot(self) -> dict:
        with self._lock:
            return {"requests": dict(self.requests), "sent": dict(self.sent), "received": dict(self.received),
                    "ranged_gets": self.ranged_gets}

    def __call__(self, environ, start_response):
        method = environ.get("REQUEST_METHOD", "?")
        try:
            clen = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            clen = 0
        with self._lock:
            self.requests[method] = self.requests.get(method, 0) + 1
            self.received[method] = self.received.get(method, 0) + clen
            if method == "GET" and environ.get("HTTP_RANGE"):
                self.ranged_gets += 1
        body = self.app(environ, start_response)
        counter = self

        def gen():
            try:
                for chunk in body:
                    with counter._lock:
                        counter.sent[method] = counter.sent.get(method, 0) + len(chunk)
                    yield chunk
            finally:
                close = getattr(body, "close", None)
                if close is not None:
                    close()

        return gen()


class MotoS3:
    """moto's S3 server in a thread of this process on 127.0.0.1 (free port), with a byte counter."""

    def __init__(self) -> None:
        for k in _AWS_ENV_DROP:
            os.environ.pop(k, None)
        os.environ.update(_AWS_ENV)
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access-log line per request

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        wsgi = self.server._server  # werkzeug server; the handler looks up .app per request
        self.counter = ByteCounter(wsgi.app)
        wsgi.app = self.counter
        self.options = {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing"}

    def reset(self, bucket: str) -> None:
        """Drop every bucket and object (moto holds several times the stored bytes), make ``bucket``."""
        import urllib.request

        import s3fs

        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST", data=b"")
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
        for inst in list(s3fs.S3FileSystem._cache.values()):
            inst.invalidate_cache()
        s3fs.S3FileSystem.clear_instance_cache()
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.options)
        fs.mkdir(bucket)
        fs.invalidate_cache()
        gc.collect()
        self.counter.reset()

    def stop(self) -> None:
        self.server.stop()


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def prefault(nbytes: int) -> float:
    """Touch ``nbytes`` of fresh anonymous memory at once, then free it; returns GB/s of the touch.

    On this VM (Firecracker) guest memory not touched since boot is backed by the host on first touch, at
    about 0.3-0.4 GB/s; afterwards the guest recycles host-backed pages. Without this, whichever
    benchmark first needs fresh pages (tierfs's cold saves, here) pays the hypervisor's cost, not its own.
    """
    import mmap

    chunks, t0 = [], time.perf_counter()
    try:
        for _ in range(max(0, nbytes // GiB)):
            m = mmap.mmap(-1, GiB)
            try:
                m.madvise(23)  # MADV_POPULATE_WRITE
            except OSError:
                for off in range(0, GiB, 4096):
                    m[off] = 1
            chunks.append(m)
    finally:
        dt = time.perf_counter() - t0
        n = len(chunks) * GiB
        for m in chunks:
            m.close()
    return n / dt / GB if dt > 0 else float("nan")


def rss_gib() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return float("nan")


# -- nested states --------------------------------------------------------------------------------------
def tensors(state: Any) -> Iterator[Any]:
    """Every tensor of a nested dict/list/tuple, depth first."""
    import torch

    if isinstance(state, dict):
        for v in state.values():
            yield from tensors(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            yield from tensors(v)
    elif isinstance(state, torch.Tensor):
        yield state


def nested_like(state: Any) -> Any:
    """Same structure, on the same devices; tensors preallocated and zero-filled (pages faulted in), other
    leaves copied."""
    import copy

    import torch

    if isinstance(state, dict):
        return {k: nested_like(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(nested_like(v) for v in state)
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state).fill_(0)
    return copy.deepcopy(state)
