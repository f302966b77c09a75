"""The object tier: any fsspec URL (s3://, gs://, file://, memory://, ...), written in the background.

Nothing is renamed here (a rename is a copy on S3/GCS): files go to their final names and the commit
marker, written last, alone makes the step exist. Files upload concurrently; large files download as
concurrent ranged reads into one buffer, so a restore moves exactly the step's bytes.

Every request spends this rank's share of the job's request budget, if one is set, and is retried on
transient errors (:func:`tierfs._retry.retry`; throttling is waited out, not counted); one still failing
after the last attempt is a :class:`~tierfs.errors.TierUnavailableError` naming the tier, the step and the
file, whatever the client raised. Permanent errors (404, 403) are raised at once.

The S3 client retries too, and the layers multiply. With default settings one attempt of ObjectTier is,
by botocore (5 tries, jittered backoff) and s3fs (5 more around them for 503 and cut-off bodies): 5
requests (about 3 s) when every answer is a 500, 5 (about 9 s) when connections are refused, 10 (about
8 s) when they are reset, 25 (about 45 s) when every answer is 503 SlowDown, and 25 of 15 s each (s3fs's
read timeout, about 7 min) when the server does not answer; ``retries=4`` gives up after about 15 s, 35 s,
30 s, ``throttle_patience`` and 27 min. To fail sooner on a store that hangs, pass
``storage_options={"config_kwargs": {"read_timeout": 5, "retries": {"max_attempts": 2}}}``.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, TypeVar

import fsspec
import numpy as np

from .. import _args
from .._blocks import as_u8
from .._fileio import atomic_write, is_tmp_name, make_private_dir
from .._retry import PATIENCE, PERMANENT, retry, short
from .._rootdir import check_local_url, check_root
from ..errors import TierfsError, TierUnavailableError
from ..format import MARKER, parse_step_dirname, step_dirname, validate_filename
from ..policies import PreservationPolicy, PreserveAll, SavePolicy
from ._budget import JobBudget, upload_requests
from ._listing import by_prefix, common_prefix, files_in, is_dir_entry, mtime
from ._pool import DaemonPool
from .base import Bytes, Capacity, Pace, Tier

log = logging.getLogger("tierfs")
T = TypeVar("T")
_LOCAL = ("file", "local")
#: the smallest part S3 accepts in a multipart upload (every part but the last)
S3_MIN_PART = 5 << 20


class ObjectTier(Tier):
    """Steps under an fsspec URL.

    Parameters
    ----------
    url:
        Where steps go, e.g. ``s3://bucket/job-42`` or ``gs://bucket/run``. Any fsspec protocol works; a
        local directory is a ``file://`` URL or an absolute path. A URL with a typo (``s3:/bucket``,
        ``s3//bucket``, ``bucket/run``), an unknown protocol or no bucket is an ``ArgumentError``.
    storage_options:
        Passed unchanged to the filesystem (``endpoint_url``, ``key``, ``token``, ...). Never dropped.
    save, keep:
        Policies; default every step, keep everything.
    concurrency:
        Files (or parts of one file) transferred at once.
    part_size:
        Larger files move in parts of this size: ranged reads on download, multipart upload on S3 (in
        parts of at least 5 MiB, the smallest S3 accepts).
    retries:
        Attempts per request on transient errors (connection resets, timeouts, 500s), with backoff, on top
        of the client's own retries (see the module docstring); after the last one the request raises
        ``TierUnavailableError``. A store refusing requests for the rate (503 SlowDown, 429) is waited
        out instead, with jittered backoff, for up to ``throttle_patience`` seconds: the step's copy here
        lags (the log says so), and the save does not fail.
    requests_per_second:
        The whole job's budget of requests to this store; each rank takes an equal share and spends it
        before every request (retries included), so the job never asks for more. Default: no budget.
    throttle_patience:
        Seconds a request refused for the rate keeps being retried (default half an hour).
    name:
        Label in listings (default: the URL's protocol, e.g. ``"s3"``).
    """

    kind = "object"

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None, *,
                 save: SavePolicy | None = None, keep: PreservationPolicy | None = None,
                 concurrency: int = 8, part_size: int = 16 << 20, retries: int = 4,
                 requests_per_second: float | None = None, throttle_patience: float = PATIENCE,
                 name: str | None = None) -> None:
        _args.object_url(url, "ObjectTier url")  # a typo (s3:/bucket) never becomes a local directory
        check_local_url(url, "ObjectTier url")  # a file:// tier never takes over a system directory
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
        self.concurrency = _args.integer(concurrency, "ObjectTier concurrency")
        self.part_size = max(1 << 20, _args.integer(part_size, "ObjectTier part_size"))
        self.retries = _args.integer(retries, "ObjectTier retries")
        if requests_per_second is not None:
            _args.number(requests_per_second, "ObjectTier requests_per_second")
        self.requests_per_second = requests_per_second
        self.throttle_patience = _args.number(throttle_patience, "ObjectTier throttle_patience")
        self._budget = JobBudget(requests_per_second)
        self._pool: DaemonPool | None = None

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
                check_root(Path(self.root), "ObjectTier url")
                make_private_dir(self.root)
            elif self.protocol not in ("memory",) and bucket:
                # info(), not exists(): exists() turns a refused connection into "missing". The client has
                # retried already: fail fast, but wait out a store refusing requests for the rate
                retry(lambda: self.fs.info(bucket), attempts=1, what="probe the bucket", label=f"tier {self.name}",
                      patience=self.throttle_patience)
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
            self._pool.shutdown()
            self._pool = None

    # -- helpers ------------------------------------------------------------------------------------
    def _path(self, step: int, name: str | None = None) -> str:
        p = f"{self.root}/{step_dirname(step)}"
        return p if name is None else f"{p}/{validate_filename(name)}"

    def _retry(self, fn: Callable[[], T], what: str = "request", requests: int = 1) -> T:
        """``fn()`` with retries, each try spending ``requests`` of the budget; a transient error that
        outlasts them becomes one TierUnavailableError (as does throttling outlasting the patience)."""
        def attempt() -> T:
            self._budget.take(requests)
            return fn()
        try:
            return retry(attempt, attempts=self.retries, what=what, label=f"tier {self.name}",
                         patience=self.throttle_patience)
        except PERMANENT as e:  # the same type (callers tell a missing file by it), naming the tier and URL
            named = _named(e, f"tier {self.name!r} ({self.url}): {what}: {short(e)}")
            if named is e:
                raise
            raise named from e
        except TierfsError:
            raise
        except Exception as e:  # noqa: BLE001 - transient (retry() raised it after the last attempt)
            raise TierUnavailableError(
                f"tier {self.name!r}: {what} failed {self.retries} time(s), last with {short(e, with_type=True)}; "
                f"check that {self.url} is reachable and healthy, or give ObjectTier more retries") from e

    @staticmethod
    def _what(step: int, action: str, name: str | None = None) -> str:
        return f"step {step}: {action}" + (f" {name}" if name else "")

    def _map(self, fn: Callable[[Any], T], items: list[Any]) -> list[T]:
        """``fn`` over ``items`` on the tier's threads. On the first failure the transfers not yet started
        are cancelled and those running are waited for, then the failure is raised: once a write fails,
        nothing of it still runs (a late upload could land after the step was saved again). The threads
        are daemon threads (:mod:`._pool`): a transfer left at exit never holds the interpreter past its
        ``exit_timeout``."""
        if len(items) <= 1:
            return [fn(i) for i in items]
        if self._pool is None:
            self._pool = DaemonPool(self.concurrency, f"tierfs-{self.name}")
        return self._pool.map(fn, items)

    # -- listing ------------------------------------------------------------------------------------
    def local_dirs(self) -> list[Path]:
        """The directory of a ``file://`` tier; none for remote storage."""
        return [Path(self.root)] if self.protocol in ("file", "local") else []

    def live_users(self) -> list[int]:
        return []

    def list_steps(self) -> dict[int, bool]:
        self.fs.invalidate_cache(self.root)
        try:
            # The root's entries alone (S3 and GCS: a delimited listing, the step prefixes, not their
            # objects), then each step's marker: requests grow with the steps kept, never with the ranks
            # or their files. ls raises when a listing fails, so a failed listing never reads as no steps.
            # A step emptied by a deletion cut short has no objects, hence no prefix.
            entries = self._retry(lambda: self.fs.ls(self.root, detail=True), "list the steps")
        except FileNotFoundError:
            return {}
        steps = sorted({s for s in (parse_step_dirname(e["name"].rstrip("/").rsplit("/", 1)[-1])
                                    for e in entries if e.get("type") == "directory") if s is not None})
        return {s: bool(self.sizes_of(s, [MARKER])) for s in steps}

    def file_sizes(self, step: int) -> dict[str, int]:
        d = self._path(step)
        self.fs.invalidate_cache(d)
        infos = self._retry(lambda: self.fs.ls(d, detail=True), self._what(step, "list"))
        return {n: size for n, size in files_in(infos, d).items() if not is_tmp_name(n)}

    def sizes_of(self, step: int, names: Iterable[str]) -> dict[str, int]:
        """What one rank wrote, whatever the job's size: several files (a shard's, ``rank_00003.*``) by one
        listing of their common prefix on S3 and GCS, else a request per file."""
        wanted = list(names)
        if len(wanted) > 1:
            got = by_prefix(self.fs, self._path(step), wanted,
                            lambda fn: self._retry(fn, self._what(step, "list", common_prefix(wanted) + "*")))
            if got is not None:
                return got
        out = {}
        for n in wanted:
            path = self._path(step, n)
            self.fs.invalidate_cache(path)
            try:
                info: dict[str, Any] = self._retry(functools.partial(self.fs.info, path),
                                                   self._what(step, "check", n))
            except FileNotFoundError:
                continue
            if info.get("type") == "file":
                out[n] = int(info.get("size") or 0)
        return out

    def last_written(self, step: int) -> float | None:
        path = self._path(step)
        self.fs.invalidate_cache(path)
        try:
            entries = self._retry(lambda: self.fs.ls(path, detail=True), self._what(step, "list"))
        except FileNotFoundError:
            return None
        times = [mtime(e) for e in entries if not is_dir_entry(e["name"], path)]
        if not times or any(t is None for t in times):
            return None  # the backend does not say: the age is unknown
        return max(t for t in times if t is not None)

    # -- writing ------------------------------------------------------------------------------------
    def write_file(self, step: int, name: str, data: Bytes) -> None:
        path = self._path(step, name)
        if self.protocol in _LOCAL:  # straight from the buffer, no extra copy; durable like every local write
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            self._retry(lambda: atomic_write(path, data), self._what(step, "write", name))
            return
        payload = data if isinstance(data, bytes) else as_u8(data).tobytes()
        # multipart parts: S3 refuses parts under 5 MiB (EntityTooSmall) once the upload completes
        kw = {"chunksize": max(self.part_size, S3_MIN_PART)} if self.protocol in ("s3", "s3a") else {}
        self._retry(lambda: self.fs.pipe_file(path, payload, **kw), self._what(step, "upload", name),
                    upload_requests(len(payload), max(self.part_size, S3_MIN_PART)))

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
        return bytes(self._retry(lambda: self.fs.cat_file(path, start=start, end=end),
                                 self._what(step, "read", f"{name} bytes {start}-{end}")))

    def read_file(self, step: int, name: str) -> bytes:
        path = self._path(step, name)
        return bytes(self._retry(lambda: self.fs.cat_file(path), self._what(step, "read", name)))

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
            self._retry(lambda: self.fs.rm_file(self._path(step, MARKER)), self._what(step, "delete", MARKER))
        except FileNotFoundError:
            pass
        try:
            self._retry(lambda: self.fs.rm(d, recursive=True), self._what(step, "delete the files"))
        except FileNotFoundError:
            pass
        if self.protocol not in (*_LOCAL, "memory"):
            # Stores with real directories behind their S3 API (SeaweedFS's filer) keep the emptied step
            # directory, which delimited listings show as a prefix and as an object "step_.../": one would
            # be left behind per deleted step. On S3 the key is a folder placeholder (as the console
            # makes); deleting a missing key is no error there.
            try:
                self._retry(lambda: self.fs.rm_file(d + "/"), self._what(step, "delete the directory"))
            except FileNotFoundError:
                pass
        self.fs.invalidate_cache(self.root)

    def delete_files(self, step: int, names: Iterable[str]) -> None:
        paths = [self._path(step, validate_filename(n)) for n in names]
        if not paths:
            return
        if self.protocol in (*_LOCAL, "memory"):
            for path in paths:
                try:
                    self._retry(functools.partial(self.fs.rm_file, path), self._what(step, "delete"))
                except FileNotFoundError:
                    pass
        else:  # one batch request (S3 DeleteObjects, GCS batch): a missing key is no error there
            self._retry(lambda: self.fs.rm(paths), self._what(step, "delete the files"))
        self.fs.invalidate_cache(self._path(step))

    def remove_if_empty(self, step: int) -> None:
        d = self._path(step)
        try:
            if self.protocol in (*_LOCAL, "memory"):
                self.fs.rmdir(d)  # refused while a file is left
            else:  # the directory's own key, which stores with real directories keep (see delete_step):
                # deleting it leaves the files still there in place
                self._retry(lambda: self.fs.rm_file(d + "/"), self._what(step, "delete the directory"))
        except OSError:  # not empty, or already gone
            pass
        self.fs.invalidate_cache(self.root)

    def __repr__(self) -> str:
        return f"ObjectTier({self.url!r})"


def _named(e: BaseException, message: str) -> BaseException:
    """An exception of ``e``'s type saying ``message`` (``e`` itself when its type needs other arguments)."""
    try:
        named = type(e)(message)
    except Exception:  # noqa: BLE001 - a type built otherwise: the original says less, but says it
        return e
    return named if str(named) == message else e
