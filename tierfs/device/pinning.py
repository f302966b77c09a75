"""Page-locking the RAM tier's buffers for copies to and from a GPU.

A mapped buffer is page-locked (``cudaHostRegister`` through ``torch.cuda.cudart()``, portable to every
device; read-only for a restore's read-only mapping) before its first copy, and it stays registered while
the tier reuses it: the registration is kept in the buffer's :class:`~tierfs.tiers._mapped.Memo` and
released just before the mapping is unmapped. The pages are the tier's own, already counted in its
budget. Should registration fail (the driver, a container's limits), the process warns once and copies
into pageable pages instead: correct, slower. ``TIERFS_PIN=0`` turns page-locking off.
"""

from __future__ import annotations

import logging
import os
import resource
import sys
from typing import Any

import numpy as np

log = logging.getLogger("tierfs")

_PIN_KEY, _UNPINNABLE = "page-locked", "not page-lockable"
_REGISTER_PORTABLE, _REGISTER_READ_ONLY = 1, 8
_pin_off: str | None = None  # why page-locking is off in this process (TIERFS_PIN=0, or a failed registration)
_pinned = [0]  # bytes registered now, in this process


def _torch() -> Any:
    return sys.modules["torch"]


def pinned_bytes() -> int:
    """Bytes of the RAM tier's buffers page-locked by this process (already counted in the tier's budget)."""
    return _pinned[0]


def pin(memo: Any, buf: np.ndarray) -> bool:
    """Page-lock ``buf`` (a whole mapped buffer) once; ``memo`` (its :class:`~tierfs.tiers._mapped.Memo`)
    holds the registration until the mapping goes. False when it is not page-locked (then copies still
    work, at pageable speed)."""
    global _pin_off
    if buf.size == 0 or memo is None or not hasattr(memo, "held"):
        return False
    if _PIN_KEY in memo.held:
        return True
    if _UNPINNABLE in memo.held:
        return False
    if _pin_off is None and os.environ.get("TIERFS_PIN", "1") == "0":
        _pin_off = "TIERFS_PIN=0"
    if _pin_off is not None:
        return False
    from ..util import hooks as _hooks

    ptr, n = buf.ctypes.data, buf.nbytes
    flags = _REGISTER_PORTABLE | (0 if buf.flags.writeable else _REGISTER_READ_ONLY)
    try:
        _hooks.at("pin", nbytes=n)  # a test makes registration fail here
        err = int(_torch().cuda.cudart().cudaHostRegister(ptr, n, flags))
    except Exception as e:  # noqa: BLE001 - any failure is the documented fallback
        err, why = -1, f"{type(e).__name__}: {e}"
    else:
        why = f"cudaError {err}"
    if err != 0:
        _clear_cuda_error()
        if not buf.flags.writeable:  # a restore's read-only mapping (some systems cannot lock those): unpinned
            memo.held.setdefault(_UNPINNABLE, lambda: None)
            log.info("tierfs: a read-only mapping of %d bytes could not be page-locked (%s): restoring from "
                     "pageable memory", n, why)
            return False
        _pin_off = why
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
        log.warning("tierfs: could not page-lock %d bytes of the RAM tier for device copies (%s; RLIMIT_MEMLOCK "
                    "is %s): copying through pageable memory instead, which is slower. To fix: raise the locked-memory "
                    "limit (ulimit -l unlimited; docker --ulimit memlock=-1) and check the CUDA driver; "
                    "TIERFS_PIN=0 skips page-locking without this warning", n, why, limit)
        return False

    def release(ptr: int = ptr, n: int = n) -> None:
        _pinned[0] -= n
        err = int(_torch().cuda.cudart().cudaHostUnregister(ptr))
        if err != 0:
            _clear_cuda_error()
            log.warning("tierfs: could not release the page-lock of %d bytes (cudaError %d)", n, err)

    memo.held[_PIN_KEY] = release
    _pinned[0] += n
    return True


def _clear_cuda_error() -> None:
    """Reset CUDA's last error on this thread, so a failed registration is not reported by a later launch."""
    fn = getattr(_torch().cuda.cudart(), "cudaGetLastError", None)
    if fn is not None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - nothing more to do
            pass
