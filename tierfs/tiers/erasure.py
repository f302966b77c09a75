"""The erasure-coded peer tier: a lost node's shard rebuilt from its group's other shards and parity.

A replica costs a whole shard of RAM on another node; parity costs ``parity/data`` of one. Ranks form
groups of ``data + parity`` members, each on a node of its own (:func:`~tierfs.tiers._stripes.ec_groups`),
and every step's payloads are cut into stripes (:class:`~tierfs.tiers._stripes.Stripes`): each member
keeps ``parity`` pieces of ``chunk = payload/data`` bytes, computed from the chunks the other members send
it, block by block (:data:`~tierfs.tiers._stripes.BLOCK` bytes, each checked by its receiver against the
crc32c its sender appended) so that the working buffers stay a few blocks per stripe. A step counts as
saved only once every parity piece of the job is computed from verified blocks; then every member writes
its marker, as the peer tier does.

A member keeps beside its parity the stripes record (payload lengths, each parity block's crc32c) and the
manifests of its group, so a member that lost its RAM gets its shard back, each chunk block by block: with
``parity=1`` the stripe's parity holder XORs the survivors' chunks into its parity block (checked against
its crc first) and sends the result, so the lost member takes in its shard's bytes once; with more,
``data`` of the surviving pieces come to it and it decodes its chunk. The chunks land where the restore
wants them (the large entries straight in the target's arrays, the rest in the shard's files), and the
rebuilt shard is verified there against its manifest's checksums. Up to ``parity`` lost members per group
are rebuilt; with more, the restore's plan finds the step not gettable from this tier
(:meth:`ErasureCodedTier.rebuildable`) and falls back to a slower tier, or raises CheckpointLostError.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping, Sequence

import numpy as np

from ..util import args as _args
from ..format import blockio as _blocks
from ..util.stages import describe, operation
from ..errors import ArgumentError, TierfsError
from ..format import Manifest, manifest_filename
from ..policies import LatestN, PreservationPolicy, SavePolicy
from ..ranks.agree import any_rank, views as rank_views
from . import _erasure
from ._stripes import BLOCK, PARITY, STRIPES, Payload, Stripes, WorkBuffers, ec_groups
from ._kept import KeptInRam
from .base import FailedCopy, Fetched, Pace, ReceiveInto, Tier
from .memory import MemoryTier

log = logging.getLogger("tierfs")

__all__ = ["ErasureCodedTier"]


class ErasureCodedTier(KeptInRam):
    """Parity of each group's shards in its members' RAM: any ``parity`` lost nodes of a group are rebuilt.

    Place it after the RAM tier, where a :class:`~tierfs.tiers.PeerTier` would go:
    ``TieredStore([MemoryTier(...), ErasureCodedTier(data=4, parity=1), ObjectTier(url)])``.

    Parameters
    ----------
    data, parity:
        Each group has ``data + parity`` members on distinct nodes and survives the loss of any ``parity``
        of them, for ``parity/data`` of a shard of RAM per rank and kept step (a replica costs a whole
        shard). ``parity=1`` is XOR; more needs the ``erasure`` extra. See the module docstring for the
        groups when the node count is not a multiple of ``data + parity``.
    save, keep:
        Policies. By default the tier follows the RAM tier's save policy and keeps the latest step.
    backend, connections, node_rank, name:
        As for :class:`~tierfs.tiers.PeerTier`.
    block:
        Bytes of a piece moved, checked and encoded at a time (the working buffers are a few per stripe).
    """

    def __init__(self, data: int = 4, parity: int = 1, *, save: SavePolicy | None = None,
                 keep: PreservationPolicy | None = None, backend: str = "gloo", connections: int = 2,
                 node_rank: int | None = None, name: str = "erasure", block: int = BLOCK) -> None:
        super().__init__(name, save, keep if keep is not None else LatestN(1))
        _args.integer(data, "data")
        _args.integer(parity, "parity")
        _erasure.check_parity(data, parity)
        _args.integer(connections, "connections")
        _args.optional_integer(node_rank, "node_rank", minimum=0)
        _args.name(backend, "backend")
        _args.integer(block, "block (bytes)")
        if block % 8:
            raise ArgumentError(f"block must be a multiple of 8 bytes, got {block}")
        self.data, self.parity, self.backend, self.connections = data, parity, backend, connections
        self.block = block  # bytes of a piece moved and checked at a time
        self.buffers = WorkBuffers()  # the exchanges' block buffers, kept between saves
        self._follow_ram = save is None
        self._node_rank = node_rank
        self._ram: MemoryTier | None = None
        self.targets: list[list[int]] = []
        self.nodes: list[int] = []
        self.groups: list[list[int]] = []
        self.group_of: list[int] = []

    # -- binding ------------------------------------------------------------------------------------
    def bind(self, first: Tier, group: Any) -> None:
        if group.world_size < 2:
            raise TierfsError("ErasureCodedTier needs a job of several processes on several nodes (torchrun with "
                              "torch.distributed initialised); this process is alone")
        given = [v[0] for v in rank_views(group, [int(self._node_rank is not None)])]
        if len(set(given)) > 1:  # (else the ranks would take part in different collectives next)
            raise TierfsError(f"ranks disagree on whether ErasureCodedTier node_rank is given: {given}; give it "
                              "on every rank or on none")
        nodes = group.nodes if self._node_rank is None else tuple(group.all_gather(int(self._node_rank)))
        self.nodes = [int(n) for n in nodes]
        self.groups = ec_groups(self.nodes, self.data, self.parity)
        self.group_of = [0] * len(self.nodes)
        for k, g in enumerate(self.groups):
            for r in g:
                self.group_of[r] = k
        self.targets = [[x for x in self.groups[self.group_of[r]] if x != r] for r in range(len(self.nodes))]
        self.rank = group.rank
        if self._follow_ram:
            self.save_policy = first.save_policy
        self.keep_beside(first, group, "erasure")  # (a MemoryTier: else an error, before any group is made)
        assert isinstance(first, MemoryTier)
        self._ram = first

    def members(self, rank: int | None = None) -> list[int]:
        """The ranks of ``rank``'s group (default: this rank's)."""
        return self.groups[self.group_of[self.rank if rank is None else rank]]

    # -- what this rank keeps -----------------------------------------------------------------------
    def drop(self, step: int, rank: int) -> None:
        log.warning("%s step %d: the rebuild of rank %d's shard failed with this rank's pieces; keeping them "
                    "(a later save replaces them)", self.name, step, rank)

    def holdings(self) -> dict[int, list[int]]:
        """``{step: [the other members of this rank's group]}``: the shards this rank helps rebuild."""
        others = [r for r in self.members() if r != self.rank]
        return {s: others for s in self.local.committed_steps()}

    def rebuildable(self, holders: dict[tuple[int, int], list[int]], fast: Sequence[set[int]],
                    notes: dict[int, str]) -> dict[tuple[int, int], list[int]]:
        """``holders`` of a restore's plan without the shards this tier cannot rebuild: those of a group where
        more than ``parity`` members lack the step in RAM or lack their pieces of it (``notes`` name them)."""
        out = {}
        for (s, r), hs in holders.items():
            group = self.members(r)
            missing = [x for x in group if s not in fast[x] or (x != r and x not in hs)]
            if len(missing) <= self.parity:
                out[(s, r)] = hs
            elif s not in fast[r]:
                notes[s] = (f"{self.name} group {group[:8]}{' ...' if len(group) > 8 else ''} lost {len(missing)} "
                            f"members {missing[:8]}, more than parity={self.parity}")
        return out

    # -- saving: parity from the group's chunks -------------------------------------------------------
    def replicate(self, step: int, marker: bytes, manifest: bytes, files: Mapping[str, Any], *,
                  pairs: Sequence[tuple[int, int]] | None = None, pace: Pace | None = None,
                  role: str = "copy", error: str | None = None) -> list[FailedCopy]:
        """Compute and keep this rank's parity pieces of ``step`` from its group's chunks (collective).
        ``pairs`` (a restore re-seeding a replaced node): only the members they name as receivers compute
        theirs again. Returns the failed ``(member, receiver, reason)``, the same on every rank."""
        from ._encoding import encode_group

        g = self._group(role)
        only = None if pairs is None else {t for _, t in pairs}
        with operation(describe("reseed" if pairs is not None else "replication", step, self.name)), g.bounded():
            wrote, agreed, failed = False, False, []
            try:
                errors, wrote = encode_group(self, g, step, marker, manifest, files, only, pace, error)
                failed = _agree(g, errors)
                if not failed and wrote:  # every piece of the job is in: the markers
                    try:
                        self.local.write_marker(step, marker)
                    except (TierfsError, OSError) as e:
                        errors = {self.rank: f"marker: {type(e).__name__}: {e}"}
                else:
                    errors = {}
                failed = failed or _agree(g, errors)
                agreed = True
            finally:  # not saved, or a rank lost on the way (raised): nothing computed here is kept
                if failed or not agreed:
                    self._forget(step, wrote)
        return failed

    def _forget(self, step: int, wrote: bool = True) -> None:
        try:
            self.local.discard(step)  # (buffers of a step still being computed)
            if not wrote:
                return
            self.local.delete_step(step)
        except Exception as e:  # noqa: BLE001 - not kept either way; logged
            log.warning("%s step %d: could not take back the parity computed (%s)", self.name, step, e)

    # -- restoring: a lost member's shard from its group's pieces -------------------------------------
    def fetch(self, step: int, assign: Mapping[int, int], role: str = "main",
              landing: ReceiveInto | None = None) -> Fetched | str | None:
        """Rebuild the shards of the ranks in ``assign`` (collective): the ranks of their groups send the
        pieces, ``assign``'s holder the stripes record and manifests. Returns, on a rebuilt rank, its shard
        (verified against its manifest) or the reason it failed; None on other ranks."""
        from ._encoding import rebuild_group

        g = self._group(role)
        with operation(describe("fetch", step, self.name)), g.bounded():
            got = rebuild_group(self, g, step, assign, landing)
            g.barrier()  # a rank lost on the way fails the fetch here, on every rank, naming it
        return got

    # -- this rank's own pieces ------------------------------------------------------------------------
    def own_payload(self, step: int) -> Payload:
        """This rank's payload of ``step``, from its RAM tier."""
        assert self._ram is not None
        m = Manifest.from_bytes(bytes(self._ram.read_file(step, manifest_filename(self.rank))))
        return Payload(self._ram.read_files(step, list(m.replica_files)))

    def kept(self, step: int) -> tuple[Stripes, dict[str, Any], np.ndarray]:
        """This rank's stripes record, the rest of that record (parity crcs) and its parity pieces of ``step``."""
        record = json.loads(bytes(self.local.read_file(step, STRIPES)))
        return Stripes.from_json(record["stripes"]), record, _blocks.as_u8(self.local.read_file(step, PARITY))


def _agree(g: Any, errors: Mapping[int, str | None]) -> list[FailedCopy]:
    """Every rank's failures, ``(member, receiver, reason)``, the same on every rank (one number when none)."""
    mine = [(s, g.rank, why) for s, why in errors.items() if why]
    if not any_rank(g, bool(mine)):
        return []
    return [(int(s), int(t), str(why)) for part in g.all_gather(mine) for s, t, why in part]
