"""The peer tier: copies of every rank's shard in the RAM of ranks on other nodes.

After a step commits in the RAM tier, the store calls ``replicate`` on every rank at once: each rank
sends its shard to its ``replicas`` targets on other nodes and receives the shards it keeps for others,
point to point over a torch.distributed group of tierfs's own (gloo by default, so it never queues
behind the training job's NCCL work). A receiver checks every block against the manifest as the bytes
land. A step counts as replicated only when *every* pair of the job has verified its copy; only then do
receivers write their marker, so retention never drops the newest fully replicated step for one that is
not.

Replicas live inside the RAM tier's directory (``<ram>/peers/rank_<r>/step_<n>/``, the usual format), so
they vanish with the node and the RAM tier's budget counts them. A receiver without room refuses: the
step is not replicated (a warning), training goes on, and peers keep the previous step.

On restore the store asks each rank what it ``holds``, picks a holder for every missing shard with
``plan_fetch`` (spreading the load) and moves them with ``fetch``.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Mapping, Sequence, Union

import numpy as np

from .. import _copy
from .._worker import BACKGROUND_NICE
from ..dist import framed
from ..errors import ChecksumError, FormatError, TierfsError
from ..format import MARKER, Manifest, Marker, blocks, crc32c, manifest_filename, validate_filename
from ..policies import LatestN, PreservationPolicy, SavePolicy
from .base import Capacity, Tier
from .memory import MemoryTier, make_private_dir

#: ``strategy(rank, nodes, replicas) -> target ranks``; ``nodes[r]`` is the node number of rank ``r``
StrategyFn = Callable[[int, Sequence[int], int], Sequence[int]]
Strategy = Union[str, StrategyFn]

_MANIFEST_RE = re.compile(r"^rank_(\d{5})\.manifest\.json$")
_MAX_HEADER = 1 << 30
#: bytes of a transfer's first message: a header's length and the header itself when it fits (the header
#: holds the shard's manifest, about 250 bytes per tensor, and the marker, about 40 bytes per rank of the
#: job), so such transfers need one round before the files instead of three
_FIRST = 64 << 10
#: bytes per message: small enough that each is checksummed while still in cache as the next ones land,
#: large enough that per-message costs stay small (2-16 MiB measure alike on loopback; 8 is in the middle)
CHUNK = 8 << 20


def replica_targets(nodes: Sequence[int], replicas: int, strategy: Strategy = "ring") -> list[list[int]]:
    """For every rank, the ranks (on other nodes) that keep copies of its shard.

    ``"ring"``: nodes in order of their number; a rank sends to the rank with the same local index on
    each of the next ``replicas`` nodes. ``"pairwise"``: nodes form groups of ``replicas + 1`` (the last
    group takes any remainder, so odd node counts work), and the ring runs inside each group: with
    ``replicas=1`` nodes 0<->1, 2<->3, ... A callable ``strategy(rank, nodes, replicas)`` returns the
    target ranks itself.
    """
    order = sorted(set(nodes))
    members = {n: [r for r, x in enumerate(nodes) if x == n] for n in order}
    if len(order) < 2:
        raise TierfsError("the peer tier needs ranks on at least 2 nodes, but every rank is on one node; "
                          "run on more nodes or set TIERFS_NODE_RANK per node")
    if not isinstance(replicas, int) or not 1 <= replicas <= len(order) - 1:
        raise TierfsError(f"replicas={replicas!r} needs at least {replicas + 1 if isinstance(replicas, int) else 2} "
                          f"nodes; this job has {len(order)}")
    if callable(strategy):
        out = []
        for r in range(len(nodes)):
            ts = [int(t) for t in strategy(r, list(nodes), replicas)]
            bad = [t for t in ts if not 0 <= t < len(nodes) or nodes[t] == nodes[r]]
            if bad or len(set(ts)) != replicas:
                raise TierfsError(f"peer strategy gave rank {r} targets {ts}: need {replicas} distinct ranks "
                                  "on other nodes")
            out.append(ts)
        return out
    if strategy == "ring":
        rings = [order]
    elif strategy == "pairwise":
        g = replicas + 1
        rings = [order[i:i + g] for i in range(0, len(order) - len(order) % g, g)]
        rings[-1] = rings[-1] + order[len(order) - len(order) % g:]
    else:
        raise TierfsError(f"unknown peer strategy {strategy!r}; use 'ring', 'pairwise' or a function")
    out = [[] for _ in nodes]
    for ring in rings:
        for p, node in enumerate(ring):
            for i, r in enumerate(members[node]):
                for k in range(1, replicas + 1):
                    dst = members[ring[(p + k) % len(ring)]]
                    out[r].append(dst[i % len(dst)])
    return out


def plan_fetch(wanted: Mapping[int, Sequence[int]], sizes: Mapping[int, int] | None = None) -> dict[int, int]:
    """Pick one holder per wanted shard, ``{rank: [holder ranks]} -> {rank: holder}``.

    Largest shards first, each to the holder with the fewest bytes assigned so far (ties: lowest rank),
    so that when several peers hold copies the load is spread across them. Deterministic: every rank
    computes the same plan.
    """
    load: dict[int, int] = {}
    plan = {}
    size = (lambda r: sizes.get(r, 1)) if sizes else (lambda r: 1)  # noqa: E731
    for r in sorted(wanted, key=lambda r: (-size(r), r)):
        holders = sorted(set(wanted[r]))
        if holders:
            h = min(holders, key=lambda h: (load.get(h, 0), h))
            plan[r] = h
            load[h] = load.get(h, 0) + size(r)
    return plan


class _Replicas(MemoryTier):
    """The directory of replicas this rank keeps; it shares the RAM tier's budget."""

    def __init__(self, path, ram: MemoryTier, name: str) -> None:
        super().__init__(path, name=name)
        self._ram = ram

    def capacity(self) -> Capacity:
        return self._ram.capacity()  # counts this directory too: it lies inside the RAM tier's


class PeerTier(Tier):
    """Copies of each rank's shard in the RAM of ``replicas`` ranks on other nodes.

    Place it after the RAM tier: ``TieredStore([MemoryTier(...), PeerTier(replicas=1), ObjectTier(url)])``.
    The store binds it to the RAM tier and the job's ranks when it opens.

    Parameters
    ----------
    replicas:
        Copies of each shard, each on a different other node (needs ``replicas + 1`` nodes).
    strategy:
        ``"ring"``, ``"pairwise"`` or ``strategy(rank, nodes, replicas) -> target ranks`` (see
        :func:`replica_targets`).
    save, keep:
        Policies. By default the peer tier shares the RAM tier's save policy (every step saved to RAM is
        replicated) and keeps the newest fully replicated step.
    backend:
        torch.distributed backend of the groups tierfs creates for replication (default ``"gloo"``).
    connections:
        Groups a transfer is spread over (default 2). gloo moves a group's bytes between two ranks on one
        connection and one I/O thread, which cannot send and receive at the same time; two let a rank send
        its shard while it receives another's.
    node_rank:
        This process's node number, overriding ``TIERFS_NODE_RANK`` / torchrun's ``GROUP_RANK``.
    name:
        Label in listings (default ``"peer"``).
    """

    kind = "peer"

    def __init__(self, replicas: int = 1, strategy: Strategy = "ring", *, save: SavePolicy | None = None,
                 keep: PreservationPolicy | None = None, backend: str = "gloo", connections: int = 2,
                 node_rank: int | None = None, name: str = "peer") -> None:
        super().__init__(name, save, keep if keep is not None else LatestN(1))
        self._follow_ram = save is None
        if not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
        if not callable(strategy) and strategy not in ("ring", "pairwise"):
            raise ValueError(f"strategy must be 'ring', 'pairwise' or a function, got {strategy!r}")
        if not isinstance(connections, int) or connections < 1:
            raise ValueError(f"connections must be an int >= 1, got {connections!r}")
        self.replicas, self.strategy, self.backend, self.connections = replicas, strategy, backend, connections
        self._node_rank = node_rank
        self._local: _Replicas | None = None
        self.targets: list[list[int]] = []
        self.sources: list[list[int]] = []

    # -- binding ------------------------------------------------------------------------------------
    def bind(self, ram: Tier, group: Any) -> None:
        """Keep replicas in ``ram``'s directory and exchange them among ``group``'s ranks (collective)."""
        if not isinstance(ram, MemoryTier):
            raise TierfsError("PeerTier keeps replicas in the RAM tier: put a MemoryTier first, e.g. "
                              "TieredStore([MemoryTier(path), PeerTier(), ObjectTier(url)])")
        if group.world_size < 2:
            raise TierfsError("PeerTier needs a job of several processes on several nodes (torchrun with "
                              "torch.distributed initialised); this process is alone")
        nodes = group.nodes if self._node_rank is None else tuple(group.all_gather(int(self._node_rank)))
        connections = group.all_gather(self.connections)  # each is a group every rank must create
        if len(set(connections)) > 1:
            raise TierfsError(f"ranks disagree on PeerTier(connections=...): {connections}; give every rank "
                              "the same value")
        self.targets = replica_targets(nodes, self.replicas, self.strategy)
        self.sources = [[s for s in range(len(nodes)) if r in self.targets[s]] for r in range(len(nodes))]
        self.rank = group.rank
        if self._follow_ram:
            self.save_policy = ram.save_policy
        self._local = _Replicas(ram.path / "peers" / f"rank_{group.rank:05d}", ram, self.name)
        # replication runs in a background worker: its transfer threads give way to training too
        self._groups = {"copy": group.fork(self.backend, nice=BACKGROUND_NICE, lanes=self.connections)}
        self._bound = group

    def _group(self, role: str) -> Any:
        """The groups of a thread role: "copy" (the replicating worker) or "main" (restores). A restore's
        are made when one first fetches from or re-seeds peers: every idle gloo group's I/O threads cost
        about 1.5 ms of CPU per second, and most jobs never need them. Making them is collective, like the
        restore (on every rank, on the thread that restores; only that thread ever makes them)."""
        if role not in ("copy", "main"):
            raise ValueError(f"unknown role {role!r}: 'copy' or 'main'")
        if role not in self._groups:
            self._groups[role] = self._bound.fork(self.backend, lanes=self.connections)
        return self._groups[role]

    @property
    def local(self) -> MemoryTier:
        if self._local is None:
            raise TierfsError("PeerTier is used only through a TieredStore, which binds it to the RAM tier")
        return self._local

    # -- capabilities -------------------------------------------------------------------------------
    @property
    def is_local(self) -> bool:
        return True

    @property
    def is_peer(self) -> bool:
        return True

    def capacity(self) -> Capacity:
        return self.local.capacity()

    # -- the primitives act on the replicas this rank keeps -----------------------------------------
    def open(self) -> None:
        make_private_dir(self.local.path.parent)
        self.local.open()

    def close(self) -> None:
        if self._local is not None:
            self._local.close()

    def list_steps(self) -> dict[int, bool]:
        return self.local.list_steps()

    def file_sizes(self, step: int) -> dict[str, int]:
        return self.local.file_sizes(step)

    def write_file(self, step: int, name: str, data) -> None:
        self.local.write_file(step, name, data)

    def read_file(self, step: int, name: str):
        return self.local.read_file(step, name)

    def read_range(self, step: int, name: str, start: int, end: int) -> bytes:
        return self.local.read_range(step, name, start, end)

    def write_marker(self, step: int, data: bytes) -> None:
        self.local.write_marker(step, data)

    def delete_step(self, step: int) -> None:
        self.local.delete_step(step)

    def holdings(self) -> dict[int, list[int]]:
        """``{step: [ranks whose shard this rank keeps]}`` for every committed step."""
        out = {}
        for s in self.local.committed_steps():
            try:
                names = self.local.file_sizes(s)
            except FileNotFoundError:
                continue
            out[s] = sorted(int(m.group(1)) for m in map(_MANIFEST_RE.match, names) if m)
        return out

    # -- moving shards ------------------------------------------------------------------------------
    def replicate(self, step: int, marker: bytes, manifest: bytes, files: Mapping[str, Any],
                  pairs: Sequence[tuple[int, int]] | None = None, pace: Callable[[int], None] | None = None,
                  role: str = "copy", error: str | None = None) -> list[tuple[int, int, str]]:
        """Send this rank's shard of ``step`` to its targets and keep the shards sent to it (collective).

        ``pairs`` are ``(source rank, receiving rank)``, the same on every rank (default: every rank to
        each of its targets). A rank that cannot read its own shard passes ``error`` (and empty bytes) and
        still takes part; its receivers refuse. Returns the failed pairs with reasons, the same on every
        rank; when there are none the receivers have committed their copies, otherwise they dropped what
        they received.
        """
        g = self._group(role)
        me = g.rank
        pairs = [(s, t) for s in range(g.world_size) for t in self.targets[s]] if pairs is None else list(pairs)
        header = _header(step, me, manifest, marker, files, error=error)
        sends = [(t, header, files) for s, t in pairs if s == me]
        incoming = [s for s, t in pairs if t == me]
        received: dict[int, bytes] = {}

        def accept(src: int, h: dict) -> tuple[Manifest, dict[str, np.ndarray]]:
            m, mbytes, _ = _check_header(h, step, src)
            bufs = self.local.stage(step, m.files)  # CapacityError when the RAM budget has no room
            received[src] = mbytes
            return m, {n: bufs[n] for n in m.files}  # in the order the sender sends them

        errors = _transfer(g, sends, incoming, accept, pace)
        self.local.discard_staged(step)  # the bytes are in the mapped files already
        for s in incoming:  # manifests now; the marker only once every copy of the job is in place
            if errors[s] is None:
                try:
                    self.local.write_file(step, manifest_filename(s), received[s])
                except (TierfsError, OSError) as e:
                    errors[s] = f"{type(e).__name__}: {e}"
        failed = self._agree_pairs(g, errors)
        wrote_marker = False
        if not failed:  # second round: a receiver whose marker fails undoes the step everywhere
            why = None
            if incoming:
                try:
                    self.local.write_marker(step, marker)
                    wrote_marker = True
                except (TierfsError, OSError) as e:
                    why = f"marker: {type(e).__name__}: {e}"
            failed = self._agree_pairs(g, {incoming[0]: why} if incoming else {})
        if failed:
            for s in incoming:
                self.local.release(step, s, marker=wrote_marker)
        return failed

    @staticmethod
    def _agree_pairs(g: Any, errors: Mapping[int, str | None]) -> list[tuple[int, int, str]]:
        """Every rank's failed incoming copies, ``(source, receiver, reason)``, the same on every rank."""
        mine = [(s, g.rank, why) for s, why in errors.items() if why]
        return [tuple(f) for part in g.all_gather(mine) for f in part]  # type: ignore[misc]

    def fetch(self, step: int, assign: Mapping[int, int], role: str = "main"
              ) -> tuple[Manifest, bytes, bytes, dict[str, np.ndarray]] | str | None:
        """Move shards of ``step`` from holders to the ranks that lack them (collective).

        ``assign`` is ``{rank: holder}``, the same on every rank. A holder sends what it keeps (or says
        why it cannot); the receiver checks the manifest against the marker and every block as it lands.
        Returns, on a receiving rank, ``(manifest, manifest bytes, marker bytes, files)`` or the reason it
        failed; None on other ranks.
        """
        g = self._group(role)
        me = g.rank
        sends = []
        for q, h in sorted(assign.items()):
            if h != me:
                continue
            try:
                marker = bytes(self.local.read_file(step, MARKER))
                mbytes = bytes(self.local.read_file(step, manifest_filename(q)))
                files = self.local.read_files(step, list(Manifest.from_bytes(mbytes).files))
                sends.append((q, _header(step, q, mbytes, marker, files), files))
            except (TierfsError, OSError, ValueError) as e:
                sends.append((q, _header(step, q, b"", b"", {}, error=f"{type(e).__name__}: {e}"), {}))
        got: dict[str, Any] = {}

        def accept(src: int, h: dict) -> tuple[Manifest, dict[str, np.ndarray]]:
            m, mbytes, marker = _check_header(h, step, me)
            got.update(manifest=m, mbytes=mbytes, marker=marker,
                       files={n: np.empty(size, dtype=np.uint8) for n, size in m.files.items()})
            return m, got["files"]

        incoming = [h for q, h in assign.items() if q == me]
        errors = _transfer(g, sends, incoming, accept, None)
        if not incoming:
            return None
        why = errors[incoming[0]]
        return why if why else (got["manifest"], got["mbytes"], got["marker"], got["files"])


def _header(step: int, rank: int, manifest: bytes, marker: bytes, files: Mapping[str, Any],
            error: str | None = None) -> bytes:
    h = {"step": step, "rank": rank, "manifest": manifest.decode("latin-1"), "marker": marker.decode("latin-1"),
         "error": error, "files": [[n, memoryview(f).nbytes] for n, f in files.items()]}
    raw = json.dumps(h).encode()
    if len(raw) > _MAX_HEADER:  # the receiver would refuse it: say why instead
        why = f"its header is {len(raw)} bytes, over {_MAX_HEADER}" + (f" ({error})" if error else "")
        raw = json.dumps(h | {"manifest": "", "marker": "", "files": [], "error": why}).encode()
    return raw


def _check_header(h: dict, step: int, rank: int) -> tuple[Manifest, bytes, bytes]:
    """The manifest a peer announced for ``rank``'s shard of ``step``, checked against its marker."""
    if h.get("error"):
        raise TierfsError(f"the holder cannot send it ({h['error']})")
    mbytes, marker_bytes = h["manifest"].encode("latin-1"), h["marker"].encode("latin-1")
    marker = Marker.from_bytes(marker_bytes)
    mname = manifest_filename(rank)
    if h["step"] != step or h["rank"] != rank or marker.step != step or mname not in marker.manifests:
        raise FormatError(f"a peer offered step {h['step']} rank {h['rank']} for step {step} rank {rank}")
    if crc32c(mbytes) != marker.manifests[mname]:
        raise FormatError(f"the manifest of rank {rank} step {step} does not match its commit marker")
    m = Manifest.from_bytes(mbytes)
    announced = {validate_filename(n): size for n, size in h["files"]}
    if m.step != step or m.rank != rank or announced != m.files or list(announced) != list(m.files):
        raise FormatError(f"a peer's files for rank {rank} step {step} do not match the manifest")
    if not all(n.startswith(f"rank_{rank:05d}.") for n in announced) or not 0 <= rank < marker.world_size:
        raise FormatError(f"a peer's files for rank {rank} step {step} are named for another rank")
    return m, mbytes, marker_bytes


def _transfer(g: Any, sends: Sequence[tuple[int, bytes, Mapping[str, Any]]], incoming: Sequence[int],
              accept: Callable[[int, dict], tuple[Manifest, dict[str, np.ndarray]]],
              pace: Callable[[int], None] | None) -> dict[int, str | None]:
    """One round of shard moves between ranks: headers, accept/refuse, then the files, every block checked
    as it lands. A header goes in a first message of ``_FIRST`` bytes with its length; the rest of a longer
    one follows only once its receiver agreed to its length (one out of range is refused before the rest
    is sent). ``sends`` are ``(to rank, header, files)``; returns ``{source: error or None}``."""
    room = _FIRST - 8
    first_in = [(s, np.zeros(_FIRST, dtype=np.uint8)) for s in incoming]
    g.exchange([(t, framed(h, _FIRST)) for t, h, _ in sends], first_in)
    lengths = {s: int(b[:8].view(np.int64)[0]) for s, b in first_in}
    errors: dict[int, str | None] = {
        s: f"TierfsError: rank {s} announced a header of {n} bytes; do all ranks run the same tierfs version?"
        for s, n in lengths.items() if not 0 < n <= _MAX_HEADER}
    long_out = [(t, h) for t, h, _ in sends if len(h) > room]
    long_in = [s for s in incoming if lengths[s] > room]
    rest_in: dict[int, np.ndarray] = {}
    if long_out or long_in:  # only the pairs with a long header take these two rounds
        for s in long_in:
            if s not in errors:
                try:  # before saying yes: a sender told to go must find its receive posted
                    rest_in[s] = np.empty(lengths[s] - room, dtype=np.uint8)
                except MemoryError:
                    errors[s] = f"MemoryError: no memory for the {lengths[s]}-byte header of rank {s}"
        go_in = [(t, np.zeros(1, dtype=np.uint8)) for t, _ in long_out]
        g.exchange([(s, np.array([s in rest_in], dtype=np.uint8)) for s in long_in], go_in)
        g.exchange([(t, np.frombuffer(h, dtype=np.uint8, offset=room)) for (t, h), (_, go) in zip(long_out, go_in)
                    if go[0]], list(rest_in.items()))
    bufs: dict[int, dict[str, np.ndarray]] = {}
    manifests: dict[int, Manifest] = {}
    for s, first in first_in:
        if errors.get(s):
            continue
        try:
            raw = first[8:8 + min(lengths[s], room)].tobytes() + (rest_in[s].tobytes() if s in rest_in else b"")
            h = json.loads(raw)
            manifests[s], bufs[s] = accept(s, h)
            errors[s] = None
        except Exception as e:  # noqa: BLE001 - between rounds: the sender hears of it in the next one
            errors[s] = f"{type(e).__name__}: {e}"
    ok_out = [(s, np.array([errors[s] is None], dtype=np.uint8)) for s in incoming]
    ok_in = [(t, np.zeros(1, dtype=np.uint8)) for t, _, _ in sends]
    g.exchange(ok_out, ok_in)
    data_out = [(t, chunk) for (t, _, files), (_, ok) in zip(sends, ok_in) if ok[0]
                for f in files.values() for chunk in _chunks(_copy.as_u8(f))]
    checks = {(s, name): _FileCheck(manifests[s], name) for s in incoming if errors[s] is None for name in bufs[s]}
    data_in = [(s, name, buf, i) for s in incoming if errors[s] is None for name, buf in bufs[s].items()
               for i, _ in enumerate(_chunks(buf))]

    def landed(k: int) -> None:
        s, name, buf, i = data_in[k]
        if errors[s] is None:
            try:
                checks[s, name].feed(buf, i * CHUNK, min(buf.size, (i + 1) * CHUNK))
            except TierfsError as e:
                errors[s] = f"{type(e).__name__}: {e}"

    g.exchange(data_out, [(s, chunk) for s in incoming if errors[s] is None for buf in bufs[s].values()
                          for chunk in _chunks(buf)], pace=pace, on_received=landed)
    for (s, name), check in checks.items():  # blocks no chunk reached (empty files)
        if errors[s] is None:
            try:
                check.feed(bufs[s][name], bufs[s][name].size, bufs[s][name].size)
            except TierfsError as e:
                errors[s] = f"{type(e).__name__}: {e}"
    return errors


def _chunks(buf: np.ndarray) -> list[np.ndarray]:
    return [buf[i:i + CHUNK] for i in range(0, buf.size, CHUNK)]


class _FileCheck:
    """Checks one shard file's blocks as its chunks land, in order, each chunk while it is in cache."""

    def __init__(self, manifest: Manifest, name: str) -> None:
        self.name = name
        self.blocks = sorted((e.offset + a, e.offset + b, e.crc32c[k], e.name) for e in manifest.entries
                             if e.kind == "array" and e.file == name
                             for k, (a, b) in enumerate(blocks(e.length, manifest.block_size)))
        self.next, self.crc = 0, 0

    def feed(self, buf: np.ndarray, start: int, end: int) -> None:
        """Bytes ``start:end`` of the file have landed (every byte before them already has)."""
        while self.next < len(self.blocks):
            lo, hi, want, entry = self.blocks[self.next]
            if lo >= end and not (lo == hi == end):
                return
            if max(lo, start) < min(hi, end):
                self.crc = crc32c(buf[max(lo, start):min(hi, end)], self.crc)
            if hi > end:
                return
            if self.crc != want:
                raise ChecksumError(f"checksum mismatch in {entry!r} ({self.name} bytes {lo}-{hi}): stored "
                                    f"{want:#010x}, received {self.crc:#010x}")
            self.next, self.crc = self.next + 1, 0
