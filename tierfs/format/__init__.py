"""The on-tier format: step layout, manifests, commit markers and checksums.

The same bytes live on every tier. A step is one directory::

    step_000000000042/
        rank_00000.0000.bin          shard files: raw bytes of a rank's entries, 64-byte aligned
        rank_00000.0001.bin
        rank_00000.manifest.json     what is where, with crc32c per block
        COMMITTED                    the marker, written last; without it the step does not exist

On an object store, from format version 3, each rank's files go under a bucket of key prefixes before the
step instead (``ranks/<bucket>/step_000000000042/rank_00000.0000.bin``, :mod:`.keys`); the marker stays.

This module knows nothing of tiers: it only names, plans, serialises and validates.
"""

from .keys import SPREAD_VERSION, rank_of_file, spread_bucket
from .manifest import Entry, Manifest
from .marker import Marker, listed_in, manifest_digest, manifest_from_marker, step_digest
from .names import (ALIGN, DCP_EXTRA_PREFIX, DCP_SHARD_KEY, DEFAULT_BLOCK_SIZE, DEFAULT_FILE_SIZE, FORMAT_VERSION,
                    MARKER, MAX_NAME, READ_VERSIONS, align, blocks, crc32c, dcp_entry_name, entry_name_problem,
                    manifest_filename, nblocks, parse_step_dirname, plan_files, read_json, shard_filename,
                    shown_name, step_dirname, user_key, validate_entry_name, validate_filename)

__all__ = ["ALIGN", "DCP_EXTRA_PREFIX", "DCP_SHARD_KEY", "DEFAULT_BLOCK_SIZE", "DEFAULT_FILE_SIZE", "Entry",
           "FORMAT_VERSION", "MARKER", "MAX_NAME", "Manifest", "Marker", "READ_VERSIONS", "SPREAD_VERSION", "align",
           "blocks", "crc32c", "entry_name_problem", "rank_of_file", "shown_name", "spread_bucket",
           "dcp_entry_name", "listed_in", "manifest_digest", "manifest_filename", "manifest_from_marker", "nblocks",
           "parse_step_dirname", "plan_files", "read_json", "shard_filename", "step_digest", "step_dirname", "user_key",
           "validate_entry_name", "validate_filename"]
