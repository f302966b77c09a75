"""PyTorch Distributed Checkpoint (DCP) storage layer over a :class:`~tierfs.TieredStore`.

    store = TieredStore([MemoryTier("/dev/shm/ckpt"), ObjectTier("s3://bucket/run", ...)])
    dcp.save(state_dict, storage_writer=TieredWriter(store, step))
    dcp.load(state_dict, storage_reader=TieredReader(store))          # newest step, or step=...

What goes where
---------------
A DCP step is an ordinary tierfs step: each rank's write items are entries of that rank's shard, written
by ``store.save`` (tensor bytes are copied once, straight into the RAM tier's reusable mapped buffers,
with crc32c per block; manifest; marker written last), so the store copies, retains, verifies and
restores DCP steps like any other. Entry names come from the item's ``MetadataIndex``: a tensor chunk
is ``"<offsets joined by ,>|<fqn>"`` (``"0,128|layer.weight"``; a 0-d tensor is ``"|fqn"``), a bytes
item is ``"b|<fqn>"``; the part before the first ``|`` is never a valid fqn prefix of another kind, so
names are unique within a rank.

DCP's global ``Metadata`` is stored without pickle, as JSON in the coordinator's manifest
(``manifest.metadata["dcp"]``): every fqn's tensor properties (dtype, layout, requires_grad,
memory_format, pin_memory), size and chunks, or ``bytes``; the planner's data (the default planner's
flatten mappings: fqn -> key path of str/int); and the storage data, ``MetadataIndex -> {rank, entry}``.
``TieredReader.read_metadata`` rebuilds the same objects from it.

Why the metadata is known before the write (the marker stays last)
-------------------------------------------------------------------
DCP hands the storage writer the global ``Metadata`` only in ``finish``, on the coordinator, *after*
every rank's ``write_data``. Writing it then would mean adding a file to a committed step (the marker
would no longer be last) or holding every rank's commit open across DCP's final collective. Instead the
coordinator rebuilds the metadata in ``prepare_global_plan`` from the final global plans, exactly as
DCP's default planner derives it (one ``BytesStorageMetadata`` per bytes item; per tensor fqn the
properties and size of its first chunk and the list of chunks, in plan order; planner data merged with
the first plan winning), and puts it in its manifest during ``write_data``. ``write_data`` is the
collective store save: the step commits (marker last) only once every rank's shard and manifest are
written. ``finish`` then checks the metadata DCP built against the one derived from the plans; a planner
that builds metadata differently is rejected with an error and the coordinator removes the step from the
tiers it owns, so no step with wrong metadata stays listed.

DCP's plan caching (``DefaultSavePlanner(enable_plan_caching=True)``)
--------------------------------------------------------------------
DCP keeps its cache in class attributes of ``SavePlanner``, keyed by the planner's class name: one per
process, shared by every planner instance (a new planner per save still hits it) and every store. A rank
whose local plan did not change (same items, sizes and chunks; dtypes are not compared) sends an empty
plan with ``usable=False``; the coordinator merges the changed ones into its cached plans, and the
storage layer's ``prepare_global_plan`` gets deltas: ``usable=False`` for a rank whose final plan did
not change, which then takes its cached final plan into ``write_data``; ``finish`` gets the cached
metadata. ``TieredWriter`` keeps no cache of its own, so it can never be out of step with DCP's or carry
anything from one store to another; with a caching planner:

* the coordinator derives the metadata in ``write_data`` from the full global plan the planner holds
  (``planner.global_plan``, cached or new) when the plans it was given are deltas;
* a rank whose local plan was cached takes the items it holds (for ``replicated="local"``) from DCP's
  cached local plan;
* every rank checks the dtype of each tensor it writes against its (possibly cached) plan, and the ranks
  agree before the store saves (one small all-gather): a dtype change DCP's cache missed is written
  into the stored metadata (``dcp.save`` still returns DCP's cached metadata), and a failure on any
  rank (e.g. a planner without ``global_plan``) fails every rank at once, before anything is written.

The metadata of a cached step equals that of an uncached save of the same state.

Reading
-------
``read_data`` groups the plan's read items by the saving rank that holds them, reads each such shard
from the fastest tier whose copy verifies (RAM: mapped views, no copy; then object tiers), verifies
every block of the entries it needs, and copies each slice once into the target tensor. Any rank can
read any saving rank's shard, so loading with a different world size works wherever DCP can reshard.
``reader.sources`` says which tier served each saving rank; ``reader.skipped`` lists the copies
skipped and why (e.g. a corrupted RAM copy). DCP reads the metadata on every rank; a rank whose tiers
lack the coordinator's manifest (RAM-only stores on several nodes) gets it from a rank that has it.

Getting a checkpoint out
------------------------
``export_dcp(store, directory, step=None)`` writes a step as a plain DCP directory, exactly as
``FileSystemWriter`` lays it out (``__{rank}_0.distcp`` per saving rank with bytes items raw and tensors
as ``torch.save`` of each chunk, ``.metadata`` pickled by DCP's rules, written last), read through the
store's verified path; ``FileSystemReader(directory)`` loads it without tierfs.

Options
-------
By default every tier takes a step written by ``TieredWriter`` (DCP saves when the caller says so);
``force=False`` lets the tiers' save policies decide, ``blocking=False`` returns once the tensors are
staged, and ``metrics=`` / ``extra=`` store metrics and further non-DCP entries (``CheckpointManager``
uses all four). ``use_collectives=False`` is rejected (the step must commit across all ranks). The
process group DCP uses must have the store's ranks (``rank=`` from DCP is checked against the store).
Non-tensor values in a state dict are serialised by DCP's planner (``torch.save``), not by tierfs.
"""

from .export import export_dcp
from .metadata import META_KEY, entry_name, metadata_from_json, metadata_to_json
from .reader import TieredReader, check_target
from .writer import EXTRA_PREFIX, SHARD_KEY, TieredWriter

__all__ = ["TieredWriter", "TieredReader", "export_dcp", "check_target", "entry_name", "metadata_to_json",
           "metadata_from_json", "META_KEY", "SHARD_KEY", "EXTRA_PREFIX"]
