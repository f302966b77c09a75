"""A file being written through ``tiered::``: a private temporary file in RAM, renamed into place on
close (or on the transaction's commit), then queued for the drain."""

from __future__ import annotations

import errno
import io
from typing import TYPE_CHECKING, Any

from ..util.fileio import private_opener

if TYPE_CHECKING:
    from .writeback import Drain


class RamWriter(io.RawIOBase):
    """A file being written into RAM. Leaving a ``with`` block by an exception discards it, and so does
    a writer that is never closed: nothing half-written becomes a file."""

    def __init__(self, drain: "Drain", rel: str, *, exclusive: bool, autocommit: bool) -> None:
        super().__init__()
        self.drain, self.rel, self.exclusive, self.autocommit = drain, rel, exclusive, autocommit
        self.path = drain.tpath(rel)
        self.mode = "wb"
        self._tmp = drain.tmpfile(rel)
        self._f = open(self._tmp, "wb", opener=private_opener)
        self._state = "open"

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        try:
            return self._f.write(b)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                self.discard()
                raise self.drain.full_error(self.rel) from None
            raise

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def fileno(self) -> int:
        return self._f.fileno()

    def flush(self) -> None:
        if not self._f.closed:
            self._f.flush()

    def close(self) -> None:
        if self._state == "open":
            self._f.close()
            self._state = "closed"
            if self.autocommit:
                self.commit()
        super().close()

    def commit(self) -> None:
        """Rename into place and queue for the target."""
        if self._state == "committed":
            return
        if not self._f.closed:
            self._f.close()
        self._state = "committed"
        self.drain.commit(self._tmp, self.rel, self.exclusive)

    def discard(self) -> None:
        """Drop what was written."""
        if not self._f.closed:
            self._f.close()
        self._state = "committed"
        self._tmp.unlink(missing_ok=True)
        super().close()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.discard()
        else:
            self.close()

    def __del__(self) -> None:
        if getattr(self, "_state", "committed") == "open":
            self.discard()  # never closed: nothing half-written becomes a file
