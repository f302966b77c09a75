"""The ``tierfs`` command: inspect, check, copy, clean and export checkpoints; plan and simulate.

    tierfs ls TARGET                                  steps per tier (committed or partial)
    tierfs verify TARGET [--step N] [--tier NAME]     check every checksum of a step
    tierfs cp SRC [DST] [--step N] [--from T] [--to T]   copy a step, verified, marker last
    tierfs gc TARGET [--older-than DUR] [--force] [--dry-run]   retention now; stale partial steps
    tierfs export TARGET DIR --dcp [--step N]         a plain DCP checkpoint (FileSystemReader reads it)
    tierfs plan ...                                   RAM per host, intervals, goodput, bandwidth
    tierfs simulate ...                               Monte-Carlo of a training run under failures
    tierfs bench [--object URL -o ...]                measure the tiers here; plan/simulate read it

A TARGET is a RAM tier directory (/dev/shm/tierfs/job-42), an fsspec URL (s3://bucket/run, with
``-o endpoint_url=...``) or a JSON config listing tiers. ``ls`` and ``verify`` only read: they work on the
tiers directly and never build a ``TieredStore``, whose start-up removes uncommitted steps; a step still
being written, or that a crash left behind, is listed as ``partial`` and left alone.

A config file::

    {"tiers": [
      {"kind": "memory", "path": "/dev/shm/tierfs/job-42", "budget": null, "name": "ram",
       "save": {"every_n_steps": 1}, "keep": {"latest": 2}},
      {"kind": "object", "url": "s3://bucket/job-42", "storage_options": {"endpoint_url": "..."},
       "name": "s3", "save": {"every_n_steps": 100}, "keep": {"latest": 3, "every_n_steps": 1000}}]}

``save`` and ``keep`` are optional policy specs (see :mod:`tierfs.policies.spec`); without ``keep`` a
memory tier keeps the latest 2 and an object tier everything. Relative paths are taken from the config
file's directory.

Exit status: 0 on success, 1 when a check fails or a tier cannot be read or written, 2 for a bad
command line. Errors are one line on stderr: ``tierfs: error: ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from .errors import ChecksumError, FormatError, TierfsError, TierUnavailableError
from .format import Manifest, crc32c, manifest_filename, read_json
from .ops import batches
from .tiers.base import Tier

PROG = "tierfs"


class UsageError(Exception):
    """Something wrong with the command line itself (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr: ``tierfs: error: ...``."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{message} (see '{self.prog} --help')")


# -- targets ----------------------------------------------------------------------------------------

def _is_url(target: str) -> bool:
    return "://" in target


def _parse_option_value(v: str) -> Any:
    """``-o k=v`` values are strings, except true/false/null and JSON objects/arrays.

    Numbers stay strings on purpose (an access key of digits must not become an int); pass typed
    values with ``--storage-options '{...}'``.
    """
    low = v.strip().lower()
    if low in ("true", "false", "null", "none"):
        return {"true": True, "false": False}.get(low)
    if v.strip()[:1] in ("{", "["):
        try:
            return json.loads(v)
        except ValueError as e:
            raise UsageError(f"-o value {v!r} looks like JSON but does not parse ({e})") from None
    return v


def storage_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if args.storage_options:
        try:
            opts = json.loads(args.storage_options)
        except ValueError as e:
            raise UsageError(f"--storage-options is not valid JSON ({e})") from None
        if not isinstance(opts, dict):
            raise UsageError("--storage-options must be a JSON object, e.g. '{\"endpoint_url\": \"http://...\"}'")
    for item in args.option or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"-o expects key=value, got {item!r}")
        opts[key.strip()] = _parse_option_value(value)
    return opts


_MEMORY_KEYS = {"kind", "name", "path", "budget", "save", "keep"}
_OBJECT_KEYS = {"kind", "name", "url", "storage_options", "save", "keep"}


def _policies(spec: dict[str, Any], where: str) -> dict[str, Any]:
    """``save=``/``keep=`` keyword arguments for a tier from its config entry."""
    from .policies.spec import keep_policy, save_policy

    out: dict[str, Any] = {}
    try:
        if spec.get("save") is not None:
            out["save"] = save_policy(spec["save"])
        if spec.get("keep") is not None:
            out["keep"] = keep_policy(spec["keep"])
    except ValueError as e:
        raise FormatError(f"{where}: {e}") from None
    return out


def tiers_from_config(path: Path) -> list[Tier]:
    """The tiers a JSON config file describes (see the module docstring for the format)."""
    from .tiers import MemoryTier, ObjectTier

    cfg = read_json(path, f"config {path}")
    specs = cfg.get("tiers") if isinstance(cfg, dict) else None
    if not isinstance(specs, list) or not specs:
        raise FormatError(f'config {path}: expected {{"tiers": [{{"kind": "memory", ...}}, ...]}} '
                          "with at least one tier")
    tiers: list[Tier] = []
    for i, spec in enumerate(specs):
        where = f"config {path}: tiers[{i}]"
        if not isinstance(spec, dict):
            raise FormatError(f"{where} must be an object")
        kind = spec.get("kind")
        allowed = {"memory": _MEMORY_KEYS, "object": _OBJECT_KEYS}.get(kind)  # type: ignore[arg-type]
        if allowed is None:
            raise FormatError(f'{where}: "kind" must be "memory" or "object", got {kind!r}')
        unknown = sorted(set(spec) - allowed)
        if unknown:
            raise FormatError(f"{where}: unknown keys {unknown}; a {kind} tier takes {sorted(allowed)}")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise FormatError(f"{where}: name must be a string")
        if kind == "memory":
            p = spec.get("path")
            if p is not None:
                if not isinstance(p, str):
                    raise FormatError(f"{where}: path must be a string")
                p = Path(p).expanduser()
                if not p.is_absolute():
                    p = path.parent / p
            budget = spec.get("budget")
            if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool)):
                raise FormatError(f"{where}: budget must be a number of bytes or null")
            tiers.append(MemoryTier(p, budget=budget, name=name or "ram", **_policies(spec, where)))
        else:
            url, so = spec.get("url"), spec.get("storage_options") or {}
            if not isinstance(url, str) or not url:
                raise FormatError(f'{where}: an object tier needs "url", e.g. "s3://bucket/run"')
            if not isinstance(so, dict):
                raise FormatError(f"{where}: storage_options must be an object")
            tiers.append(ObjectTier(url, so, name=name, **_policies(spec, where)))
    names = [t.name for t in tiers]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise FormatError(f"config {path}: tier names must be unique, {dup} repeats; set \"name\"")
    return tiers


def tiers_from_target(target: str, storage_options: dict[str, Any]) -> list[Tier]:
    """A URL → an ObjectTier; a ``*.json`` file → the tiers it describes; a directory → a MemoryTier."""
    from .tiers import MemoryTier, ObjectTier

    if _is_url(target):
        return [ObjectTier(target, storage_options)]
    if storage_options:
        raise UsageError("--storage-options/-o only apply to a URL target (put them in the config file "
                         "for config targets)")
    p = Path(target).expanduser()
    if p.is_file():
        if p.suffix.lower() != ".json":
            raise TierUnavailableError(f"{target} is a file but not a *.json tier config; give a tier "
                                       "directory, an fsspec URL or a config file")
        return tiers_from_config(p)
    if p.is_dir():
        return [MemoryTier(p)]
    if p.suffix.lower() == ".json":
        raise TierUnavailableError(f"config file {target} does not exist")
    raise TierUnavailableError(f"{target}: no such directory (expected a tier directory, an fsspec URL "
                               "such as s3://bucket/run, or a *.json config)")


def open_readonly(tier: Tier) -> None:
    """Make sure a tier can be read, without creating or changing anything.

    ``Tier.open()`` creates a local root (0700) and, for the RAM tier, clears dead processes' pools: a
    listing must not do that, nor make a missing directory appear. Local roots are only checked; remote
    ones go through ``open()``, which only probes the bucket.
    """
    from .tiers import MemoryTier, ObjectTier

    if isinstance(tier, MemoryTier):
        root = tier.path
    elif isinstance(tier, ObjectTier) and tier.protocol in ("file", "local"):
        root = Path(tier.root)
    else:
        tier.open()
        return
    if not root.is_dir():
        raise TierUnavailableError(f"tier {tier.name!r}: {root} is not a directory")
    if not os.access(root, os.R_OK | os.X_OK):
        raise TierUnavailableError(f"tier {tier.name!r}: {root} is not readable")


def describe(tier: Tier) -> str:
    where = getattr(tier, "url", None) or str(getattr(tier, "path", ""))
    return f"{tier.name} ({tier.kind}, {where})"


def human_bytes(n: int) -> str:
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{int(x)} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    raise AssertionError("unreachable")


def _error(msg: str) -> None:
    msg = " ".join(str(msg).split())  # always one line
    print(f"{PROG}: error: {msg}", file=sys.stderr)


def _select(tiers: list[Tier], name: str | None) -> list[Tier]:
    if name is None:
        return tiers
    chosen = [t for t in tiers if t.name == name]
    if not chosen:
        raise UsageError(f"no tier named {name!r}; this target has {[t.name for t in tiers]}")
    return chosen


# -- ls ---------------------------------------------------------------------------------------------

@dataclass
class StepRow:
    step: int
    state: str  # "committed", "partial" or "bad-marker"
    files: int
    nbytes: int
    world: int | None
    committed: float | None


def list_tier(tier: Tier) -> list[StepRow]:
    """Every step directory on ``tier``, committed or not; reads the marker, deletes nothing."""
    rows = []
    for step, ok in sorted(tier.list_steps().items()):
        try:
            sizes = tier.file_sizes(step)
        except FileNotFoundError:
            continue  # deleted (retention) between listing and looking
        world = when = None
        state = "committed" if ok else "partial"
        if ok:
            try:
                m = tier.read_marker(step)
                world, when = m.world_size, m.committed
            except FileNotFoundError:
                state = "partial"  # marker removed meanwhile: the step is being deleted
            except FormatError:
                state = "bad-marker"
        rows.append(StepRow(step, state, len(sizes), sum(sizes.values()), world, when))
    return rows


def cmd_ls(args: argparse.Namespace) -> int:
    tiers = _select(tiers_from_target(args.target, storage_options_from_args(args)), args.tier)
    status = 0
    for i, tier in enumerate(tiers):
        if i:
            print()
        print(f"tier {describe(tier)}")
        try:
            open_readonly(tier)
            rows = list_tier(tier)
        except (TierfsError, OSError) as e:
            _error(f"tier {tier.name!r}: {e}")
            status = 1
            continue
        finally:
            tier.close()
        if not rows:
            print("  (no steps)")
            continue
        table = [("STEP", "STATE", "FILES", "SIZE", "WORLD", "COMMITTED")]
        for r in rows:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.committed)) if r.committed else "-"
            table.append((str(r.step), r.state, str(r.files), human_bytes(r.nbytes),
                          "-" if r.world is None else str(r.world), when))
        widths = [max(len(row[c]) for row in table) for c in range(len(table[0]))]
        for row in table:
            cells = [row[0].rjust(widths[0])] + [row[c].ljust(widths[c]) for c in range(1, len(row) - 1)]
            cells.append(row[-1])
            print("  " + "  ".join(cells).rstrip())
        partial = sum(r.state == "partial" for r in rows)
        if partial:
            print(f"  ({partial} partial: an interrupted or still running save; a TieredStore opening "
                  "this tier removes them)")
    return status


# -- verify -----------------------------------------------------------------------------------------

def verify_step(tier: Tier, step: int, threads: int | None = None,
                progress: Callable[[int], None] | None = None) -> tuple[int, int]:
    """Check every checksum of ``step`` on ``tier``, for every rank the marker lists.

    Returns ``(bytes checked, manifests checked)``; raises a TierfsError/OSError naming the first
    problem (``<manifest>: checksum mismatch in '<entry>' ...``).
    """
    from ._copy import verify as _verify

    marker = tier.read_marker(step)
    if marker.step != step:
        raise FormatError(f"commit marker of step {step} says step {marker.step}")
    if len(marker.manifests) != marker.world_size:
        raise FormatError(f"commit marker lists {len(marker.manifests)} manifests for world size "
                          f"{marker.world_size}")
    checked = 0
    for rank, (mname, mcrc) in enumerate(sorted(marker.manifests.items())):
        try:
            if mname != manifest_filename(rank):
                raise FormatError(f"commit marker lists {mname}, expected {manifest_filename(rank)}")
            mbytes = bytes(tier.read_file(step, mname))
            if crc32c(mbytes) != mcrc:
                raise ChecksumError("manifest does not match its commit marker")
            manifest = Manifest.from_bytes(mbytes)
            if manifest.step != step or manifest.rank != rank or manifest.world_size != marker.world_size:
                raise FormatError(f"manifest is for step {manifest.step} rank {manifest.rank} of "
                                  f"{manifest.world_size}")
            checked += len(mbytes)
            # One shard batch at a time, each checked by the store's own verifier on a sub-manifest.
            for names in batches(manifest.files):
                part = Manifest(step, rank, manifest.world_size,
                                [e for e in manifest.entries if e.kind == "array" and e.file in names],
                                {n: manifest.files[n] for n in names}, manifest.block_size)
                _verify(part, tier.read_files(step, names), threads)
                n = part.nbytes
                checked += n
                if progress is not None:
                    progress(n)
        except (TierfsError, OSError) as e:
            raise type(e)(f"{mname}: {e}") from e
    return checked, len(marker.manifests)


def _progress_bar(total: int, label: str, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # the "progress" extra is not installed
        return None
    return tqdm(total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1024, leave=False,
                file=sys.stderr)


def _marker_bytes(tier: Tier, step: int) -> int:
    try:
        return int(tier.read_marker(step).nbytes)
    except (TierfsError, OSError):
        return 0


def cmd_verify(args: argparse.Namespace) -> int:
    tiers = _select(tiers_from_target(args.target, storage_options_from_args(args)), args.tier)
    show_progress = not args.no_progress and sys.stderr.isatty()
    failed = verified = 0
    for tier in tiers:
        label = f"{tier.name} ({tier.kind})"
        try:
            try:
                open_readonly(tier)
                steps = tier.list_steps()
            except (TierfsError, OSError) as e:
                print(f"{label}: FAILED: cannot read the tier: {' '.join(str(e).split())}")
                failed += 1
                continue
            if args.step is None:
                committed = sorted(s for s, ok in steps.items() if ok)
                if not committed:
                    print(f"{label}: no committed step, nothing to verify")
                    continue
                step = committed[-1]
            else:
                step = args.step
                if not steps.get(step):
                    why = "is partial (no commit marker)" if step in steps else "is not on this tier"
                    if args.tier is None:
                        print(f"{label}: step {step} {why}, skipped")
                    else:
                        print(f"{label}: step {step}: FAILED: step {why}")
                        failed += 1
                    continue
            bar = _progress_bar(_marker_bytes(tier, step), f"verify {tier.name} step {step}", show_progress)
            t0 = time.perf_counter()
            try:
                nbytes, nman = verify_step(tier, step, args.threads, bar.update if bar else None)
            except (TierfsError, OSError) as e:
                print(f"{label}: step {step}: FAILED: {' '.join(str(e).split())}")
                failed += 1
                continue
            finally:
                if bar is not None:
                    bar.close()
            dt = time.perf_counter() - t0
            rate = f"{nbytes / dt / 1e9:.2f} GB/s" if dt > 0 else "-"
            ranks = f"{nman} rank{'s' if nman != 1 else ''}"
            print(f"{label}: step {step}: OK  {human_bytes(nbytes)} checked ({ranks}) in {dt:.3f} s, {rate}")
            verified += 1
        finally:
            tier.close()
    if failed:
        return 1
    if not verified:
        _error("nothing was verified: no tier holds "
               + ("a committed step" if args.step is None else f"a committed step {args.step}"))
        return 1
    return 0


# -- cp ---------------------------------------------------------------------------------------------

def _dst_options(args: argparse.Namespace, src_opts: dict[str, Any]) -> dict[str, Any]:
    """Storage options for cp's destination: its own (-O/--dst-storage-options), else the source's."""
    ns = argparse.Namespace(storage_options=args.dst_storage_options, option=args.dst_option)
    own = storage_options_from_args(ns)
    return own if (args.dst_storage_options or args.dst_option) else dict(src_opts)


def _pick_source(tiers: list[Tier], step: int | None) -> tuple[Tier, int]:
    """The fastest tier holding ``step`` committed (default: the newest step any tier holds)."""
    held: dict[int, Tier] = {}
    for t in tiers:
        open_readonly(t)
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
    from .ops import copy_step
    from .tiers import ObjectTier

    src_opts = storage_options_from_args(args)
    src_all = tiers_from_target(args.source, src_opts)
    if args.dest is None:
        if args.to is None:
            raise UsageError("give a destination (a directory, URL or config) or --to NAME, a tier of the source "
                             "config")
        dst = _select(src_all, args.to)[0]
    elif _is_url(args.dest):
        dst = ObjectTier(args.dest, _dst_options(args, src_opts))
    elif args.dest.lower().endswith(".json"):
        cfg = Path(args.dest).expanduser()
        if not cfg.is_file():
            raise TierUnavailableError(f"config file {args.dest} does not exist")
        dtiers = tiers_from_config(cfg)
        if args.to is None and len(dtiers) > 1:
            raise UsageError(f"{args.dest} has tiers {[t.name for t in dtiers]}; choose one with --to")
        dst = _select(dtiers, args.to)[0] if args.to else dtiers[0]
    else:  # a plain directory: the step in tierfs's format, as a file:// object tier writes it
        dst = ObjectTier("file://" + str(Path(args.dest).expanduser().resolve()), name="dir")
    srcs = _select(src_all, args.from_tier)
    srcs = [t for t in srcs if not (t is dst)]
    if not srcs:
        raise UsageError("the source and the destination are the same tier; choose another with --from/--to")
    try:
        src, step = _pick_source(srcs, args.step)
        dst.open()
        total = _marker_bytes(src, step)
        bar = _progress_bar(total, f"cp step {step}", not args.no_progress and sys.stderr.isatty())
        t0 = time.perf_counter()
        try:
            n = copy_step(src, dst, step, overwrite=args.overwrite, threads=args.threads,
                          progress=bar.update if bar else None)
        finally:
            if bar is not None:
                bar.close()
        dt = time.perf_counter() - t0
        print(f"copied step {step} from {describe(src)} to {describe(dst)}: {human_bytes(n)} verified in "
              f"{dt:.2f} s, commit marker written last")
    finally:
        for t in {id(t): t for t in [*src_all, dst]}.values():
            t.close()
    return 0


# -- gc ---------------------------------------------------------------------------------------------

def _age(seconds: float | None) -> str:
    if seconds is None:
        return "at an unknown time"
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def cmd_gc(args: argparse.Namespace) -> int:
    from .ops import live_users, partial_steps
    from .policies.spec import keep_policy
    from .store import TieredStore

    tiers = tiers_from_target(args.target, storage_options_from_args(args))
    chosen = _select(tiers, args.tier)
    is_config = not _is_url(args.target) and args.target.lower().endswith(".json")
    if args.keep is not None:
        try:
            spec = json.loads(args.keep) if args.keep.strip()[:1] in "{[\"" else args.keep.strip()
            policy = keep_policy(spec)
        except ValueError as e:
            raise UsageError(f"--keep: {e}") from None
        for t in chosen:
            t.keep_policy = policy
    elif not is_config:
        raise UsageError("gc on a bare directory or URL needs --keep, e.g. --keep '{\"latest\": 3}' (or a config "
                         "file whose tiers say \"keep\")")
    verb = "would remove" if args.dry_run else "removed"
    removed = deleted = kept = 0
    try:
        for t in tiers:
            open_readonly(t)
        for t in chosen:
            pids = live_users(t)
            if pids and not args.force:
                raise TierfsError(f"tier {t.name!r} ({getattr(t, 'path', '')}) is in use by running process(es) "
                                  f"{pids}: stop the job first, or pass --force")
        # 1. partial steps: only stale ones (or every one with --force): a running save looks just like them
        for t in chosen:
            for step, age in partial_steps(t):
                stale = args.force or (args.older_than is not None and age is not None and age >= args.older_than)
                if not stale:
                    kept += 1
                    print(f"tier {t.name}: kept partial step {step} (last written {_age(age)}; may be a save in "
                          "progress: pass --older-than DUR or --force to remove it)")
                    continue
                if not args.dry_run:
                    t.delete_step(step)
                removed += 1
                print(f"tier {t.name}: {verb} partial step {step} (last written {_age(age)})")
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
        for t in tiers:
            t.close()
    what = "would delete" if args.dry_run else "deleted"
    print(f"gc: {what} {deleted} step(s) by retention, {verb} {removed} partial step(s), kept {kept} partial")
    return 0


# -- export -----------------------------------------------------------------------------------------

def cmd_export(args: argparse.Namespace) -> int:
    if not args.dcp:
        raise UsageError("choose the export format: --dcp (a plain PyTorch DCP checkpoint directory)")
    try:
        from .adapters.dcp import export_dcp
    except ImportError as e:
        raise TierfsError(f"export --dcp needs torch ({e}); pip install 'tierfs[torch]'") from None
    from .store import TieredStore

    tiers = tiers_from_target(args.target, storage_options_from_args(args))
    if args.tier is not None:
        _select(tiers, args.tier)
    try:
        for t in tiers:
            open_readonly(t)
        with TieredStore(tiers, cleanup=False, background_bandwidth=None) as store:
            t0 = time.perf_counter()
            chosen = [args.tier] if args.tier else None
            held = sorted(s for s, ts in store.steps().items() if chosen is None or set(ts) & set(chosen))
            step = args.step if args.step is not None else (held[-1] if held else None)
            total = store.read_marker(step, tiers=chosen).nbytes if step in held else 0
            bar = _progress_bar(total, f"export step {step}", not args.no_progress and sys.stderr.isatty())
            try:
                md = export_dcp(store, args.directory, step, tiers=chosen, overwrite=args.overwrite,
                                progress=bar.update if bar else None)
            finally:
                if bar is not None:
                    bar.close()
    finally:
        for t in tiers:
            t.close()
    files = sorted({getattr(v, "relative_path", "") for v in md.storage_data.values()})
    size = sum(os.path.getsize(os.path.join(args.directory, f)) for f in files if f)
    print(f"exported {args.directory}: {len(files)} .distcp file(s), {human_bytes(size)} in "
          f"{time.perf_counter() - t0:.2f} s; load it with dcp.load(state, "
          f"storage_reader=FileSystemReader({args.directory!r}))")
    return 0


# -- plan, simulate, bench --------------------------------------------------------------------------

def _inputs_errors_are_usage(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except ValueError as e:
            raise UsageError(str(e)) from None
    return run


def _cmd_plan(args: argparse.Namespace) -> int:
    from .cli_plan import cmd_plan

    return _inputs_errors_are_usage(cmd_plan)(args)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from .cli_plan import cmd_simulate

    return _inputs_errors_are_usage(cmd_simulate)(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from .cli_plan import cmd_bench

    return cmd_bench(args, storage_options_from_args(args))


# -- entry point ------------------------------------------------------------------------------------

def _add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("-j", "--threads", type=int, metavar="N", help="checksum threads (default: up to 4)")


def _add_no_progress(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: shown on a terminal)")


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="TARGET",
                   help="a tier directory (e.g. /dev/shm/tierfs/JOB), an fsspec URL (s3://bucket/run, "
                        "gs://..., file:///...) or a *.json config listing tiers")
    p.add_argument("--storage-options", metavar="JSON",
                   help="fsspec storage options for a URL target, as a JSON object")
    p.add_argument("-o", dest="option", action="append", metavar="KEY=VALUE",
                   help="one storage option for a URL target, e.g. -o endpoint_url=http://host:9000 "
                        "(repeatable; values are strings except true/false/null and JSON objects)")
    p.add_argument("--tier", metavar="NAME", help="only the tier of this name (default: every tier)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Inspect, check, copy, clean up and export tierfs checkpoints; "
                                            "plan and simulate checkpointing for a training job. ls and "
                                            "verify only read.")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("ls", help="list the steps on each tier", description=(
        "List every step directory on each tier: committed or partial (no commit marker: an interrupted "
        "or still running save), number of files, total size, and the world size and commit time the "
        "marker records. Partial steps are shown, never removed."))
    _add_target(p)
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("verify", help="check every checksum of a step", description=(
        "Check a step on each tier: the commit marker, the crc32c of every rank's manifest it lists, and "
        "the crc32c of every block of every array. Prints OK or FAILED per tier; exits 1 if any failed."))
    _add_target(p)
    p.add_argument("--step", type=int, metavar="N",
                   help="the step to check (default: each tier's newest committed step)")
    _add_threads(p)
    _add_no_progress(p)
    p.set_defaults(func=cmd_verify)

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
    _add_threads(p)
    _add_no_progress(p)
    p.set_defaults(func=cmd_cp)

    p = sub.add_parser("gc", help="apply retention now; remove stale partial steps", description=(
        "Delete the committed steps each tier's keep policy does not keep (the config's \"keep\", or "
        "--keep), by the store's rules: never the only copy of the newest step. Partial steps (no commit "
        "marker) are removed only when their newest file is older than --older-than, or with --force: a "
        "save in progress looks exactly like a crash's leftovers. A RAM tier that a running process maps or "
        "pools buffers in is refused unless --force. --dry-run prints what would go and deletes nothing."))
    _add_target(p)
    p.add_argument("--keep", metavar="SPEC", help='keep policy for the selected tiers, e.g. \'{"latest": 3}\' '
                                                  '(required for a directory or URL target)')
    p.add_argument("--older-than", type=_duration, metavar="DUR",
                   help="remove partial steps last written longer ago than this, e.g. 1h")
    p.add_argument("--force", action="store_true",
                   help="remove every partial step and ignore running processes: only when no job runs")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted; delete nothing")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("export", help="write a step as a plain DCP checkpoint", description=(
        "Write a step saved through tierfs's DCP layer (TieredWriter) as a plain PyTorch DCP checkpoint "
        "directory: __<rank>_0.distcp files and .metadata (written last), loadable with "
        "dcp.load(state, storage_reader=FileSystemReader(DIR)) without tierfs. Every byte is read through "
        "the verified path (fastest tier whose checksums check out)."))
    _add_target(p)
    p.add_argument("directory", metavar="DIR", help="the output directory")
    p.add_argument("--dcp", action="store_true", help="the format: a PyTorch DCP directory (required)")
    p.add_argument("--step", type=int, metavar="N", help="the step (default: the newest)")
    p.add_argument("--overwrite", action="store_true", help="replace a DCP checkpoint already in DIR")
    _add_no_progress(p)
    p.set_defaults(func=cmd_export)

    from .cli_plan import add_bench_args, add_model_args, add_simulate_args

    p = sub.add_parser("plan", help="RAM per host, save intervals, goodput and bandwidth for a job",
                       description=(
        "Plan a job's checkpointing from its model, cluster, failure rate and the tiers' bandwidths "
        "(measured with 'tierfs bench' or given): RAM per host for the RAM tier (own steps, steps in flight, "
        "replicas held for others), each tier's save interval (Young/Daly, then the goodput maximum), the "
        "expected goodput of object storage alone, RAM + object and RAM + peers + object, and the write "
        "bandwidth each tier needs. Sizes take units: 70B params, 5TB, 5GB/s, 124min."))
    add_model_args(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("simulate", help="Monte-Carlo of a training run under failures", description=(
        "Simulate many runs of a job under exponential failures (node losses and process restarts, "
        "recovery from RAM, peer or object tier) with the intervals 'tierfs plan' chooses, for one cluster "
        "or several sizes (--sizes with --accelerator-mttf). Prints goodput, job time, work lost and time "
        "recovering with 95% confidence intervals, next to the plan's goodput."))
    add_model_args(p)
    add_simulate_args(p)
    p.set_defaults(func=_cmd_simulate)

    p = sub.add_parser("bench", help="measure the tiers on this machine for plan/simulate", description=(
        "Measure RAM-tier save and restore through a TieredStore, object-tier upload and download for "
        "--object URL, and (under torchrun) peer transfer over gloo send/recv. Writes a JSON file that "
        "'tierfs plan --bench FILE' and 'tierfs simulate --bench FILE' read."))
    add_bench_args(p)
    p.set_defaults(func=_cmd_bench)
    return parser


def _duration(text: str) -> float:
    from .cli_plan import parse_duration

    return parse_duration(text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if getattr(args, "threads", None) is not None and args.threads < 1:
            raise UsageError("--threads must be at least 1")
        if getattr(args, "step", None) is not None and args.step < 0:
            raise UsageError("--step must be >= 0")
        return args.func(args)
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except UsageError as e:
        _error(str(e))
        return 2
    except (TierfsError, OSError) as e:
        _error(str(e) or type(e).__name__)
        return 1
    except KeyboardInterrupt:
        _error("interrupted")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
