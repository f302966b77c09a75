"""Where a state's arrays go in a step's shard files, worked out once per structure.

Training saves the same structure again and again: the same names, dtypes and shapes. A :class:`ShardLayout`
is what a save of one structure needs besides the bytes: every leaf's place in the shard files, the
manifest's entries without their checksums, and how to copy each leaf. :func:`describe` reads a state's
structure (one walk, a few attribute reads per leaf), a layout whose :attr:`~ShardLayout.signature` equals it
is reused, and a structure that differs in anything (a name, the order, a dtype, a shape, a leaf's kind)
gets a new one: a step is never written with a stale layout.

The RAM tier's buffers are reused mappings, so the typed views a copy writes through (one torch tensor or
numpy array per leaf, viewing its bytes in the buffer) are made once per buffer and layout and kept in
the buffer's memo (:meth:`~tierfs.tiers.capabilities.Staging.buffer_memo`), which dies with the mapping. A save of a
known structure into known buffers then does only the copies: torch tensors in one ``_foreach_copy_``
(the same ``copy_`` as a hand-written loop, on torch's threads), numpy arrays with ``np.copyto``.
"""

from __future__ import annotations

import copy
import sys
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .. import state as st
from ..device import copies as _device
from ..util import hooks as _hooks
from ..errors import ArgumentError
from ..format import Entry, Manifest, entry_name_problem, shown_name, user_key
from .dataparallel import Sharing, place

# how a leaf is copied into its buffer
TORCH, NUMPY, OTHER, JSON = 0, 1, 2, 3
#: restores verify entries up to this size first and copy them together; larger ones are verified and
#: copied block by block (one pass over the bytes)
DIRECT_MAX = 1 << 20
MEMO_KEEP = 3  # layouts (and read views) kept per buffer: a few structures saved and restored in turn


def remember(memo: dict[Any, Any], key: Any, value: Any) -> None:
    """Keep ``value`` in a buffer's memo, dropping the oldest beyond :data:`MEMO_KEEP`."""
    memo[key] = value
    while len(memo) > MEMO_KEEP:
        del memo[next(iter(memo))]


def key_name(k: Any, prefix: str) -> str:
    """A state key as a name: strings as they are, ints (an optimizer's parameter ids) as their digits."""
    if isinstance(k, str):
        return k
    if isinstance(k, int) and not isinstance(k, bool):
        return str(k)
    raise ArgumentError(f"state keys must be strings or ints, got {k!r} under {prefix or 'the root'!r}")


def _copied(e: Entry) -> Entry:
    """A shallow copy of ``e`` (``copy.copy``'s result, without its generic machinery: a save copies every
    entry)."""
    out = object.__new__(Entry)
    out.__dict__.update(e.__dict__)
    return out


def describe(state: Mapping[str, Any], keys: bool = False) -> tuple[list[str], list[Any], list[Any]]:
    """The leaves of ``state``, depth first as :func:`tierfs.state.flatten` names them: their names, the
    values, and the structure (one hashable-free tuple per leaf: its kind, type, dtype and shape). ``keys``:
    check every key as a save must (:func:`tierfs.state.check_key`; a :class:`~tierfs.state.Flat` state's
    own keys are whole names)."""
    if not isinstance(state, Mapping):
        raise ArgumentError(f"state must be a mapping of names to arrays, got {type(state).__name__}")
    torch = sys.modules.get("torch")
    tensor = torch.Tensor if torch is not None else ()
    plain = (torch.Tensor, torch.nn.Parameter) if torch is not None else ()
    names: list[str] = []
    values: list[Any] = []
    sig: list[Any] = []

    flat = type(state) is st.Flat  # an adapter's names, '/' and all
    sep = st.SEP

    def walk(d: Mapping[str, Any], prefix: str, depth: int) -> None:
        st.check_depth(depth, prefix)
        for k, v in d.items():
            if type(k) is not str:
                k = key_name(k, prefix)
            elif keys and (not k or sep in k) and not (flat and d is state):
                st.check_key(k, prefix)
            if isinstance(v, tensor):
                names.append(prefix + k)
                values.append(v)
                # a plain tensor is copied as it is; subclasses (DTensor, ...) as tierfs.state reads them
                sig.append((TORCH if type(v) in plain else OTHER, type(v), v.dtype, v.shape))
            elif type(v) is np.ndarray:
                names.append(prefix + k)
                values.append(v)
                sig.append((NUMPY, v.dtype, v.shape))
            elif isinstance(v, Mapping):
                walk(v, prefix + k + st.SEP, depth + 1)
            else:
                names.append(prefix + k)
                values.append(v)
                if isinstance(v, (bytes, bytearray, memoryview)):
                    sig.append((OTHER, type(v), len(v)))
                elif isinstance(v, np.ndarray):  # a subclass
                    sig.append((OTHER, type(v), v.dtype, v.shape))
                else:
                    sig.append((JSON,))

    try:
        walk(state, "", 0)
    finally:
        del walk  # it refers to itself: a cycle that would hold the values until the garbage collector runs
    return names, values, sig


@dataclass
class ShardLayout:
    """A save's plan for one structure (see the module docstring). Made by :meth:`plan`."""

    names: list[str]
    signature: list[Any]
    kinds: list[int]
    entries: list[Entry]  # the manifest's entries, checksums and JSON values left out
    arrays: list[int]  # indices of the array leaves, in the order they are placed
    placement: list[tuple[str, int]]  # each array leaf's (file, offset)
    files: dict[str, int]
    json: list[int]  # indices of the leaves stored as JSON values
    sharing: Sharing | None = None  # what other ranks hold too (the same object for every save)
    bundles: list[dict[str, Any]] = field(default_factory=list)  # as the manifest stores them
    groups: list[list[int]] = field(default_factory=list)
    members: list[list[int]] = field(default_factory=list)  # each bundle's leaves, in order
    token: object = field(default_factory=object)  # names this layout in buffer memos
    checked: bool = False  # a manifest of it passed the reader's per-entry checks (the entries are the same)

    @classmethod
    def plan(cls, names: list[str], values: list[Any], signature: list[Any], rank: int, file_size: int,
             sharing: Sharing | Callable[[list[str], dict[int, int]], Sharing] | None = None) -> "ShardLayout":
        """Work out the layout of a new structure, checking every leaf as :func:`tierfs.state.to_leaf`
        does (a leaf it cannot store is an ArgumentError naming it). ``sharing``: the leaves other ranks
        hold too (:mod:`.dataparallel`), in files of their own."""
        if len(set(names)) != len(names):
            seen: set[str] = set()
            dup = next(n for n in names if n in seen or seen.add(n))  # type: ignore[func-returns-value]
            raise ArgumentError(f"state has two leaves named {dup!r} (e.g. keys 0 and '0', or 'a/b' beside "
                                "'a': {'b': ...}); rename one")
        for n in names:  # as a reader will check them (a step it cannot read is never committed)
            why = entry_name_problem(n)
            if why is not None:
                raise ArgumentError(f"state key {shown_name(n)} cannot be saved: {why}; rename it")
        kinds = [s[0] for s in signature]
        leaves = [st.to_leaf(n, v, data=False) for n, v in zip(names, values)]  # (a device tensor stays there)
        kinds = [JSON if lf.kind == "json" else k for k, lf in zip(kinds, leaves)]
        arrays = [i for i, lf in enumerate(leaves) if lf.kind == "array"]
        if callable(sharing):  # declared by the user: worked out from the leaves
            sharing = sharing(list(names), {i: leaves[i].nbytes for i in arrays})
        arrays, placement, files, bundles, groups, members = place(names, {i: leaves[i].nbytes for i in arrays}, arrays,
                                                          sharing, rank, file_size)
        where = dict(zip(arrays, placement))
        entries = []
        for i, lf in enumerate(leaves):
            if lf.kind == "json":
                entries.append(Entry(lf.name, "json"))
            else:
                f, o = where[i]
                entries.append(Entry(lf.name, "array", lf.lib, lf.dtype, list(lf.shape), f, o, lf.nbytes))
        return cls(list(names), list(signature), kinds, entries, arrays, placement, files,
                   [i for i, k in enumerate(kinds) if k == JSON], sharing, bundles, groups, members)

    def views(self, bufs: Mapping[str, np.ndarray], memos: Mapping[str, dict[Any, Any] | None]
              ) -> tuple[list[Any], list[np.ndarray]]:
        """For each array leaf: the view a copy writes through (a typed tensor or array over its bytes),
        and a uint8 view of its bytes (for checksums); from the buffers' memos when they have them."""
        dst: list[Any] = []
        raw: list[np.ndarray] = []
        by_file: dict[str, list[int]] = {}
        for j, (f, _) in enumerate(self.placement):
            by_file.setdefault(f, []).append(j)
        for f, js in by_file.items():  # files in placement order, entries in order within each
            # keyed by the file too: the pool may hand this buffer to another file of the layout next time
            memo = memos.get(f)
            got = memo.get((self.token, f)) if memo is not None else None
            if got is None:
                got = self._file_views(bufs[f], js)
                if memo is not None:
                    remember(memo, (self.token, f), got)
            dst += got[0]
            raw += got[1]
        return dst, raw

    def _file_views(self, buf: np.ndarray, js: list[int]) -> tuple[list[Any], list[np.ndarray]]:
        dst, raw = [], []
        for j in js:
            e = self.entries[self.arrays[j]]
            u8 = buf[e.offset:e.offset + e.length]
            raw.append(u8)
            kind = self.kinds[self.arrays[j]]
            if kind == TORCH and e.length:
                dst.append(st.view_as("torch", e.dtype, e.shape, u8))
            elif kind == NUMPY and e.length:
                dst.append(u8.view(np.dtype(e.dtype)).reshape(e.shape))
            else:
                dst.append(u8)
        return dst, raw

    def check_tensors(self, values: Sequence[Any], dcp: bool = False) -> None:
        """Raise ArgumentError naming the first tensor leaf of ``values`` that holds no values to copy (a meta
        or sparse tensor where this structure had a dense one), by the user's key (``dcp``: DCP's items)."""
        for i in self.arrays:
            if st.is_tensor(values[i]):
                st.check_tensor(self.names[i], values[i], user_key(self.names[i], dcp))

    def copy(self, values: Sequence[Any], dst: list[Any], step: int = 0, overlap: Any = None,
             buffers: Sequence[tuple[Any, np.ndarray]] = ()) -> Any:
        """Copy every array leaf of ``values`` (a state of this structure) into its view. CPU tensors and
        arrays are copied here; CUDA tensors (and with ``overlap``, a :class:`tierfs.device.copies.Overlap`, the CPU
        tensors it names) on the copy thread: their :class:`~tierfs.device.copies.Copies`, queued, is returned
        (None when there are none). ``buffers``: the mapped buffers and memos the views are of."""
        kinds = self.kinds
        tsrc, tdst, tj = [], [], []
        for j, i in enumerate(self.arrays):
            k, v, d = kinds[i], values[i], dst[j]
            if k == TORCH:
                if not isinstance(d, np.ndarray):  # (an empty tensor has a uint8 view: nothing to copy)
                    tsrc.append(v)
                    tdst.append(d)
                    tj.append(j)
            elif k == NUMPY:
                if v.size:
                    np.copyto(d, v)
            else:
                data = st.to_leaf(self.names[i], v).data
                assert data is not None
                np.copyto(d, data)
        copies = None
        if tdst and (overlap is not None or not all(t.is_cpu for t in tsrc)):  # (is_cpu: no device object made)
            copies, here = _device.plan(step, [self.names[i] for i in self.arrays], list(zip(tj, tsrc, tdst)),
                                        overlap, buffers)
            if copies is not None:
                keep = set(here)
                tsrc = [v for j, v in zip(tj, tsrc) if j in keep]
                tdst = [d for j, d in zip(tj, tdst) if j in keep]
        if tdst:
            torch = sys.modules["torch"]
            with torch.no_grad():
                if _hooks.active("block"):  # a test steps in between copies
                    for d, v in zip(tdst, tsrc):
                        _hooks.at("block", name="", nbytes=d.nbytes)
                        d.copy_(v)
                else:
                    torch._foreach_copy_(tdst, tsrc)
        if copies is not None:  # last: nothing after this may fail while they write into the buffers
            _device.start(copies, overlap.optimizers if overlap is not None else ())
        return copies

    def manifest(self, step: int, rank: int, world_size: int, block_size: int, values: Mapping[int, Any],
                 metadata: dict[str, Any], metrics: dict[str, Any]) -> Manifest:
        """The manifest of a save of this layout: its entries (fresh copies), the JSON leaves' ``values``
        (by leaf index) filled in."""
        entries = [_copied(e) for e in self.entries]
        for i, v in values.items():
            entries[i].value = v.item() if isinstance(v, np.generic) else v.value if type(v) is st.Trusted else v
        return Manifest(step, rank, world_size, entries, dict(self.files), block_size, metadata=metadata,
                        metrics=metrics, groups=copy.deepcopy(self.groups), bundles=copy.deepcopy(self.bundles))


class ReadViews:
    """What restores of one committed manifest reuse: the structure a target must have to take every
    entry as it is (then no entry needs checking), and typed views of the entries' bytes, kept in the
    memos of the tier's mapped files. Made once per parsed manifest (:meth:`of`)."""

    _cache: "OrderedDict[int, ReadViews]" = OrderedDict()
    _lock = threading.Lock()

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        torch = sys.modules.get("torch")
        self.expected: dict[str, Any] = {}
        self.by_name = {e.name: e for e in manifest.entries}
        self.names = frozenset(self.by_name)
        for e in manifest.entries:
            if e.kind != "array":
                continue
            if e.lib == "torch" and torch is not None and hasattr(torch, e.dtype):
                self.expected[e.name] = (TORCH, torch.Tensor, getattr(torch, e.dtype), tuple(e.shape))
            elif e.lib == "numpy":
                self.expected[e.name] = (NUMPY, np.dtype(e.dtype), tuple(e.shape))

    @classmethod
    def of(cls, manifest: Manifest) -> "ReadViews":
        with cls._lock:
            got = cls._cache.get(id(manifest))
            if got is None or got.manifest is not manifest:
                got = cls._cache[id(manifest)] = cls(manifest)
                while len(cls._cache) > 16:
                    cls._cache.popitem(last=False)
            return got

    def fits(self, names: Sequence[str], structure: Sequence[Any]) -> bool:
        """Whether every leaf of a target (as :func:`describe` reads it) that is an array entry of the
        manifest has exactly that entry's library, dtype and shape."""
        expected = self.expected
        for n, s in zip(names, structure):
            want = expected.get(n)
            if want is not None and want != s:
                return False
        return True

    def typed(self, e: Entry, buf: np.ndarray, memo: dict[Any, Any] | None) -> tuple[Any, np.ndarray]:
        """A typed (read-only) view of entry ``e``'s bytes in its file ``buf``, and a uint8 one; kept in
        ``memo``."""
        if memo is None:
            return _typed(e, buf)
        key = ("read", id(self.manifest))
        got = memo.get(key)
        if got is None or got[0] is not self.manifest:
            made: dict[str, Any] = {}
            got = (self.manifest, made)
            remember(memo, key, got)
        view = got[1].get(e.name)
        if view is None:
            view = got[1][e.name] = _typed(e, buf)
        return view


def _typed(e: Entry, buf: np.ndarray) -> tuple[Any, np.ndarray]:
    raw = buf[e.offset:e.offset + e.length]
    with warnings.catch_warnings():  # torch warns of read-only buffers; the view is only read
        warnings.simplefilter("ignore", UserWarning)
        return st.view_as(e.lib, e.dtype, e.shape, raw), raw


@dataclass
class Staged:
    """A step staged in the first tier, waiting for its checksums and commit."""

    layout: ShardLayout
    step: int
    values: dict[int, Any]  # the JSON leaves' values, by leaf index
    metadata: dict[str, Any]
    metrics: dict[str, Any]
    buffers: list[np.ndarray]  # the bytes of each array entry, in manifest order
    tiers: list[str] | None = None  # the tiers whose save policies took the step (in its marker)
    commit: str | None = None  # the save's id (in its marker and manifest)
    copies: Any = None  # the copies still running on the copy thread (tierfs.device.copies.Copies), or None

    def settle(self) -> None:
        """Wait for the copies into the buffers to end, failed or not, before the buffers go."""
        if self.copies is not None:
            self.copies.settle()

    def manifest(self, rank: int, world_size: int, block_size: int) -> Manifest:
        """The manifest (built off the caller's thread), without checksums."""
        m = self.layout.manifest(self.step, rank, world_size, block_size, self.values, self.metadata,
                                 self.metrics)
        m.commit = self.commit
        return m
