"""``tiered::`` — an fsspec filesystem that puts a RAM tier in front of any other filesystem.

Any pipeline that writes through fsspec (zarr, DCP's ``FsspecWriter``, pandas, a plain ``fsspec.open``
loop) gains a RAM tier by changing only its URL::

    fs, root = fsspec.url_to_fs("tiered::s3://bucket/run", tiered={"path": "/dev/shm/tierfs/run"},
                                s3={"endpoint_url": ...})
    fs.pipe(f"{root}/a.bin", data)     # lands in RAM; copied to s3://bucket/run/a.bin in the background
    fs.flush()                         # returns once everything written is durable on the target

Paths are the target's paths (``bucket/run/a.bin`` here); the RAM directory mirrors them
(``/dev/shm/tierfs/run/bucket/run/a.bin``). A write goes to a temporary file in RAM that is renamed into
place, so a reader never sees half a file, and is then queued for the drain (``writeback.Drain``): a few
low-priority threads that upload within a bandwidth cap. Listings show complete files only: never the
temporary name of a write in flight, in RAM or on the target.

The drain is shared by every instance of this class in the process that has the same RAM directory
and target (fsspec makes separate instances per thread and for async use, and zarr makes its own), so
``flush()`` on any of them waits for writes made through all of them.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import shutil
from glob import has_magic
from typing import IO, Any

import fsspec
from fsspec.asyn import AsyncFileSystem, sync
from fsspec.transaction import Transaction
from fsspec.utils import stringify_path, tokenize

from ..util import args as _args
from ..util import exitwork as _exit
from ..util.fileio import make_private_dir
from ..util.worker import DEFAULT_BACKGROUND_BANDWIDTH
from ..errors import ArgumentError
from . import options as opt
from . import upload
from .drains import drain_for
from .listing import TieredListing
from .ramdir import rel_path
from .ramfile import RamWriter
from .writeback import Drain, protocol_of

try:  # fsspec >= 2025.9: url_to_fs hands a chained filesystem the target's path
    from fsspec.implementations.chained import ChainedFileSystem

    _BASES: tuple[type, ...] = (AsyncFileSystem, ChainedFileSystem)
except ImportError:  # pragma: no cover - older fsspec
    _BASES = (AsyncFileSystem,)


class _FlushingTransaction(Transaction):
    """``with fs.transaction:`` commits the files written inside, then flushes them to the target."""

    def complete(self, commit: bool = True) -> None:
        fs = self.fs
        super().complete(commit)
        if commit and fs is not None:
            fs.flush()


class TieredFileSystem(TieredListing, *_BASES):  # type: ignore[misc]
    """A write-back RAM tier in front of any fsspec filesystem (``tiered::s3://bucket/run``).

    Parameters
    ----------
    path:
        RAM directory (created 0700), on tmpfs such as ``/dev/shm``. Default
        ``/dev/shm/tierfs/<job id>-fsspec``. Target paths are mirrored below it.
    target_protocol, target_options:
        The filesystem behind the RAM tier and its options (what ``tiered::s3://...`` sets).
    fo:
        The target URL or path (``s3://bucket/run``); with no ``target_protocol`` the protocol comes from it.
        A URL with a typo (``s3:/bucket``), an unknown protocol or no bucket is an ``ArgumentError``.
    fs:
        A target filesystem instance instead of ``target_protocol``/``target_options``.
    budget:
        Most bytes the RAM directory may hold. Files already durable on the target are evicted oldest
        first to make room; then a write waits for the drain (``when_full="wait"``) or raises
        ``CapacityError`` (``"raise"``), as it does when the data cannot fit at all. Default: the free
        space of the filesystem holding ``path``.
    drain:
        ``"background"`` (default): upload each file as soon as it is written. ``"manual"``: upload only
        in ``flush()`` (nothing competes with training until then).
    drain_bandwidth:
        Bytes per second the uploads may move on average (default 256 MB/s; None: no cap), in bursts of
        up to 64 MiB or one file.
    drain_concurrency:
        Files uploaded at once (default 4).
    retries:
        Attempts per upload on transient errors, with backoff.
    when_full:
        ``"wait"`` or ``"raise"``, see ``budget``.
    timeout:
        Seconds (or a ``timedelta``) ``flush()`` waits at most for the uploads before it raises
        ``TimeoutError`` (default: until they end, each bounded by the target's own timeouts and
        ``retries``). This filesystem has no collectives across ranks: each process flushes its own files.
    exit_timeout:
        Seconds (or a ``timedelta``) that uploads still pending at interpreter exit may take (a program
        that never calls ``flush()``, such as pandas, still leaves its files on the target); past it, one
        warning names what is not durable and where in RAM it is. ``0``: finish nothing at exit. Default:
        ``TIERFS_EXIT_TIMEOUT`` from the environment, else 600.

    Notes
    -----
    The drain (queue, threads, RAM accounting) is shared by every instance with the same RAM directory
    and target in the process; the first instance's drain options apply. Reads come from RAM while it
    holds a file, else from the target. This filesystem assumes it is the only writer of its target
    paths (a job-scoped prefix), as any write-back cache does.
    """

    protocol = "tiered"
    root_marker = ""
    transaction_type = _FlushingTransaction

    def __init__(self, path: str | None = None, target_protocol: str | None = None,
                 target_options: dict[str, Any] | None = None, fo: str | None = None,
                 fs: fsspec.AbstractFileSystem | None = None, *, budget: int | None = None,
                 drain: str = "background", drain_bandwidth: float | None = DEFAULT_BACKGROUND_BANDWIDTH,
                 drain_concurrency: int = 4, retries: int = 4, when_full: str = "wait",
                 timeout: float | datetime.timedelta | str | None = None,
                 exit_timeout: float | datetime.timedelta | str | None = None,
                 asynchronous: bool = False, loop: Any = None, batch_size: int | None = None) -> None:
        super().__init__(asynchronous=asynchronous, loop=loop, batch_size=batch_size)
        o = opt.options(timeout=timeout, drain=drain, when_full=when_full, budget=budget, bandwidth=drain_bandwidth,
                       concurrency=drain_concurrency, retries=retries)
        self.timeout = o.timeout
        self.exit_timeout = _exit.exit_seconds(exit_timeout, "tiered:// exit_timeout")
        root = opt.ram_root(path)
        fs, opts = opt.target(fo, target_protocol, target_options, fs)  # a typo in the URL: nothing is created
        key = (protocol_of(fs), tokenize(opts))  # not fs._fs_token: it differs per thread for sync classes
        self.target = fs
        self.fo = fo
        root = opt.make_ram_root(root)
        self._drain = drain_for(root, fs, key, budget=o.budget, drain=o.drain, bandwidth=o.bandwidth,
                                concurrency=o.concurrency, retries=o.retries, when_full=o.when_full,
                                exit_timeout=self.exit_timeout)

    @property
    def drain(self) -> Drain:
        """The drain (RAM directory, pending uploads, upload threads) this instance shares with every
        instance for the same RAM directory and target in the process."""
        return self._drain

    # -- paths --------------------------------------------------------------------------------------
    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, (list, tuple)):
            return [cls._strip_protocol(p) for p in path]
        path = stringify_path(path)
        if not isinstance(path, str):
            raise ArgumentError(f"tiered:// paths are strings (or lists of them), got {_args.shown(path)}")
        for prefix in ("tiered::", "tiered://"):
            if path.startswith(prefix):
                path = path[len(prefix):]
        if "::" in path:
            path = path.rsplit("::", 1)[-1]
        if "://" in path:
            path = path.split("://", 1)[1]
        return path.rstrip("/") or ("/" if path.startswith("/") else "")

    def _norm(self, path: Any) -> tuple[str, str]:
        """``(target path, RAM-relative path)`` of a user path."""
        tp = self.target._strip_protocol(self._strip_protocol(path))
        tp = tp.rstrip("/") or tp
        return tp, rel_path(tp)

    def ram_path(self, path: str) -> str:
        """The local directory or file that mirrors ``path`` in RAM; directories are created (0700).

        For tools that cannot call fsspec (tensorstore's ``file`` kvstore): write below it, then call
        :meth:`adopt` so the drain uploads what was written.
        """
        _, rel = self._norm(path)
        p = self._ram.path(rel)
        if not p.exists():
            self._ram.make_dir(rel)
        return str(p)

    def adopt(self, path: str) -> int:
        """Queue the files another program wrote below ``ram_path(path)``; returns how many were new."""
        _, rel = self._norm(path)
        return self._drain.adopt(rel)

    # -- durability ---------------------------------------------------------------------------------
    def retry_failed(self) -> int:
        """Upload again the files whose upload failed for good (a missing bucket, no permission) when an
        earlier process exited: that exit moved them aside in the RAM directory, and no process retries
        them unless asked, here. Returns how many were queued; :meth:`flush` waits for them."""
        return upload.retry_failed(self._drain)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every file written through any instance for this RAM directory and target is
        durable on the target (at most ``timeout`` seconds, default the filesystem's ``timeout``). Raises
        ``BackgroundError`` (one line) naming a file that is not, ``TimeoutError`` past the timeout."""
        self._drain.flush(self.timeout if timeout is None else timeout)

    async def _flush(self, timeout: float | None = None) -> None:
        await asyncio.to_thread(self._drain.flush, self.timeout if timeout is None else timeout)

    def pending(self) -> list[str]:
        """Target paths written but not (yet) durable on the target."""
        return self._drain.pending()

    def stats(self) -> dict[str, int]:
        """Counters shared by the instances of this drain: ``ram_reads``, ``target_reads``, ``uploads``,
        ``bytes_uploaded``, ``upload_failures``, ``evictions``."""
        return self._drain.stats()

    def __enter__(self) -> "TieredFileSystem":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.flush()

    # -- reading ------------------------------------------------------------------------------------
    def _read_ram(self, rel: str, start: int | None, end: int | None) -> bytes | None:
        f = self._drain.open_ram(rel)
        if f is None:
            return None
        with f:
            size = os.fstat(f.fileno()).st_size
            s = 0 if start is None else (max(0, size + start) if start < 0 else min(start, size))
            e = size if end is None else (max(0, size + end) if end < 0 else min(end, size))
            if e <= s:
                return b""
            f.seek(s)
            return f.read(e - s)

    async def _cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs) -> bytes:
        tp, rel = self._norm(path)
        data = await asyncio.to_thread(self._read_ram, rel, start, end)
        if data is not None:
            return data
        self._drain.count_target_read()
        return await asyncio.to_thread(self.target.cat_file, tp, start=start, end=end, **kwargs)

    async def _get_file(self, rpath: str, lpath: str, **kwargs) -> None:
        tp, rel = self._norm(rpath)
        f = self._drain.open_ram(rel)
        if f is None:
            if rel and self._ram.is_dir(rel):
                os.makedirs(lpath, exist_ok=True)
                return
            self._drain.count_target_read()
            await asyncio.to_thread(self.target.get_file, tp, lpath, **kwargs)
            return

        def copy() -> None:
            with f, open(lpath, "wb") as out:
                shutil.copyfileobj(f, out, 8 << 20)
        await asyncio.to_thread(copy)

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, autocommit: bool = True,
              cache_options: dict | None = None, **kwargs):
        tp, rel = self._norm(path)
        if "r" in mode and "+" not in mode:
            f = self._drain.open_ram(rel)
            if f is not None:
                return f
            self._drain.count_target_read()
            return self.target.open(tp, mode, block_size=block_size, cache_options=cache_options, **kwargs)
        if mode in ("wb", "xb", "ab"):
            if not rel:
                raise IsADirectoryError(f"{path} is the root")
            if mode == "xb" and self.exists(tp):
                raise FileExistsError(f"{tp} exists (mode='xb')")
            w = RamWriter(self._drain, rel, exclusive=mode == "xb", autocommit=autocommit)
            if mode == "ab" and self.exists(tp):
                w.write(self.cat_file(tp))
            return w
        raise ArgumentError(f"tiered:// opens files with rb, wb, xb or ab (or their text modes), not {mode!r}")

    # -- writing ------------------------------------------------------------------------------------
    async def _pipe(self, path: Any, value: Any = None, batch_size: int | None = None, **kwargs: Any) -> Any:
        """Write bytes: ``pipe(path, data)`` or ``pipe({path: data, ...})``."""
        items = path if isinstance(path, dict) else {opt.path_arg(path, "pipe"): value}
        for p, v in items.items():
            opt.data_arg(opt.path_arg(p, "pipe"), v)
        return await super()._pipe(path, value, batch_size=batch_size, **kwargs)

    async def _cat(self, path: Any, recursive: bool = False, on_error: str = "raise",
                   batch_size: int | None = None, **kwargs: Any) -> Any:
        opt.path_arg(path, "cat")
        return await super()._cat(path, recursive=recursive, on_error=on_error, batch_size=batch_size, **kwargs)

    async def _put(self, lpath: Any, rpath: Any, *args: Any, **kwargs: Any) -> Any:
        opt.path_arg(lpath, "put (local path)")
        opt.path_arg(rpath, "put")
        return await super()._put(lpath, rpath, *args, **kwargs)

    async def _pipe_file(self, path: str, value: Any, mode: str = "overwrite", **kwargs) -> None:
        _, rel = self._norm(path)
        if not rel:
            raise IsADirectoryError(f"{path} is the root")
        await asyncio.to_thread(self._drain.write, rel, value, mode == "create")

    async def _put_file(self, lpath: str, rpath: str, mode: str = "overwrite", **kwargs) -> None:
        if os.path.isdir(lpath):
            await self._makedirs(rpath, exist_ok=True)
            return
        _, rel = self._norm(rpath)

        def copy(dst: IO[bytes]) -> None:
            with open(lpath, "rb") as src:
                shutil.copyfileobj(src, dst, 8 << 20)
        await asyncio.to_thread(lambda: self._drain.write(rel, copy, mode == "create", size=os.path.getsize(lpath)))

    async def _cp_file(self, path1: str, path2: str, **kwargs) -> None:
        tp1, rel1 = self._norm(path1)
        tp2, rel2 = self._norm(path2)
        f = self._drain.open_ram(rel1)
        if f is None:  # only the target holds it: copy there, and drop an older RAM copy of the destination
            await self._forget(rel2)
            self._drain.count_target_read()
            await asyncio.to_thread(self.target.cp_file, tp1, tp2, **kwargs)
            return

        def copy() -> None:
            with f:
                self._drain.write(rel2, lambda out: shutil.copyfileobj(f, out, 8 << 20),
                                  size=os.fstat(f.fileno()).st_size)
        await asyncio.to_thread(copy)

    async def _forget(self, rel: str) -> None:
        """Drop RAM's copy of a file about to be replaced on the target alone."""
        if self._ram.holds(rel):
            await asyncio.to_thread(self._drain.forget, rel)

    async def _mv_file(self, path1: str, path2: str) -> None:
        tp1, rel1 = self._norm(path1)
        tp2, rel2 = self._norm(path2)
        if tp1 == tp2:
            return
        remote = await asyncio.to_thread(self._drain.move, rel1, rel2)
        if remote is None:  # not in RAM
            await self._forget(rel2)
            await asyncio.to_thread(self.target.mv, tp1, tp2)
        elif remote:
            await asyncio.to_thread(_rm_quiet, self.target, tp1, False)

    def mv(self, path1: Any, path2: Any, recursive: bool = False, maxdepth: int | None = None, **kwargs) -> None:
        """Move a file; a file held in RAM is renamed there (no copy) and its new name queued."""
        if isinstance(path1, str) and isinstance(path2, str) and not recursive and self.isfile(path1):
            return sync(self.loop, self._mv_file, path1, path2)
        return super().mv(path1, path2, recursive=recursive, maxdepth=maxdepth, **kwargs)

    async def _makedirs(self, path: str, exist_ok: bool = False) -> None:
        tp, rel = self._norm(path)
        p = self._ram.path(rel)
        if not exist_ok and (p.is_dir() or await self._isdir(tp)):
            raise FileExistsError(tp)
        if p.is_file():
            raise FileExistsError(f"{tp} is a file")
        await asyncio.to_thread(make_private_dir, p)

    async def _mkdir(self, path: str, create_parents: bool = True, **kwargs) -> None:
        tp, rel = self._norm(path)
        if not create_parents and not await self._isdir(self._parent(tp)):
            raise FileNotFoundError(f"parent of {tp} does not exist")
        await self._makedirs(path, exist_ok=True)

    # -- removing -----------------------------------------------------------------------------------
    async def _rm_file(self, path: str, **kwargs) -> None:
        await self._rm_one(path, False)

    async def _rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None, **kwargs) -> None:
        paths = [path] if isinstance(path, str) else list(path)
        if maxdepth is not None or any(has_magic(p) for p in paths):
            paths = await self._expand_path(paths, recursive=recursive, maxdepth=maxdepth)
            for p in sorted(paths, reverse=True):  # files before their directories
                await self._rm_one(p, False, missing_ok=True)
            return
        for p in paths:
            await self._rm_one(p, recursive)

    async def _rm_one(self, path: str, recursive: bool, missing_ok: bool = False) -> None:
        tp, rel = self._norm(path)
        in_ram, remote = await asyncio.to_thread(self._drain.remove, rel, recursive)
        if not remote:
            return
        try:
            await asyncio.to_thread(self.target.rm, tp, recursive=recursive)
        except FileNotFoundError:
            if not in_ram and not missing_ok:
                raise FileNotFoundError(tp) from None


def _rm_quiet(fs: fsspec.AbstractFileSystem, path: str, recursive: bool) -> None:
    try:
        fs.rm(path, recursive=recursive)
    except FileNotFoundError:
        pass
