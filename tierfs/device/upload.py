"""Restores into GPU memory: each verified block copied host-to-device as the next is verified.

:class:`Upload` makes the :class:`tierfs.format.blockio.Job` of an entry whose target is a CUDA tensor: the
checking thread verifies a block of the RAM tier's mapping (page-locked once, :mod:`tierfs.device.pinning`) and
issues its ``non_blocking`` copy on the device's side stream, then checks the next block while that one
copies. :meth:`Upload.finish` waits for every copy before the mapping may go or the targets are used.
"""

from __future__ import annotations

import functools
import threading
import warnings
from typing import Any

import numpy as np

from .copies import _torch, side_stream
from .pinning import pin
from ..errors import ArgumentError


def device_of(device: Any) -> Any:
    """``device`` (a string or torch.device) as a torch.device a restore can allocate on, or ArgumentError."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ArgumentError(f"device={device!r} is not a torch device ({e}); e.g. 'cuda:0' or 'cpu'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ArgumentError(f"device={device!r}: this process sees no CUDA device; restore to 'cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ArgumentError(f"device={device!r}: this process sees {torch.cuda.device_count()} CUDA devices")
    return dev


class Upload:
    """The host-to-device copies of one restore: :meth:`block` issues the copy of a verified block (on the
    checking thread, so the next block is checked while this one copies); :meth:`finish` waits for all."""

    def __init__(self) -> None:
        self._streams: dict[Any, Any] = {}
        self._lock = threading.Lock()

    def _stream(self, device: Any) -> Any:
        s = self._streams.get(device)
        if s is None:
            with self._lock:
                s = self._streams.get(device)
                if s is None:
                    torch = _torch()
                    s = side_stream(device)
                    s.wait_stream(torch.cuda.current_stream(device))  # after what the loop queued on the target
                    self._streams[device] = s
        return s

    def job(self, e: Any, file: np.ndarray, target: Any, manifest: Any, verified: bool, memo: Any) -> Any:
        """The :class:`tierfs.format.blockio.Job` that verifies entry ``e`` (of ``manifest``) in ``file`` (its
        mapped bytes; page-locked once, through ``memo``) and copies each block into ``target``."""
        from ..format import blockio as _blocks

        torch = _torch()
        pin(memo, file)
        self._stream(target.device)  # on the restoring thread: after what its current stream queued
        src = file[e.offset:e.offset + e.length]
        with warnings.catch_warnings():  # a read-only mapping: only read
            warnings.simplefilter("ignore", UserWarning)
            host = torch.from_numpy(src)
        dst = target.detach().reshape(-1).view(torch.uint8)
        return _blocks.Job(e.name, src, None, manifest.block_size, None if verified else e.crc32c,
                           functools.partial(manifest.key, e.name), then=functools.partial(self.block, dst, host))

    def block(self, dst: Any, host: Any, s: int, e: int) -> None:
        """Copy bytes ``s:e`` of ``host`` (verified) into the same bytes of ``dst`` (a device tensor's)."""
        torch = _torch()
        stream = self._stream(dst.device)
        with torch.cuda.device(dst.device), torch.cuda.stream(stream):
            dst[s:e].copy_(host[s:e], non_blocking=True)

    def finish(self) -> None:
        """Wait for every copy, then have each device's current stream wait for them too."""
        torch = _torch()
        for d, s in self._streams.items():
            s.synchronize()
            torch.cuda.current_stream(d).wait_stream(s)
        self._streams.clear()


def restore_device(device: Any, zero_copy: Any) -> Any:
    """``restore``'s ``device=`` as the CUDA device new tensors go to (None: the host)."""
    if device is None:
        return None
    dev = device_of(device)
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        raise ArgumentError(f"device={device!r}: restore makes tensors on a CUDA device or the CPU")
    if zero_copy:
        raise ArgumentError("zero_copy=True gives views of the RAM tier's host pages: it cannot be combined with "
                            f"device={device!r}")
    return dev
