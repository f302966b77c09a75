"""The object tier: any fsspec URL (s3://, gs://, file://, memory://, ...), written in the background.

Nothing is renamed here (a rename is a copy on S3/GCS): files go to their final names and the commit
marker, written last, alone makes the step exist. Files upload concurrently; large files download as
concurrent ranged reads into one buffer, so a restore moves exactly the step's bytes.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, TypeVar

import fsspec
import numpy as np

from .._fileio import atomic_write, is_tmp_name, make_private_dir
from .._retry import retry, short
from ..errors import TierUnavailableError
from ..format import MARKER, parse_step_dirname, step_dirname, validate_filename
from ..policies import PreservationPolicy, PreserveAll, SavePolicy
from .._copy import as_u8
from .base import Bytes, Capacity, Pace, Tier

log = logging.getLogger("tierfs")
T = TypeVar("T")
_LOCAL = ("file", "local")


class ObjectTier(Tier):
    """Steps under an fsspec URL.

    Parameters
    ----------
    url:
        Where steps go, e.g. ``s3://bucket/job-42`` or ``gs://bucket/run``. Any fsspec protocol works.
    storage_options:
        Passed unchanged to the filesystem (``endpoint_url``, ``key``, ``token``, ...). Never dropped.
    save, keep:
        Policies; default every step, keep everything.
    concurrency:
        Files (or parts of one file) transferred at once.
    part_size:
        Larger files move in parts of this size: ranged reads on download, multipart upload on S3.
    retries:
        Attempts per request on transient errors (connection resets, timeouts, 5xx), with backoff.
    name:
        Label in listings (default: the URL's protocol, e.g. ``"s3"``).
    """

    kind = "object"

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None, *,
                 save: SavePolicy | None = None, keep: PreservationPolicy | None = None,
                 concurrency: int = 8, part_size: int = 16 << 20, retries: int = 4,
                 name: str | None = None) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError(f"ObjectTier needs a URL such as s3://bucket/run, got {url!r}")
        self.url = url
        self.storage_options = dict(storage_options or {})
        try:
            self.fs, self.root = fsspec.url_to_fs(url, **self.storage_options)
        except (ImportError, ValueError) as e:
            raise TierUnavailableError(f"object tier {url}: {e}") from None
        proto = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        super().__init__(name or proto, save, keep if keep is not None else PreserveAll())
        self.protocol = proto
        self.root = self.root.rstrip("/")
        self.concurrency = max(1, int(concurrency))
        self.part_size = max(1 << 20, int(part_size))
        self.retries = max(1, int(retries))
        self._pool: ThreadPoolExecutor | None = None

    # -- capabilities -------------------------------------------------------------------------------
    @property
    def location(self) -> str:
        return self.url

    def capacity(self) -> Capacity:
        return Capacity(used=0, budget=None, free=None)

    # -- life cycle ---------------------------------------------------------------------------------
    def open(self) -> None:
        """Fail now, in one line, if the bucket is missing or the credentials are wrong."""
        bucket = self.root.split("/", 1)[0]
        try:
            if self.protocol in _LOCAL:
                make_private_dir(self.root)
            elif self.protocol not in ("memory",) and bucket:
                # info(), not exists(): exists() turns a refused connection into "missing"
                self.fs.info(bucket)  # the client has retried already; fail fast
        except FileNotFoundError:
            raise TierUnavailableError(
                f"object tier {self.url}: bucket {bucket!r} does not exist; create it or fix the URL") from None
        except PermissionError as e:
            raise TierUnavailableError(
                f"object tier {self.url}: access denied ({short(e)}); check credentials in storage_options "
                "or the environment") from None
        except TierUnavailableError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to reach the store becomes one clear line
            raise TierUnavailableError(f"object tier {self.url}: cannot reach the store ({short(e)})") from None

    def check_readable(self) -> None:
        if self.protocol not in _LOCAL:
            self.open()  # only probes the bucket
            return
        if not os.path.isdir(self.root):
            raise TierUnavailableError(f"tier {self.name!r}: {self.root} is not a directory")
        if not os.access(self.root, os.R_OK | os.X_OK):
            raise TierUnavailableError(f"tier {self.name!r}: {self.root} is not readable")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # -- helpers ------------------------------------------------------------------------------------
    def _path(self, step: int, name: str | None = None) -> str:
        p = f"{self.root}/{step_dirname(step)}"
        return p if name is None else f"{p}/{validate_filename(name)}"

    def _retry(self, fn: Callable[[], T], what: str = "request") -> T:
        return retry(fn, attempts=self.retries, what=what, label=f"tier {self.name}")

    def _map(self, fn: Callable[[Any], T], items: list[Any]) -> list[T]:
        if len(items) <= 1:
            return [fn(i) for i in items]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix=f"tierfs-{self.name}")
        return list(self._pool.map(fn, items))

    # -- listing ------------------------------------------------------------------------------------
    def list_steps(self) -> dict[int, bool]:
        self.fs.invalidate_cache(self.root)
        try:
            paths = self._retry(lambda: self.fs.find(self.root, maxdepth=2), "list")
        except FileNotFoundError:
            return {}
        out: dict[int, bool] = {}
        n = len(self.root) + 1 if self.root else 0
        for p in paths:
            parts = p.rstrip("/")[n:].split("/") if p.startswith(self.root) else []
            s = parse_step_dirname(parts[0]) if parts else None
            if s is not None:
                out[s] = out.get(s, False) or (len(parts) == 2 and parts[1] == MARKER)
        return out

    def file_sizes(self, step: int) -> dict[str, int]:
        d = self._path(step)
        self.fs.invalidate_cache(d)
        infos = self._retry(lambda: self.fs.ls(d, detail=True), "list")
        names = {i["name"].rstrip("/").rsplit("/", 1)[-1]: int(i.get("size") or 0)
                 for i in infos if i.get("type") == "file"}
        return {n: size for n, size in names.items() if not is_tmp_name(n)}

    def last_written(self, step: int) -> float | None:
        path = self._path(step)
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return None
        times = [_mtime(e) for e in entries]
        if not times or any(t is None for t in times):
            return None  # the backend does not say: the age is unknown
        return max(t for t in times if t is not None)

    # -- writing ------------------------------------------------------------------------------------
    def write_file(self, step: int, name: str, data: Bytes) -> None:
        path = self._path(step, name)
        if self.protocol in _LOCAL:  # straight from the buffer, no extra copy; durable like every local write
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            self._retry(lambda: atomic_write(path, data), f"write {name}")
            return
        payload = data if isinstance(data, bytes) else as_u8(data).tobytes()
        kw = {"chunksize": self.part_size} if self.protocol in ("s3", "s3a") else {}  # multipart parts
        self._retry(lambda: self.fs.pipe_file(path, payload, **kw), f"upload {name}")

    def write_files(self, step: int, files: Mapping[str, Bytes], pace: Pace | None = None) -> None:
        def put(kv: tuple[str, Bytes]) -> None:
            if pace is not None:
                pace(as_u8(kv[1]).nbytes)
            self.write_file(step, kv[0], kv[1])
        self._map(put, list(files.items()))

    def write_marker(self, step: int, data: bytes) -> None:
        self.write_file(step, MARKER, data)

    # -- reading ------------------------------------------------------------------------------------
    def read_range(self, step: int, name: str, start: int, end: int) -> bytes:
        path = self._path(step, name)
        return bytes(self._retry(lambda: self.fs.cat_file(path, start=start, end=end), f"read {name}"))

    def read_file(self, step: int, name: str) -> bytes:
        path = self._path(step, name)
        return bytes(self._retry(lambda: self.fs.cat_file(path), f"read {name}"))

    def read_files(self, step: int, names: list[str]) -> dict[str, Bytes]:
        """Download files concurrently; large ones as ranged parts into one buffer (no extra bytes)."""
        sizes = self.file_sizes(step)
        parts: list[tuple[str, int, int]] = []
        out: dict[str, Bytes] = {}
        whole: dict[str, np.ndarray] = {}  # large files, filled part by part
        for n in names:
            if n not in sizes:
                raise FileNotFoundError(self._path(step, n))
            size = sizes[n]
            if size <= self.part_size:
                parts.append((n, 0, -1))
            else:
                out[n] = whole[n] = np.empty(size, dtype=np.uint8)
                parts += [(n, s, min(size, s + self.part_size)) for s in range(0, size, self.part_size)]

        def fetch(part: tuple[str, int, int]) -> None:
            n, s, e = part
            if e < 0:
                out[n] = self.read_file(step, n)
                return
            data = self.read_range(step, n, s, e)
            if len(data) != e - s:
                raise OSError(f"short read of {n} bytes {s}-{e}: got {len(data)}")
            whole[n][s:e] = np.frombuffer(data, dtype=np.uint8)

        self._map(fetch, parts)
        return out

    # -- deleting -----------------------------------------------------------------------------------
    def delete_step(self, step: int) -> None:
        d = self._path(step)
        try:
            self._retry(lambda: self.fs.rm_file(self._path(step, MARKER)), "delete marker")
        except FileNotFoundError:
            pass
        try:
            self._retry(lambda: self.fs.rm(d, recursive=True), "delete step")
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(self.root)

    def __repr__(self) -> str:
        return f"ObjectTier({self.url!r})"


def _mtime(info: dict[str, Any]) -> float | None:
    """A file's modification time from an fsspec ``info``/``ls`` entry (keys differ per backend)."""
    for key in ("mtime", "LastModified", "updated", "last_modified", "created"):
        v = info.get(key)
        if v is None:
            continue
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, _dt.datetime):
            return v.timestamp()
        if isinstance(v, str):
            try:
                return _dt.datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None
