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

import logging
import re
from typing import Any, Mapping, Sequence

import numpy as np

from ..util import args as _args
from ..util.stages import describe, operation, stage
from ..errors import ArgumentError, TierfsError
from ..format import MARKER, Manifest, manifest_filename
from ..policies import LatestN, PreservationPolicy, SavePolicy
from ..ranks.agree import any_rank, views as rank_views
from . import _wire
from ._wire import Wire
from ._kept import KeptInRam
from .base import FailedCopy, Fetched, Pace, ReceiveInto, Tier
from .placement import Strategy, plan_fetch, replica_targets

log = logging.getLogger("tierfs")

_MANIFEST_RE = re.compile(r"rank_([0-9]{5})\.manifest\.json", re.ASCII)

__all__ = ["PeerTier", "Wire", "plan_fetch", "replica_targets"]


class PeerTier(KeptInRam):
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
        Groups a transfer is spread over where its bytes go over gloo (default 2): gloo moves a group's
        bytes between two ranks on one connection and one I/O thread, which cannot send and receive at the
        same time; two let a rank send its shard while it receives another's. Where the ranks have tierfs's
        own streams (the default) the bytes and the collectives go over those instead, and the tier holds no
        gloo group.
    node_rank:
        This process's node number, overriding ``TIERFS_NODE_RANK`` / torchrun's ``GROUP_RANK``.
    name:
        Label in listings (default ``"peer"``).
    wire:
        Message sizes of a transfer (:class:`Wire`, ``tierfs.tiers.peer.Wire``: bytes per message, of the first
        message, the longest header accepted); the defaults suit every job, tests shrink them. The first
        message's size must be the same on every rank.
    """

    kind = "peer"

    def __init__(self, replicas: int = 1, strategy: Strategy = "ring", *, save: SavePolicy | None = None,
                 keep: PreservationPolicy | None = None, backend: str = "gloo", connections: int = 2,
                 node_rank: int | None = None, name: str = "peer", wire: Wire | None = None) -> None:
        super().__init__(name, save, keep if keep is not None else LatestN(1))
        self._follow_ram = save is None
        _args.integer(replicas, "replicas")
        if not callable(strategy) and strategy not in ("ring", "pairwise"):
            raise ArgumentError(f"strategy must be 'ring', 'pairwise' or a function, got {_args.shown(strategy)}")
        _args.integer(connections, "connections")
        _args.optional_integer(node_rank, "node_rank", minimum=0)
        _args.name(backend, "backend")
        if wire is not None:
            _args.instance(wire, "wire", Wire, "a Wire (tierfs.tiers.peer.Wire) or None")
        self.replicas, self.strategy, self.backend, self.connections = replicas, strategy, backend, connections
        self.wire = wire if wire is not None else Wire()
        self._node_rank = node_rank
        self.targets: list[list[int]] = []
        self.nodes: list[int] = []
        self.sources: list[list[int]] = []

    # -- binding ------------------------------------------------------------------------------------
    def bind(self, first: Tier, group: Any) -> None:
        """Keep replicas in ``first``'s directory (the RAM tier) and exchange them among ``group``'s ranks
        (collective)."""
        if group.world_size < 2:
            raise TierfsError("PeerTier needs a job of several processes on several nodes (torchrun with "
                              "torch.distributed initialised); this process is alone")
        # each connection is a group every rank must create; the first message's size must match; node_rank
        # given on every rank or on none (else the ranks would take part in different collectives next)
        views = rank_views(group, [self.connections, self.wire.first, int(self._node_rank is not None)])
        for k, what in enumerate(("connections", "wire first message size", "node_rank given")):
            if len({v[k] for v in views}) > 1:
                raise TierfsError(f"ranks disagree on PeerTier {what}: {[v[k] for v in views]}; give every "
                                  "rank the same value")
        nodes = group.nodes if self._node_rank is None else tuple(group.all_gather(int(self._node_rank)))
        self.nodes = [int(n) for n in nodes]
        self.targets = replica_targets(nodes, self.replicas, self.strategy)
        self.sources = [[s for s in range(len(nodes)) if r in self.targets[s]] for r in range(len(nodes))]
        self.rank = group.rank
        if self._follow_ram:
            self.save_policy = first.save_policy
        self.keep_beside(first, group, "peers")

    # -- the replicas this rank keeps ---------------------------------------------------------------
    def drop(self, step: int, rank: int) -> None:
        log.warning("%s step %d: dropping the copy of rank %d's shard kept here (its receiver could not use it)",
                    self.name, step, rank)
        self.local.release(step, rank, marker=False)
        if not self.holdings().get(step):  # no copy of the step left here
            self.local.delete_step(step)

    def holdings(self) -> dict[int, list[int]]:
        """``{step: [ranks whose shard this rank keeps]}`` for every committed step."""
        out = {}
        for s in self.local.committed_steps():
            try:
                names = self.local.file_sizes(s)
            except FileNotFoundError:
                continue
            out[s] = sorted(int(m.group(1)) for m in map(_MANIFEST_RE.fullmatch, names) if m)
        return out

    # -- moving shards ------------------------------------------------------------------------------
    def replicate(self, step: int, marker: bytes, manifest: bytes, files: Mapping[str, Any], *,
                  pairs: Sequence[tuple[int, int]] | None = None, pace: Pace | None = None,
                  role: str = "copy", error: str | None = None) -> list[FailedCopy]:
        """Send this rank's shard of ``step`` to its targets and keep the shards sent to it (collective).

        ``pairs`` are ``(source rank, receiving rank)``, the same on every rank (default: every rank to
        each of its targets). A rank that cannot read its own shard passes ``error`` (and empty bytes) and
        still takes part; its receivers refuse. Returns the failed pairs with reasons, the same on every
        rank; when there are none the receivers have committed their copies, otherwise they dropped what
        they received.
        """
        g = self._group(role)
        me = g.rank
        reseed = pairs is not None  # the only caller that names the pairs: a restore re-seeding peers
        pairs = [(s, t) for s in range(g.world_size) for t in self.targets[s]] if pairs is None else list(pairs)
        header = _wire.header(step, me, manifest, marker, files, error=error, limit=self.wire.max_header)
        sends: list[_wire.Send] = [(t, header, files, None) for s, t in pairs if s == me]
        incoming = [s for s, t in pairs if t == me]
        received: dict[int, bytes] = {}
        # (a re-seed may bring one copy into a step this rank holds committed with others': they stay)
        had = bool(incoming) and self.local.list_steps().get(step) is True

        def accept(src: int, h: dict[str, Any]) -> tuple[Manifest, dict[str, np.ndarray], _wire.Direct]:
            m, mbytes, _ = _wire.check_header(h, step, src)
            kept = m.replica_files  # what no other node holds (check_header checked the sender offers it)
            bufs = self.local.buffers(step, kept)  # CapacityError when the RAM budget has no room
            received[src] = mbytes
            return m, {n: bufs[n] for n in kept}, {}  # in the order the sender sends them

        wrote_marker, agreed, failed = False, False, []
        # one operation: its waits share one deadline, and name it where no stage is current
        with operation(describe("reseed" if reseed else "replication", step, self.name)), g.bounded():
            try:
                errors = _wire.transfer(g, sends, incoming, accept, pace, self.wire)
                self.local.persist(step)  # the bytes are in the mapped files already
                for s in incoming:  # manifests now; the marker only once every copy of the job is in place
                    if errors[s] is None:
                        try:
                            self.local.write_file(step, manifest_filename(s), received[s])
                        except (TierfsError, OSError) as e:
                            errors[s] = f"{type(e).__name__}: {e}"
                failed = self._agree_pairs(g, errors)
                if not failed:  # second round: a receiver whose marker fails undoes the step everywhere
                    why = None
                    if incoming:
                        try:
                            self.local.write_marker(step, marker)
                            wrote_marker = True
                        except (TierfsError, OSError) as e:
                            why = f"marker: {type(e).__name__}: {e}"
                    failed = self._agree_pairs(g, {incoming[0]: why} if incoming else {})
                agreed = True
            finally:  # not replicated, or a rank lost on the way (raised): nothing received here is kept
                if incoming and (failed or not agreed):
                    self._drop_received(step, incoming, wrote_marker and not had)
        return failed

    def _drop_received(self, step: int, incoming: Sequence[int], marker: bool) -> None:
        try:
            self.local.discard(step)
            for s in incoming:
                self.local.release(step, s, marker=marker)
        except Exception as e:  # noqa: BLE001 - the step is not replicated either way; this is logged
            log.warning("%s step %d: could not take back the copies received (%s)", self.name, step, e)

    @staticmethod
    def _agree_pairs(g: Any, errors: Mapping[int, str | None]) -> list[FailedCopy]:
        """Every rank's failed incoming copies, ``(source, receiver, reason)``, the same on every rank."""
        mine = [(s, g.rank, why) for s, why in errors.items() if why]
        if not any_rank(g, bool(mine)):  # the usual case: one number per rank
            return []
        return [(int(s), int(t), str(why)) for part in g.all_gather(mine) for s, t, why in part]

    def fetch(self, step: int, assign: Mapping[int, int], role: str = "main",
              landing: ReceiveInto | None = None) -> Fetched | str | None:
        """Move shards of ``step`` from holders to the ranks that lack them (collective).

        ``assign`` is ``{rank: holder}``, the same on every rank. A holder sends what it keeps (or says
        why it cannot); the receiver checks the manifest against the marker and every block as it lands.
        ``landing(manifest)`` (the receiver's) names arrays that entries land in straight, ``{entry name:
        uint8 array of its length}``; their bytes never reach the returned files. Returns, on a receiving
        rank, ``(manifest, manifest bytes, marker bytes, files)`` or the reason it failed; None on other ranks.
        """
        g = self._group(role)
        with operation(describe("fetch", step, self.name)), g.bounded():  # one deadline; waits say "fetch"
            return self._fetch(g, step, assign, landing)

    def _fetch(self, g: Any, step: int, assign: Mapping[int, int], landing: ReceiveInto | None) -> Fetched | str | None:
        me = g.rank
        sends: list[_wire.Send] = []
        for q, h in sorted(assign.items()):
            if h != me:
                continue
            try:
                with stage("fetch", step, self.name):  # this holder's copy of rank q's shard
                    marker = bytes(self.local.read_file(step, MARKER))
                    mbytes = bytes(self.local.read_file(step, manifest_filename(q)))
                    m = Manifest.from_bytes(mbytes)
                    files = self.local.read_files(step, list(m.replica_files))
                sends.append((q, _wire.header(step, q, mbytes, marker, files, limit=self.wire.max_header), files, m))
            except (TierfsError, OSError, ValueError) as e:  # its copy bad, or no memory or descriptor left now
                why = _wire.unsendable(e)
                sends.append((q, _wire.header(step, q, b"", b"", {}, error=why, limit=self.wire.max_header), {},
                              None))
        got: dict[str, Any] = {}

        def accept(src: int, h: dict[str, Any]) -> tuple[Manifest, dict[str, np.ndarray], _wire.Direct]:
            with stage("receive", step, self.name):  # this rank's shard, from rank ``src``
                m, mbytes, marker = _wire.check_header(h, step, me)
                # the receive buffers' pages are touched only where no entry lands straight in its array
                got.update(manifest=m, mbytes=mbytes, marker=marker,
                           files={n: np.empty(size, dtype=np.uint8) for n, size in m.replica_files.items()})
                return m, got["files"], _wire.direct(m, landing(m) if landing is not None else {}, got["files"])

        incoming = [h for q, h in assign.items() if q == me]
        errors = _wire.transfer(g, sends, incoming, accept, None, self.wire, land=True)
        g.barrier()  # a rank lost on the way fails the fetch here, on every rank, naming it
        if not incoming:
            return None
        failed = errors[incoming[0]]
        if failed:
            return failed
        return got["manifest"], got["mbytes"], got["marker"], got["files"]
