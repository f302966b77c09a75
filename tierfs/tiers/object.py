"""The object tier: any fsspec URL (s3://, gs://, file://, memory://, ...), written in the background.

Nothing is renamed here (a rename is a copy on S3/GCS): files go to their final names and the commit
marker, written last, alone makes the step exist. Files upload concurrently; large files download as
concurrent ranged reads into one buffer, so a restore moves exactly the step's bytes.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, TypeVar

import fsspec
import numpy as np

from ..errors import TierUnavailableError
from ..format import MARKER, parse_step_dirname, step_dirname, validate_filename
from ..policies import PreservationPolicy, PreserveAll, SavePolicy
from .base import Capacity, Tier

log = logging.getLogger("tierfs")
T = TypeVar("T")

# Errors that retrying cannot fix.
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError,
              ValueError, TypeError)


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
    def is_durable(self) -> bool:
        return self.protocol != "memory"

    def capacity(self) -> Capacity:
        return Capacity(used=0, budget=None, free=None)

    # -- life cycle ---------------------------------------------------------------------------------
    def open(self) -> None:
        """Fail now, in one line, if the bucket is missing or the credentials are wrong."""
        bucket = self.root.split("/", 1)[0]
        try:
            if self.protocol in ("file", "local"):
                from .memory import make_private_dir
                from pathlib import Path

                make_private_dir(Path(self.root))
            elif self.protocol not in ("memory",) and bucket:
                # info(), not exists(): exists() turns a refused connection into "missing"
                self.fs.info(bucket)  # the client has retried already; fail fast
        except FileNotFoundError:
            raise TierUnavailableError(
                f"object tier {self.url}: bucket {bucket!r} does not exist; create it or fix the URL") from None
        except PermissionError as e:
            raise TierUnavailableError(
                f"object tier {self.url}: access denied ({_short(e)}); check credentials in storage_options "
                "or the environment") from None
        except TierUnavailableError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to reach the store becomes one clear line
            raise TierUnavailableError(f"object tier {self.url}: cannot reach the store ({_short(e)})") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # -- helpers ------------------------------------------------------------------------------------
    def _path(self, step: int, name: str | None = None) -> str:
        p = f"{self.root}/{step_dirname(step)}"
        return p if name is None else f"{p}/{validate_filename(name)}"

    def _retry(self, fn: Callable[[], T], what: str = "") -> T:
        for attempt in range(self.retries):
            try:
                return fn()
            except _PERMANENT:
                raise
            except Exception as e:  # noqa: BLE001 - transient until proven otherwise
                if attempt + 1 == self.retries:
                    raise
                delay = 0.2 * 2**attempt
                log.warning("tier %s: %s failed (%s); retry %d/%d in %.1fs", self.name, what or "request",
                            _short(e), attempt + 1, self.retries - 1, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _map(self, fn: Callable[[Any], T], items: list) -> list[T]:
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
        return {i["name"].rstrip("/").rsplit("/", 1)[-1]: int(i.get("size") or 0)
                for i in infos if i.get("type") == "file"}

    # -- writing ------------------------------------------------------------------------------------
    def write_file(self, step: int, name: str, data) -> None:
        path = self._path(step, name)
        if self.protocol in ("file", "local"):  # straight from the buffer, no extra copy
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            self._retry(lambda: _write_local(path, data), f"write {name}")
            return
        payload = data if isinstance(data, bytes) else memoryview(data).cast("B").tobytes()
        kw = {"chunksize": self.part_size} if self.protocol in ("s3", "s3a") else {}  # multipart parts
        self._retry(lambda: self.fs.pipe_file(path, payload, **kw), f"upload {name}")

    def write_files(self, step: int, files: Mapping[str, object],
                    pace: Callable[[int], None] | None = None) -> None:
        def put(kv) -> None:
            if pace is not None:
                pace(memoryview(kv[1]).nbytes)
            self.write_file(step, kv[0], kv[1])
        self._map(put, list(files.items()))

    def write_marker(self, step: int, data: bytes) -> None:
        self.write_file(step, MARKER, data)

    # -- reading ------------------------------------------------------------------------------------
    def read_range(self, step: int, name: str, start: int, end: int) -> bytes:
        path = self._path(step, name)
        return self._retry(lambda: self.fs.cat_file(path, start=start, end=end), f"read {name}")

    def read_file(self, step: int, name: str):
        path = self._path(step, name)
        return self._retry(lambda: self.fs.cat_file(path), f"read {name}")

    def read_files(self, step: int, names: list[str]) -> dict[str, object]:
        """Download files concurrently; large ones as ranged parts into one buffer (no extra bytes)."""
        sizes = self.file_sizes(step)
        parts: list[tuple[str, int, int]] = []
        out: dict[str, object] = {}
        for n in names:
            if n not in sizes:
                raise FileNotFoundError(self._path(step, n))
            size = sizes[n]
            if size <= self.part_size:
                parts.append((n, 0, -1))
            else:
                out[n] = np.empty(size, dtype=np.uint8)
                parts += [(n, s, min(size, s + self.part_size)) for s in range(0, size, self.part_size)]

        def fetch(part: tuple[str, int, int]) -> None:
            n, s, e = part
            if e < 0:
                out[n] = self.read_file(step, n)
                return
            data = self.read_range(step, n, s, e)
            if len(data) != e - s:
                raise OSError(f"short read of {n} bytes {s}-{e}: got {len(data)}")
            out[n][s:e] = np.frombuffer(data, dtype=np.uint8)  # type: ignore[index]

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


def _write_local(path: str, data) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb", opener=lambda p, f: os.open(p, f, 0o600)) as f:
        f.write(memoryview(data).cast("B"))
    os.replace(tmp, path)


def _short(e: BaseException) -> str:
    s = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return s[:200]
