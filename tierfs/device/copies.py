"""Copies of a save from accelerator memory into the RAM tier's pages, with no host buffer in between.

Each CUDA tensor is copied device-to-host straight into its view of the tier's mapped buffer
(:meth:`~tierfs.core.layout.ShardLayout.views`), ``non_blocking``, on a side stream of its device that
first waits on the stream that produced the tensor. The copies are issued by one copy thread per process,
in chunks of about :data:`CHUNK` bytes, each followed by a CUDA event: the checksum of a tensor starts as
soon as its own chunk is copied (:meth:`Copies.ready`), not after the last copy. The mapped buffers are
page-locked before their first copy (:mod:`tierfs.device.pinning`).

**Overlap.** ``save(..., overlap=...)`` names the tensors that only an optimizer step changes (the
parameters and the optimizers' state): their copies may still be running when ``save`` returns, and every
other tensor (a BatchNorm's statistics, which forward changes) is copied first and waited for. The handle
(:class:`Copies`) is what a loop waits on before it changes them; an optimizer named in ``overlap`` waits
on it in a step pre-hook. CPU tensors named so are copied by the copy thread too.

Restores to a device are :mod:`tierfs.device.upload`'s. Nothing here touches CUDA unless a tensor is on a CUDA
device: importing tierfs initialises no CUDA state.
"""

from __future__ import annotations

import functools
import logging
import queue
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .pinning import pin, pinned_bytes
from ..errors import ArgumentError, DeviceError

log = logging.getLogger("tierfs")

#: bytes of small tensors copied between two CUDA events (a tensor at least this large gets its own)
CHUNK = 1 << 20


def _torch() -> Any:
    return sys.modules["torch"]


def on_cuda(t: Any) -> bool:
    """Whether tensor ``t`` is in CUDA memory (read from the tensor: initialises no CUDA state)."""
    return t.device.type == "cuda"


# -- what an overlapped save may leave running ----------------------------------------------------------
def address_of(t: Any) -> int:
    """Where tensor ``t``'s first element is (a DTensor's local shard's): a state dict's tensors are views of
    the parameters and optimizer state at their start, so they share it."""
    local = getattr(t, "_local_tensor", None)
    return int((local if local is not None else t).data_ptr())


def _optimizer_addresses(opt: Any) -> set[int]:
    """The addresses of an optimizer's parameters and state tensors, worked out again only when its
    parameters or the tensors of its state change (kept with the optimizer)."""
    torch = _torch()
    groups = opt.param_groups
    key = (len(opt.state), tuple((len(g["params"]), address_of(g["params"][0]) if g["params"] else 0)
                                 for g in groups))
    got = _addresses.get(opt)
    if got is not None and got[0] == key:
        return got[1]
    if opt not in _hooked and hasattr(opt, "register_load_state_dict_post_hook"):  # a load: new state tensors
        opt.register_load_state_dict_post_hook(lambda o: _addresses.pop(o, None))
        _hooked.add(opt)
    out = {address_of(p) for g in groups for p in g["params"] if p.numel()}
    for st in opt.state.values():
        out.update(address_of(v) for v in st.values() if isinstance(v, torch.Tensor) and v.numel())
    _addresses[opt] = (key, out)
    return out


#: each optimizer's addresses, with what they were worked out from
_addresses: "weakref.WeakKeyDictionary[Any, tuple[Any, set[int]]]" = weakref.WeakKeyDictionary()
_hooked: "weakref.WeakSet[Any]" = weakref.WeakSet()


@dataclass
class Overlap:
    """What ``save(..., overlap=...)`` names: the optimizers (a step pre-hook waits for the copies) and the
    addresses of the tensors whose copies may run on after ``save`` returns."""

    optimizers: list[Any]
    addresses: set[int]

    @classmethod
    def of(cls, overlap: Any) -> "Overlap | None":
        """``None``/``False``: no overlap. An optimizer, a list of them, or tensors (``model.parameters()``)."""
        if overlap is None or overlap is False:
            return None
        torch = sys.modules.get("torch")
        what = ("overlap= names what only the optimizer step changes: an optimizer, a list of optimizers, or "
                "the parameters (model.parameters()); got ")
        if overlap is True or torch is None or isinstance(overlap, (str, bytes)):
            raise ArgumentError(what + repr(overlap)[:60])
        try:
            items = [overlap] if isinstance(overlap, torch.optim.Optimizer) else list(overlap)
        except TypeError:
            raise ArgumentError(what + f"a {type(overlap).__name__}") from None
        optimizers: list[Any] = []
        addresses: set[int] = set()
        for x in items:
            if isinstance(x, torch.optim.Optimizer):
                optimizers.append(x)
                addresses |= _optimizer_addresses(x)
            elif isinstance(x, torch.Tensor):
                if x.numel():
                    addresses.add(address_of(x))
            else:
                raise ArgumentError(f"overlap= takes optimizers or tensors, got a {type(x).__name__}")
        if not items:
            raise ArgumentError("overlap= names no optimizer or tensor (a generator such as model.parameters() "
                                "used up already?); pass a list: list(model.parameters())")
        return cls(optimizers, addresses)

    def later(self, value: Any) -> bool:
        """Whether the copy of ``value`` may still run when ``save`` returns."""
        return value.data_ptr() in self.addresses


# -- save: device to host -------------------------------------------------------------------------------
@dataclass
class _Chunk:
    device: Any  # a torch.device, or None: CPU tensors (an overlapped save's)
    later: bool
    names: list[str] = field(default_factory=list)
    js: list[int] = field(default_factory=list)  # the layout's array indices
    dst: list[Any] = field(default_factory=list)
    src: list[Any] = field(default_factory=list)
    nbytes: int = 0
    event: Any = None
    issued: threading.Event = field(default_factory=threading.Event)


class Copies:
    """The copies of one save that run on the copy thread: a handle to wait on (``store.copies``).

    :meth:`wait` returns once every copy is complete (it raises :class:`~tierfs.errors.DeviceError` if one
    failed); :meth:`done` says whether they are, without waiting.
    """

    def __init__(self, step: int) -> None:
        self.step = step
        self._chunks: list[_Chunk] = []
        self._of: dict[int, int] = {}  # array index (the layout's) -> chunk
        self._error: BaseException | None = None
        self._buffers: list[tuple[Any, np.ndarray]] = []
        self._producers: list[tuple[Any, Any]] = []
        self._finished = threading.Event()

    def __repr__(self) -> str:
        return f"Copies(step={self.step}, done={self.done()})"

    def done(self) -> bool:
        """Whether every copy of the save is complete (or failed)."""
        if self._finished.is_set():
            return True
        if not all(c.issued.is_set() for c in self._chunks):
            return False
        if all(c.event is None or c.event.query() for c in self._chunks):
            self._finish()
            return True
        return False

    def wait(self) -> None:
        """Wait until every copy of the save is complete; raise DeviceError if one failed."""
        if not self._finished.is_set():
            self._wait([c for c in self._chunks])
            self._finish()
        self._raise()

    def settle(self) -> None:
        """Wait until every copy has ended, failed or not (no copy may write into a buffer that goes), raising
        nothing: whoever waits with :meth:`wait` hears of a failure."""
        try:
            self.wait()
        except BaseException:  # noqa: BLE001 - raised by wait() to its callers
            pass

    def wait_first(self) -> None:
        """Wait for the copies that ``save`` waits for in an overlapped save (all but the ``later`` ones)."""
        self._wait([c for c in self._chunks if not c.later])
        self._raise()

    def ready(self, j: int) -> Callable[[], None] | None:
        """A function that waits for array ``j``'s copy (None when it was copied on the caller's thread)."""
        k = self._of.get(j)
        if k is None:
            return None
        chunk = self._chunks[k]

        def wait() -> None:
            self._wait([chunk])
            self._raise()
        return wait

    def _wait(self, chunks: Sequence[_Chunk]) -> None:
        last: dict[Any, Any] = {}
        for c in chunks:
            c.issued.wait()
            if c.event is not None:
                last[c.device] = c.event  # events of one stream complete in order: the last one suffices
        for ev in last.values():
            ev.synchronize()

    def _finish(self) -> None:
        for c in self._chunks:  # the tensors may go: their copies are done
            c.src.clear()
            c.dst.clear()
        self._finished.set()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error


def plan(step: int, names: Sequence[str], items: Sequence[tuple[int, Any, Any]], overlap: Overlap | None,
         buffers: Sequence[tuple[Any, np.ndarray]]) -> tuple[Copies | None, list[int]]:
    """Sort a save's tensor copies ``(array index, source, destination view)``: those that run on the copy
    thread (CUDA tensors, and with ``overlap`` the CPU tensors it names) go into a :class:`Copies`; the
    indices of the others (CPU tensors, copied by the caller) come back. ``buffers``: the mapped buffers
    (with their memos) the destinations view, page-locked before the first CUDA copy."""
    chunks: list[_Chunk] = []
    here: list[int] = []
    current: dict[tuple[Any, bool], _Chunk] = {}
    for j, src, dst in items:
        cuda = on_cuda(src)
        later = overlap is not None and overlap.later(src)
        if not cuda and not later:
            here.append(j)
            continue
        key = (src.device if cuda else None, later)
        chunk = current.get(key)
        if chunk is None or chunk.nbytes >= CHUNK or (chunk.nbytes and dst.nbytes >= CHUNK):
            chunk = current[key] = _Chunk(key[0], later)
            chunks.append(chunk)
        chunk.names.append(names[j])
        chunk.js.append(j)
        chunk.src.append(src)
        chunk.dst.append(dst)
        chunk.nbytes += dst.nbytes
    if not chunks:
        return None, here
    copies = Copies(step)
    copies._chunks = sorted(chunks, key=lambda c: c.later)  # what save waits for, first
    copies._of = {j: k for k, c in enumerate(copies._chunks) for j in c.js}
    if any(c.device is not None for c in chunks):
        copies._buffers = list(buffers)
    return copies, here


def start(copies: Copies, optimizers: Sequence[Any] = ()) -> None:
    """Queue the copies on the copy thread, after noting (on the caller's thread) where each device's
    tensors are produced; ``optimizers`` wait for them in a step pre-hook (removed once they are done)."""
    torch = _torch()
    for d in dict.fromkeys(c.device for c in copies._chunks if c.device is not None):
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(d))
        copies._producers.append((d, ev))
    for opt in optimizers:
        slot = _waiting.get(opt)
        if slot is None:  # one pre-hook per optimizer, for its lifetime (a hook may not remove itself)
            slot = _waiting[opt] = [None]
            opt.register_step_pre_hook(functools.partial(_before_step, slot))
        slot[0] = copies
    _queue().put(copies)


#: each optimizer named by an overlapped save: the copies its next step waits for
_waiting: "weakref.WeakKeyDictionary[Any, list[Copies | None]]" = weakref.WeakKeyDictionary()


def _before_step(slot: list[Copies | None], *_: Any) -> None:
    copies, slot[0] = slot[0], None
    if copies is not None:
        copies.wait()


_jobs: "queue.SimpleQueue[Copies] | None" = None
_jobs_lock = threading.Lock()
_streams: dict[Any, Any] = {}


def _queue() -> "queue.SimpleQueue[Copies]":
    global _jobs
    with _jobs_lock:
        if _jobs is None:
            _jobs = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(_jobs,), name="tierfs-device-copy", daemon=True).start()
        return _jobs


def _serve(jobs: "queue.SimpleQueue[Copies]") -> None:
    while True:
        copies = jobs.get()
        try:
            _issue(copies)
        except BaseException as e:  # noqa: BLE001 - raised by whoever waits
            copies._error = e if isinstance(e, DeviceError) else DeviceError(
                f"step {copies.step}: copying the state from the device failed ({type(e).__name__}: {e})")
        finally:
            for c in copies._chunks:
                c.issued.set()


def side_stream(device: Any) -> Any:
    """This process's copy stream on ``device`` (made once: a save's chunks are ordered on one stream)."""
    s = _streams.get(device)
    if s is None:
        with _jobs_lock:
            s = _streams.get(device)
            if s is None:
                torch = _torch()
                with torch.cuda.device(device):
                    s = _streams[device] = torch.cuda.Stream()
    return s


def _issue(copies: Copies) -> None:
    from ..util import hooks as _hooks

    torch = _torch()
    for memo, buf in copies._buffers:
        pin(memo, buf)
    for d, ev in copies._producers:
        side_stream(d).wait_event(ev)
    with torch.no_grad():
        for c in copies._chunks:
            _hooks.at("copy", step=copies.step, nbytes=c.nbytes, later=c.later)
            if c.device is None:  # an overlapped save's CPU tensors
                torch._foreach_copy_(c.dst, c.src)
                c.issued.set()
                continue
            stream = side_stream(c.device)
            with torch.cuda.device(c.device), torch.cuda.stream(stream):
                try:
                    for name, d, s in zip(c.names, c.dst, c.src):
                        try:
                            d.copy_(s, non_blocking=True)
                        except torch.OutOfMemoryError:
                            raise DeviceError(
                                f"step {copies.step}: {name!r} is not contiguous, and copying it to the host needs "
                                f"{d.nbytes} bytes of free memory on {c.device}, which it lacks: free that much "
                                "device memory, or save it .contiguous()") from None
                finally:  # also after a failure: what was queued is waited for before the buffers go
                    c.event = torch.cuda.Event()
                    c.event.record(stream)
            c.issued.set()


__all__ = ["CHUNK", "Copies", "Overlap", "on_cuda", "pin", "pinned_bytes", "plan", "side_stream", "start"]
