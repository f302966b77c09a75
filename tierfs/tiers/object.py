"""The object tier: any fsspec URL (s3://, gs://, file://, memory://, ...), written in the background.

Nothing is renamed here (a rename is a copy on S3/GCS): files go to their final names and the commit
marker, written last, alone makes the step exist. Files upload concurrently; large files download as
concurrent ranged reads into one buffer, so a restore moves exactly the step's bytes.

Every request spends this rank's share of the job's request budget, if one is set, and is retried on
transient errors (:func:`tierfs.util.retry.retry`; throttling is waited out, not counted); one still failing
after the last attempt is a :class:`~tierfs.errors.TierUnavailableError` naming the tier, the step and the
file, whatever the client raised. Permanent errors (404, 403) are raised at once.

The S3 client retries too, and the layers multiply: ``docs/reliability.md`` says how long a failing store
takes to give up on, and how to make it shorter.

Keys: a step's marker at ``<root>/step_…/COMMITTED``; from format version 3 each rank's files under its
bucket, ``<root>/ranks/<bucket>/step_…/`` (:mod:`tierfs.format.keys`, :mod:`._objectkeys`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, TypeVar

import fsspec

from ..util import args as _args
from ..format.blockio import as_u8
from ..util.fileio import atomic_write, is_tmp_name
from ..util.retry import PATIENCE, PERMANENT, renamed, retry, short
from .rootdir import check_local_url
from ..errors import TierfsError, TierUnavailableError
from ..format import MARKER, SPREAD_VERSION, Marker, validate_filename
from ..policies import PreservationPolicy, PreserveAll, SavePolicy
from ._budget import JobBudget
from ._listing import by_prefix, common_prefix, files_in, is_dir_entry, mtime
from ._objectkeys import StepKeys, buckets, first_found, has_buckets, step_dirs
from ._parts import download, upload, whole_read
from ._pool import DaemonPool
from ._probe import LOCAL as _LOCAL, check_local_readable, probe
from .base import Bytes, Capacity, Pace, Tier

log = logging.getLogger("tierfs")
T = TypeVar("T")


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
        Larger files move in parts of this size: ranged reads on download; on upload, from two parts
        on, an S3 multipart upload (in parts of at least 5 MiB, the smallest S3 accepts) or a GCS
        resumable upload (in chunks rounded up to 256 KiB multiples), else one request.
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
        self._keys = StepKeys(self.root)
        self._emptied: dict[int, set[str]] = {}  # step -> folders this rank deleted files from

    # -- capabilities -------------------------------------------------------------------------------
    @property
    def location(self) -> str:
        return self.url

    def recipe(self) -> dict[str, Any] | None:
        """This tier's arguments, for a helper process to build it again: an ``ObjectTier`` itself (not a
        subclass), without a request budget (the helper's requests would not spend this process's share)."""
        if type(self) is not ObjectTier or self.requests_per_second is not None:
            return None
        return {k: getattr(self, k) for k in ("url", "storage_options", "concurrency", "part_size", "retries",
                                              "throttle_patience", "name")}

    def capacity(self) -> Capacity:
        return Capacity(used=0, budget=None, free=None)

    # -- life cycle ---------------------------------------------------------------------------------
    #: ask the store whether the bucket is there as the tier opens (:class:`~.capabilities.SharedStore`)
    probe_on_open = True

    def open(self) -> None:
        """Fail now, in one line, if the bucket is missing or the credentials are wrong (asked of a remote
        store only where ``probe_on_open``; a local root is made private on every rank)."""
        if self.probe_on_open or self.protocol in _LOCAL:
            probe(self.fs, self.protocol, self.root, self.url, f"tier {self.name}", self.throttle_patience)

    def check_readable(self) -> None:
        if self.protocol not in _LOCAL:  # only probes the bucket
            probe(self.fs, self.protocol, self.root, self.url, f"tier {self.name}", self.throttle_patience)
        else:
            check_local_readable(self.root, self.name)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    # -- helpers ------------------------------------------------------------------------------------
    def _dirs(self, step: int) -> list[str]:
        """Every folder ``step`` may have files in: its own, and its folder in each bucket the tier has."""
        found = self._ls(self._keys.buckets_dir, "list the rank buckets")
        return self._keys.all_dirs(step, buckets(found))

    def _ls(self, path: str, what: str) -> list[dict[str, Any]]:
        """The entries of folder ``path`` (none when it does not exist)."""
        self.fs.invalidate_cache(path)
        try:
            return list(self._retry(lambda: self.fs.ls(path, detail=True), what))
        except FileNotFoundError:
            return []

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
            named = renamed(e, f"tier {self.name!r} ({self.url}): {what}: {short(e)}")
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
        """Every step with a marker or a file left: the root's step folders, and those in each rank bucket
        (a step whose marker is not written, or no longer is, may have files there alone): one listing of
        the root, one of the buckets' folder and one per bucket, at most 256 whatever the job's size. For
        the tier's owner and tools; a restore asks :meth:`committed_steps`."""
        root = self._ls(self.root, "list the steps")  # a failed listing raises: never read as no steps
        # the buckets only when the root has their folder; one at a time: a rank's connections stay few
        spread = [self._ls(f"{self._keys.buckets_dir}/{b}", "list the steps")
                  for b in buckets(self._ls(self._keys.buckets_dir, "list the rank buckets"))] \
            if has_buckets(root) else []
        steps = sorted(set(step_dirs(root)) | set(step_dirs([e for b in spread for e in b])))
        return {s: bool(self.sizes_of(s, [MARKER])) for s in steps}

    def committed_steps(self) -> list[int]:
        """The root's entries alone (S3 and GCS: a delimited listing, the step prefixes, not their objects),
        then each step's marker: requests grow with the steps kept, never with the ranks or their files. A
        step emptied by a deletion cut short has no objects, hence no prefix."""
        return [s for s in step_dirs(self._ls(self.root, "list the steps")) if self.sizes_of(s, [MARKER])]

    def file_sizes(self, step: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for d, infos in self._step_entries(step):
            out.update({n: size for n, size in files_in(infos, d).items() if not is_tmp_name(n)})
        return out

    def _step_entries(self, step: int) -> list[tuple[str, list[dict[str, Any]]]]:
        """Each folder of ``step`` with its entries (a listing per folder: for tools, not for saves)."""
        dirs = self._dirs(step)
        return [(d, self._ls(d, self._what(step, "list"))) for d in dirs]

    def sizes_of(self, step: int, names: Iterable[str]) -> dict[str, int]:
        """What one rank wrote, whatever the job's size: several files (a shard's, ``rank_00003.*``) by one
        listing of their common prefix on S3 and GCS, else a request per file."""
        out: dict[str, int] = {}
        left = list(names)
        for attempt in (0, 1):  # where each file is likeliest; then, for a step of unknown layout, elsewhere
            folders: dict[str, list[str]] = {}
            for n in left:
                places = self._keys.places(step, n)
                if attempt < len(places):
                    folders.setdefault(places[attempt].rsplit("/", 1)[0], []).append(n)
            for d, wanted in folders.items():
                out.update(self._sizes_in(step, d, wanted))
            left = [n for n in left if n not in out]
            if not left:
                break
        return out

    def _sizes_in(self, step: int, d: str, wanted: list[str]) -> dict[str, int]:
        """``{name: size}`` of those of ``wanted`` in folder ``d``: one listing on S3 and GCS."""
        if len(wanted) > 1:
            got = by_prefix(self.fs, d, wanted,
                            lambda fn: self._retry(fn, self._what(step, "list", common_prefix(wanted) + "*")))
            if got is not None:
                return got
        out = {}
        for n in wanted:
            path = f"{d}/{n}"
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
        times = [mtime(e) for d, entries in self._step_entries(step) for e in entries
                 if e.get("type") == "file" and not is_dir_entry(e["name"], d)]
        if not times or any(t is None for t in times):
            return None  # the backend does not say: the age is unknown
        return max(t for t in times if t is not None)

    # -- writing ------------------------------------------------------------------------------------
    def write_file(self, step: int, name: str, data: Bytes) -> None:
        path = self._keys.written(step, name)
        self._keys.learn(step, True)
        if self.protocol in _LOCAL:  # straight from the buffer, no extra copy; durable like every local write
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            self._retry(lambda: atomic_write(path, data), self._what(step, "write", name))
            return
        payload = data if isinstance(data, bytes) else as_u8(data).tobytes()
        kw, requests = upload(self.protocol, len(payload), self.part_size)  # parts that fit the store
        self._retry(lambda: self.fs.pipe_file(path, payload, **kw), self._what(step, "upload", name), requests)

    def write_files(self, step: int, files: Mapping[str, Bytes], pace: Pace | None = None) -> None:
        def put(kv: tuple[str, Bytes]) -> None:
            if pace is not None:
                pace(as_u8(kv[1]).nbytes)
            self.write_file(step, kv[0], kv[1])
        self._map(put, list(files.items()))

    def write_marker(self, step: int, data: bytes) -> None:
        """The marker of a step this version's layout holds: a version-2 marker (a step an older tierfs saved,
        copied here) is written as version 3, which it otherwise is."""
        try:
            marker: Marker | None = Marker.from_bytes(data)
        except TierfsError:
            marker = None  # not a marker (a test's bytes): written as they are
        if marker is not None and marker.version < SPREAD_VERSION:
            if marker.commit is None:
                raise TierfsError(f"tier {self.name!r}: step {step} has a format-1 commit marker (an old tierfs wrote "
                                  "it), which an object tier cannot take now; restore the step and save it again")
            marker.version = SPREAD_VERSION
            data = marker.to_bytes()
        self.write_file(step, MARKER, data)

    def note_marker(self, step: int, marker: Marker) -> None:
        self._keys.learn_marker(step, marker)

    # -- reading ------------------------------------------------------------------------------------
    def read_range(self, step: int, name: str, start: int, end: int) -> bytes:
        what = self._what(step, "read", f"{name} bytes {start}-{end}")
        return bytes(first_found(self._keys.places(step, name), lambda path: self._retry(
            lambda: self.fs.cat_file(path, start=start, end=end), what)))

    def read_file(self, step: int, name: str) -> bytes:
        kw = whole_read(self.protocol)  # one GET, no HEAD
        data = bytes(first_found(self._keys.places(step, name), lambda path: self._retry(
            lambda: self.fs.cat_file(path, **kw), self._what(step, "read", name))))
        if name == MARKER:
            self._keys.learn_marker_bytes(step, data)
        return data

    def read_files(self, step: int, names: list[str]) -> dict[str, Bytes]:
        """Download files concurrently; large ones as ranged parts into one buffer (no extra bytes)."""
        sizes = self.sizes_of(step, names)  # this rank's files: one listing, whatever the job's size
        return download(sizes, names, self.part_size, functools.partial(self.read_file, step),
                        functools.partial(self.read_range, step), self._map,
                        lambda n: self._keys.places(step, n)[0])

    # -- deleting -----------------------------------------------------------------------------------
    def delete_step(self, step: int) -> None:
        """The marker, then the step's folder and its folder in each rank bucket (a listing of the buckets,
        and one deletion per folder: for retention's owner and for tools, never per rank)."""
        marker = self._keys.step_dir(step) + "/" + MARKER
        with contextlib.suppress(FileNotFoundError):
            self._retry(lambda: self.fs.rm_file(marker), self._what(step, "delete", MARKER))
        for d in self._dirs(step):  # one at a time: the connections a rank holds do not grow with the job
            self._delete_dir(step, d)
        self._keys.learn(step, None)
        self.fs.invalidate_cache(self.root)

    def _delete_dir(self, step: int, d: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._retry(lambda: self.fs.rm(d, recursive=True), self._what(step, "delete the files"))
        if self.protocol not in (*_LOCAL, "memory"):
            # Stores with real directories behind their S3 API (SeaweedFS's filer) keep the emptied step
            # directory, which delimited listings show as a prefix and as an object "step_.../": one would
            # be left behind per deleted step. On S3 the key is a folder placeholder (as the console
            # makes); deleting a missing key is no error there.
            with contextlib.suppress(FileNotFoundError):
                self._retry(lambda: self.fs.rm_file(d + "/"), self._what(step, "delete the directory"))

    def delete_files(self, step: int, names: Iterable[str]) -> None:
        paths = [p for n in names for p in self._keys.places(step, validate_filename(n))]
        if not paths:
            return
        folders = {p.rsplit("/", 1)[0] for p in paths}
        self._emptied.setdefault(step, set()).update(folders)  # what remove_if_empty tries
        # files in one batch request (S3 DeleteObjects, GCS batch; gcsfs raises when none was there), but a marker
        # alone, by a request that raises if it fails: a batch answers OK whatever befell each of its keys
        alone = [p for p in paths if self.protocol in (*_LOCAL, "memory") or p.endswith("/" + MARKER)]
        for path in alone:
            with contextlib.suppress(FileNotFoundError):
                self._retry(functools.partial(self.fs.rm_file, path), self._what(step, "delete"))
        if batch := [p for p in paths if p not in alone]:
            with contextlib.suppress(FileNotFoundError):
                self._retry(lambda: self.fs.rm(batch), self._what(step, "delete the files"))
        for d in folders:
            self.fs.invalidate_cache(d)

    def remove_if_empty(self, step: int) -> None:
        """The folders this rank deleted files of ``step`` from (the step's own once it deleted the marker,
        its bucket's once it deleted its files), each when empty: one request per folder."""
        for d in sorted(self._emptied.pop(step, set()), reverse=True):
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
