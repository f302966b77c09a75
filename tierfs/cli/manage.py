"""``tierfs cp``, ``tierfs gc`` and ``tierfs export``: copy a step, clean up, write a plain DCP checkpoint
or a safetensors folder.

``cp`` copies tier to tier (:func:`tierfs.cli.steps.copy_step`: verified, marker last). ``gc`` and ``export``
open a ``TieredStore`` with ``cleanup=False`` so that its rules apply (retention never deletes the only
copy of the newest step; reads are verified) while partial steps are left to ``gc``'s own, more careful
rule: a save in progress looks exactly like a crash's leftovers.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

from ..util import args as _args
from ..tiers.rootdir import check_local_url
from ..util.readable import duration, rate, size
from ..errors import OutputExistsError, TierfsError, TierUnavailableError
from ..tiers.base import Tier
from ..tiers.capabilities import LocalFiles
from . import UsageError
from .display import add_no_progress, add_threads, age, progress_bar, step_bytes
from .targets import (add_target_args, close_all, describe, is_config, is_url, select, storage_options_from_args,
                      tiers_from_config, tiers_from_target)
from .numbers import parse_duration

# -- cp ---------------------------------------------------------------------------------------------


def _dst_options(args: argparse.Namespace, src_opts: dict[str, Any]) -> dict[str, Any]:
    """Storage options for cp's destination: its own (-O/--dst-storage-options), else the source's."""
    ns = argparse.Namespace(storage_options=args.dst_storage_options, option=args.dst_option)
    own = storage_options_from_args(ns)
    return own if (args.dst_storage_options or args.dst_option) else dict(src_opts)


def _destination(args: argparse.Namespace, src_all: list[Tier], src_opts: dict[str, Any]) -> Tier:
    """cp's DEST: a URL, a config's tier, the ``--to`` tier of the source config, or a plain directory."""
    from ..tiers import MemoryTier, ObjectTier

    if args.dest is None:
        if args.to is None:
            raise UsageError("give a destination (a directory, URL or config) or --to NAME, a tier of the source "
                             "config")
        return select(src_all, args.to)[0]
    _args.object_url(args.dest, "DEST", relative=True)  # s3:/bucket is a typo, not a directory
    if is_url(args.dest):
        check_local_url(args.dest, "DEST")
        return ObjectTier(args.dest, _dst_options(args, src_opts))
    if args.dest.lower().endswith(".json"):
        cfg = Path(args.dest).expanduser()
        if not cfg.is_file():
            raise TierUnavailableError(f"config file {args.dest} does not exist")
        dtiers = tiers_from_config(cfg)
        if args.to is None and len(dtiers) > 1:
            raise UsageError(f"{args.dest} has tiers {[t.name for t in dtiers]}; choose one with --to")
        return select(dtiers, args.to)[0] if args.to else dtiers[0]
    # a plain directory: the step in tierfs's format, as a file:// object tier writes it
    dest = Path(args.dest).expanduser().resolve()
    check_local_url(str(dest), "DEST")
    pids = MemoryTier(str(dest)).live_users() if dest.is_dir() else []  # a running job's RAM tier: not under it
    if pids:
        raise TierfsError(f"{dest} is in use by running process(es) {pids}: stop the job first, or copy elsewhere")
    return ObjectTier(f"file://{dest}", name="dir")


def _pick_source(tiers: list[Tier], step: int | None) -> tuple[Tier, int]:
    """The fastest tier holding ``step`` committed (default: the newest step any tier holds)."""
    held: dict[int, Tier] = {}
    for t in tiers:
        t.check_readable()
        for s, ok in sorted(t.list_steps().items()):
            if ok:
                held.setdefault(s, t)
    if step is None:
        if not held:
            raise TierfsError(f"nothing to copy: no committed step on {[t.name for t in tiers]}")
        step = max(held)
    if step not in held:
        raise TierfsError(f"step {step} is not committed on {[t.name for t in tiers]}")
    return held[step], step


def cmd_cp(args: argparse.Namespace) -> int:
    """``tierfs cp``: copy one committed step, verified, marker last."""
    from .steps import copy_step

    src_opts = storage_options_from_args(args)
    src_all = tiers_from_target(args.source, src_opts)
    dst = _destination(args, src_all, src_opts)
    srcs = [t for t in select(src_all, args.from_tier) if t is not dst]
    if not srcs:
        raise UsageError("the source and the destination are the same tier; choose another with --from/--to")
    try:
        src, step = _pick_source(srcs, args.step)
        dst.open()
        bar: Any = progress_bar(step_bytes(src, step), f"cp step {step}", args)
        t0 = time.perf_counter()
        try:
            n = copy_step(src, dst, step, overwrite=args.overwrite, threads=args.threads,
                          progress=bar.update if bar else None)
        finally:
            if bar is not None:
                bar.close()
        dt = time.perf_counter() - t0
        print(f"copied step {step} from {describe(src)} to {describe(dst)}: {size(n)} verified in "
              f"{duration(dt)} ({rate(n, dt)}), commit marker written last")
    finally:
        close_all([*src_all, dst])
    return 0


# -- gc ---------------------------------------------------------------------------------------------

def _remove_partial(args: argparse.Namespace, tier: Tier) -> tuple[int, int]:
    """Remove ``tier``'s stale partial steps (every one with ``--force``); ``(removed, kept)``."""
    from .steps import partial_steps

    verb = "would remove" if args.dry_run else "removed"
    removed = kept = 0
    for step, seconds in partial_steps(tier):
        stale = args.force or (args.older_than is not None and seconds is not None and seconds >= args.older_than)
        if not stale:
            kept += 1
            print(f"tier {tier.name}: kept partial step {step} (last written {age(seconds)}; may be a save in "
                  "progress: pass --older-than DUR or --force to remove it)")
            continue
        if not args.dry_run:
            tier.delete_step(step)
        removed += 1
        print(f"tier {tier.name}: {verb} partial step {step} (last written {age(seconds)})")
    return removed, kept


def cmd_gc(args: argparse.Namespace) -> int:
    """``tierfs gc``: retention by each tier's keep policy now, and stale partial steps."""
    from ..policies.spec import keep_policy
    from ..store import TieredStore

    tiers = tiers_from_target(args.target, storage_options_from_args(args))
    chosen = select(tiers, args.tier)
    if args.keep is not None:
        try:
            spec = json.loads(args.keep) if args.keep.strip()[:1] in "{[\"" else args.keep.strip()
            policy = keep_policy(spec)
        except ValueError as e:
            raise UsageError(f"--keep: {e}") from None
        for t in chosen:
            t.keep_policy = policy
    elif not is_config(args.target):
        raise UsageError("gc on a bare directory or URL needs --keep, e.g. --keep '{\"latest\": 3}' (or a config "
                         "file whose tiers say \"keep\")")
    verb = "would remove" if args.dry_run else "removed"
    removed = deleted = kept = 0
    try:
        for t in tiers:
            t.check_readable()
        for t in chosen:
            pids = t.live_users() if isinstance(t, LocalFiles) else []
            if pids and not args.force:
                raise TierfsError(f"tier {t.name!r} ({t.location}) is in use by running process(es) "
                                  f"{pids}: stop the job first, or pass --force")
        # 1. partial steps: only stale ones (or every one with --force): a running save looks just like them
        for t in chosen:
            r, k = _remove_partial(args, t)
            removed, kept = removed + r, kept + k
        # 2. retention, by the store's own rules (never the only copy of the newest step)
        with TieredStore(tiers, cleanup=False, background_bandwidth=None) as store:
            doomed = store.retention_plan()
            for t in chosen:
                for step in doomed[t.name]:
                    if not args.dry_run:
                        store.delete(step, tiers=[t.name])
                    deleted += 1
                    print(f"tier {t.name}: {'would delete' if args.dry_run else 'deleted'} step {step} "
                          f"(not kept by {t.keep_policy})")
    finally:
        close_all(tiers)
    what = "would delete" if args.dry_run else "deleted"
    print(f"gc: {what} {deleted} step(s) by retention, {verb} {removed} partial step(s), kept {kept} partial")
    return 0


# -- export -----------------------------------------------------------------------------------------

def cmd_export(args: argparse.Namespace) -> int:
    """``tierfs export --dcp``: a step saved through ``TieredWriter`` as a plain DCP directory;
    ``--safetensors``: a step's tensors as a Hugging Face safetensors folder."""
    if args.dcp == args.safetensors:
        raise UsageError("choose one export format: --dcp (a plain PyTorch DCP checkpoint directory) or "
                         "--safetensors (a Hugging Face safetensors folder)")
    if args.safetensors:
        return _export_safetensors(args)
    if args.prefix is not None or args.dtype is not None or args.max_shard_size is not None or args.config or \
            args.tie or args.mode is not None:
        raise UsageError("--prefix, --dtype, --max-shard-size, --config, --tie and --mode go with --safetensors")
    try:
        from ..adapters.dcp.export import check_directory
        from ..adapters.dcp import export_dcp
    except ImportError as e:
        raise TierfsError(f"export --dcp needs torch ({e}); pip install 'tierfs[torch]'") from None

    check_directory(args.directory, "DIR")  # never a system directory, before any tier is read

    md, dt = _export(args, lambda store, step, chosen, progress: export_dcp(
        store, args.directory, step, tiers=chosen, overwrite=args.overwrite, progress=progress))
    files = sorted({getattr(v, "relative_path", "") for v in md.storage_data.values()})
    nbytes = sum(os.path.getsize(os.path.join(args.directory, f)) for f in files if f)
    print(f"exported {args.directory}: {len(files)} .distcp file(s), {size(nbytes)} in {duration(dt)} "
          f"({rate(nbytes, dt)}); load it with dcp.load(state, "
          f"storage_reader=FileSystemReader({args.directory!r}))")
    return 0


def _export(args: argparse.Namespace, write: Callable[[Any, Any, Any, Any], Any]) -> tuple[Any, float]:
    """Open TARGET's tiers (``--tier``: that one), pick ``--step`` (default: the newest every rank holds)
    and ``write(store, step, tiers, progress)`` it with a progress bar; its result and the seconds taken."""
    from ..store import TieredStore

    tiers = tiers_from_target(args.target, storage_options_from_args(args))
    if args.tier is not None:
        select(tiers, args.tier)
    chosen = [args.tier] if args.tier else None
    try:
        for t in tiers:
            t.check_readable()
        with TieredStore(tiers, cleanup=False, background_bandwidth=None) as store:
            t0 = time.perf_counter()
            held = store.common_steps(chosen)
            step = args.step if args.step is not None else (held[-1] if held else None)
            total = store.read_marker(step, tiers=chosen).nbytes if step is not None and step in held else 0
            bar: Any = progress_bar(total, f"export step {step}", args)
            try:
                out = write(store, step, chosen, bar.update if bar else None)
            except OutputExistsError as e:
                raise e.on_command_line("--overwrite") from None
            finally:
                if bar is not None:
                    bar.close()
    finally:
        close_all(tiers)
    return out, time.perf_counter() - t0


def _file_mode(text: str) -> int:
    """``--mode``'s octal permission bits (``644``, ``0o640``)."""
    try:
        mode = int(text.removeprefix("0o"), 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777:
        raise UsageError(f"--mode must be octal permission bits such as 644 or 600, got {text!r}")
    return mode


def _export_safetensors(args: argparse.Namespace) -> int:
    """``tierfs export --safetensors``: the step's tensors as ``*.safetensors`` shards and their index."""
    try:
        from ..adapters.safetensors import export_safetensors, parse_size
    except ImportError as e:
        raise TierfsError(f"export --safetensors needs torch ({e}); pip install 'tierfs[torch]'") from None
    from ..adapters.safetensors import Destination, check_ties, config_bytes, parse_dtype

    limit = parse_size(args.max_shard_size, "--max-shard-size") if args.max_shard_size is not None else "5GB"
    ties = check_ties(args.tie, "--tie") if args.tie else None
    mode = _file_mode(args.mode) if args.mode is not None else None
    parse_dtype(args.dtype)
    if args.config is not None:
        config_bytes(args.config)  # --config read and checked before any tier is opened or anything written
    dst_opts = _dst_options(args, {}) if (args.dst_storage_options or args.dst_option) else None
    Destination(args.directory, "DIR", dst_opts)  # never a system directory, before any tier is read
    out, dt = _export(args, lambda store, step, chosen, progress: export_safetensors(
        store, args.directory, step, tiers=chosen, prefix=args.prefix, dtype=args.dtype, max_shard_size=limit,
        config=args.config, overwrite=args.overwrite, storage_options=dst_opts, progress=progress, tie=ties,
        file_mode=mode))
    print(f"exported step {out.step} to {out.directory}: {len(out.weight_map)} tensors in "
          f"{len(out.files) - (len(out.files) > 1)} .safetensors file(s), {size(out.total_size)} in {duration(dt)} "
          f"({rate(out.total_size, dt)}); load it with safetensors.torch.load_file or from_pretrained")
    return 0


# -- the subcommands --------------------------------------------------------------------------------

def add_commands(sub: Any) -> None:
    """Register ``cp``, ``gc`` and ``export`` with the ``tierfs`` parser's subparsers."""
    p = sub.add_parser("cp", help="copy a step between tiers, or out to a directory or URL", description=(
        "Copy a committed step from a tier of SOURCE to DEST: a directory (the step in tierfs's format, "
        "readable as a tier), an fsspec URL, a config file (--to picks its tier), or, without DEST, the tier "
        "--to of the SOURCE config. Every manifest and every block's crc32c is checked before it is "
        "written; the commit marker is written last, so an interrupted copy never looks committed."))
    p.add_argument("source", metavar="SOURCE", help="a tier directory, an fsspec URL or a *.json config")
    p.add_argument("dest", metavar="DEST", nargs="?", help="a directory, an fsspec URL or a *.json config")
    p.add_argument("--step", type=int, metavar="N", help="the step (default: the newest committed one)")
    p.add_argument("--from", dest="from_tier", metavar="NAME", help="the source tier (default: the fastest "
                                                                     "tier holding the step)")
    p.add_argument("--to", metavar="NAME", help="the destination tier of a config")
    p.add_argument("--storage-options", metavar="JSON", help="fsspec storage options for a URL source")
    p.add_argument("-o", dest="option", action="append", metavar="KEY=VALUE",
                   help="one storage option for a URL source (repeatable); also used for a URL destination "
                        "unless -O is given")
    p.add_argument("--dst-storage-options", metavar="JSON", help="storage options for a URL destination")
    p.add_argument("-O", dest="dst_option", action="append", metavar="KEY=VALUE",
                   help="one storage option for a URL destination (repeatable)")
    p.add_argument("--overwrite", action="store_true", help="replace a copy of the step already at DEST")
    add_threads(p)
    add_no_progress(p)
    p.set_defaults(func=cmd_cp)

    p = sub.add_parser("gc", help="apply retention now; remove stale partial steps", description=(
        "Delete the committed steps each tier's keep policy does not keep (the config's \"keep\", or "
        "--keep), by the store's rules: never the only copy of the newest step. Partial steps (no commit "
        "marker) are removed only when their newest file is older than --older-than, or with --force: a "
        "save in progress looks exactly like a crash's leftovers. A RAM tier that a running process maps or "
        "pools buffers in is refused unless --force. --dry-run prints what would go and deletes nothing."))
    add_target_args(p)
    p.add_argument("--keep", metavar="SPEC", help='keep policy for the selected tiers, e.g. \'{"latest": 3}\' '
                                                  '(required for a directory or URL target)')
    p.add_argument("--older-than", type=parse_duration, metavar="DUR",
                   help="remove partial steps last written longer ago than this, e.g. 1h")
    p.add_argument("--force", action="store_true",
                   help="remove every partial step and ignore running processes: only when no job runs")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted; delete nothing")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("export", help="write a step as a plain DCP checkpoint or a safetensors folder",
                       description=(
        "--dcp: write a step saved through tierfs's DCP layer (TieredWriter) as a plain PyTorch DCP checkpoint "
        "directory: __<rank>_0.distcp files and .metadata (written last), loadable with "
        "dcp.load(state, storage_reader=FileSystemReader(DIR)) without tierfs. --safetensors: write the step's "
        "tensors (sharded ones assembled whole) as a Hugging Face folder: model.safetensors, or "
        "model-0000K-of-0000N.safetensors and model.safetensors.index.json (written last); DIR may be an "
        "fsspec URL. Every byte is read through the verified path (fastest tier whose checksums check out)."))
    add_target_args(p)
    p.add_argument("directory", metavar="DIR", help="the output directory (--safetensors: or an fsspec URL)")
    p.add_argument("--dcp", action="store_true", help="the format: a PyTorch DCP directory")
    p.add_argument("--safetensors", action="store_true", help="the format: a Hugging Face safetensors folder")
    p.add_argument("--step", type=int, metavar="N", help="the step (default: the newest)")
    p.add_argument("--prefix", metavar="PREFIX", help="--safetensors: keep only the tensors named PREFIX... and "
                                                      "strip it, e.g. model.")
    p.add_argument("--dtype", metavar="DTYPE", help="--safetensors: cast floating tensors, e.g. bfloat16")
    p.add_argument("--max-shard-size", metavar="SIZE", help="--safetensors: the most bytes per file (default "
                                                            "5GB; 500MB, 2GiB)")
    p.add_argument("--config", metavar="FILE", help="--safetensors: a config.json to write beside the tensors")
    p.add_argument("--tie", metavar="A=B", action="append", help="--safetensors: A is tied to B (e.g. "
                   "lm_head.weight=model.embed_tokens.weight): written once, as B, as save_pretrained does; repeat "
                   "for more")
    p.add_argument("--mode", metavar="OCTAL", help="--safetensors: the files' permissions (default: 666 less the "
                   "umask, 644 usually; a model folder is for others to read)")
    p.add_argument("--dst-storage-options", metavar="JSON", help="--safetensors: storage options for a URL DIR")
    p.add_argument("-O", dest="dst_option", action="append", metavar="KEY=VALUE",
                   help="--safetensors: one storage option for a URL DIR (repeatable)")
    p.add_argument("--overwrite", action="store_true", help="replace an export already in DIR")
    add_no_progress(p)
    p.set_defaults(func=cmd_export)
