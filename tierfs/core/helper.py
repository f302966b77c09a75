"""A process of the rank's own that uploads its shards (``TieredStore(..., helper=True)``).

An upload is Python from end to end: every block's checksum checked before it leaves, the fsspec client,
its event loop and its HTTP requests. In the training process that work takes turns with the training
loop for the GIL. With a helper it runs in a process started for the purpose (once per store, again after
one ended), which reads the step's files from the first tier's pages (the same tmpfs pages: nothing is
copied to hand them over) and writes them to the object tier.

The training process keeps every step of the protocol but the bytes: the copy thread still takes part in
the ranks' agreement on the copy, and writes the marker only once every rank's shard is there. It asks
the helper for one rank's shard (:func:`tierfs.protocol.copy_shard`: every block checked, files, manifest
last, the result checked complete) and answers its requests for the throttle, so the helper's bytes are
paced with every other background copy of the process (and the ``transfer`` test hook runs in the
training process, as without a helper).

A helper that ends mid-copy (killed, out of memory) is a :class:`~tierfs.errors.HelperError` naming it,
its process id and how it ended, raised on the copy thread as soon as its connection drops: the copy of
that step fails on every rank (their agreement), the step stays in the first tier, the store's next call
raises the error, and the next copy starts a new helper. A store opened again copies on the steps a slower
tier lacks (``cleanup``), so the tier catches up. A helper whose training process ended ends too.

Only tiers that can be rebuilt in another process take a helper (:meth:`ObjectTier.recipe`: an
``ObjectTier`` without a request budget); the others, and a first tier without files another process can
open, copy in the training process as before. The helper is started as ``python -m tierfs.core._helpermain``
with a socket pair of its own; only this process's own objects cross it.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Mapping

from .. import errors as _errors
from ..errors import HelperError, TierfsError
from ..format import Manifest
from ..protocol import copy_shard
from ..tiers.base import Tier

log = logging.getLogger("tierfs")


def copy_out(helper: "Helper | None", src: Tier, dst: Tier, step: int, manifest: Manifest, mbytes: bytes,
             pace: Callable[[int], None]) -> int:
    """This rank's shard of ``step`` from ``src`` to ``dst``, verified (:func:`tierfs.protocol.copy_shard`): in
    ``helper`` where it can take the copy, else here. Returns the bytes copied."""
    recipe = dst.recipe() if helper is not None else None
    paths = _paths(src, step, manifest.held_files(dst.is_local)) if recipe is not None else None
    if helper is None or recipe is None or paths is None:
        return copy_shard(src, dst, step, manifest, mbytes, threads=1, pace=pace, batched=False)
    return helper.copy(recipe, dst.name, step, paths, mbytes, pace)


def _paths(src: Tier, step: int, names: Mapping[str, int]) -> dict[str, str] | None:
    out = {}
    for n in names:
        p = src.file_path(step, n)
        if p is None:
            return None
        out[n] = str(p)
    return out


class Helper:
    """This rank's helper process, started when first needed; ``rank`` names it in errors."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.copies = 0  # copies it made (its successors' included)
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The running helper's process id (None before the first copy, or once it ended)."""
        p = self._proc
        return p.pid if p is not None and p.poll() is None else None

    def _start(self) -> tuple[subprocess.Popen[bytes], Connection]:
        if self._proc is not None and self._proc.poll() is None and self._conn is not None:
            return self._proc, self._conn
        self._stop()
        mine, theirs = socket.socketpair()
        env = dict(os.environ)
        here = str(Path(__file__).resolve().parents[2])  # the directory tierfs is imported from
        env["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [env.get("PYTHONPATH")])])
        try:
            argv = [sys.executable, "-m", "tierfs.core._helpermain", str(theirs.fileno()), str(os.getpid())]
            proc = subprocess.Popen(argv, pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self._proc, self._conn = proc, Connection(mine.detach())
        log.info("tierfs: rank %d's upload helper started (pid %d)", self.rank, proc.pid)
        return proc, self._conn

    def copy(self, recipe: dict[str, Any], tier: str, step: int, paths: Mapping[str, str], mbytes: bytes,
             pace: Callable[[int], None]) -> int:
        """Have the helper copy the files at ``paths`` (``{name: path}``) of ``step`` to the tier built from
        ``recipe``, verified, manifest last; ``pace(nbytes)`` answers its throttle requests."""
        failures: list[BaseException] = []  # pace's (a copy given up, a test hook's): the helper stops
        with self._lock:
            proc, conn = self._start()
            try:
                conn.send(("copy", recipe, step, dict(paths), bytes(mbytes)))
                while True:
                    reply = conn.recv()
                    if reply[0] != "pace":  # ("done", bytes) or ("error", type name, message)
                        break
                    if not failures:  # before each batch of bytes is checked or written
                        try:
                            pace(int(reply[1]))
                        except BaseException as e:  # noqa: BLE001 - raised once the helper stopped
                            failures.append(e)
                    conn.send(("stop", str(failures[0])) if failures else ("go",))
            except (EOFError, OSError):
                raise HelperError(self._ended(proc, step, tier)) from None
            except BaseException:  # an interrupt on this thread: the helper's copy must not go on unseen
                self._stop()
                raise
        if failures:
            raise failures[0]
        if reply[0] != "done":
            raise _rebuilt(reply[1], reply[2])
        self.copies += 1
        log.info("tierfs: step %d copied to %s by rank %d's upload helper (pid %d)", step, tier, self.rank, proc.pid)
        return int(reply[1])

    def _ended(self, proc: subprocess.Popen[bytes], step: int, tier: str) -> str:
        try:
            code = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        self._stop()
        if code is None:
            how = "its connection dropped"
        elif code < 0:
            how = f"killed by signal {-code} ({signal.Signals(-code).name})" if -code in signal.valid_signals() \
                else f"killed by signal {-code}"
        else:
            how = f"exit status {code}"
        return (f"rank {self.rank}'s upload helper (pid {proc.pid}) ended ({how}) while copying step {step} to "
                f"{tier}; the step is still in the first tier, and the next copy starts a new helper")

    def _stop(self) -> None:
        proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if conn is not None:
            conn.close()
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """End the helper (between copies: it has nothing to finish)."""
        with self._lock:
            self._stop()


def _rebuilt(kind: str, message: str) -> BaseException:
    """The helper's failure as the same class of error here (tierfs's own, or a missing file)."""
    import builtins

    cls = getattr(_errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, TierfsError) and cls is not _errors.RankWaitError:
        try:
            return cls(message)
        except TypeError:
            pass
    if kind in ("FileNotFoundError", "PermissionError"):
        return getattr(builtins, kind)(message)  # type: ignore[no-any-return]
    return HelperError(f"the upload helper failed: {kind}: {message}")


# -- the helper's side ----------------------------------------------------------------------------------
class _Files:
    """The first tier's files of one step, opened read-only by path, as ``copy_shard`` reads a source."""

    def __init__(self, paths: Mapping[str, str]) -> None:
        self.paths = paths

    def read_files(self, step: int, names: list[str]) -> dict[str, Any]:
        import mmap

        import numpy as np

        out: dict[str, Any] = {}
        for n in names:
            with open(self.paths[n], "rb") as f:
                size = os.fstat(f.fileno()).st_size
                out[n] = np.frombuffer(mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ), dtype=np.uint8) if size \
                    else np.empty(0, dtype=np.uint8)
        return out


class _Stopped(TierfsError):
    pass


def _serve(conn: Connection) -> None:
    from ..tiers.object import ObjectTier
    from ..util.worker import lower_priority

    lower_priority()
    tiers: dict[str, ObjectTier] = {}
    asking = threading.Lock()  # the tier's threads ask for the throttle one at a time
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the training process closed the store, or ended
        _, recipe, step, paths, mbytes = msg

        def pace(nbytes: int) -> None:
            with asking:
                conn.send(("pace", int(nbytes)))
                answer = conn.recv()
            if answer[0] != "go":
                raise _Stopped(answer[1])

        try:
            key = repr(sorted(recipe.items()))
            tier = tiers.get(key)
            if tier is None:
                tier = tiers[key] = ObjectTier(**recipe)
            src: Any = _Files(paths)  # the one method copy_shard asks of a source
            n = copy_shard(src, tier, step, Manifest.from_bytes(mbytes), mbytes, threads=1, pace=pace, batched=False)
            conn.send(("done", n))
        except BaseException as e:  # noqa: BLE001 - the training process raises it as the same class
            if isinstance(e, (EOFError, BrokenPipeError, ConnectionError)):
                return  # the training process is gone
            conn.send(("error", type(e).__name__, str(e)))


def _die_with_parent(parent: int) -> None:
    """End this process once the one that started it has (it is then a child of another): a thread that
    looks every second. (The kernel's parent-death signal follows the thread that started a process, which
    may end long before the training process does.)"""
    import time

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="tierfs-helper-parent", daemon=True).start()


def main(fd: int, parent: int) -> None:
    """The helper process: serve the copies asked on the connection at file descriptor ``fd`` for process
    ``parent``."""
    _die_with_parent(parent)
    _serve(Connection(fd))
