"""The ``tierfs`` command: look at and check the checkpoints on a tier without a training job.

    tierfs ls /dev/shm/tierfs/job-42                 a RAM tier directory (or any local step directory)
    tierfs ls s3://bucket/run -o endpoint_url=...    an object tier at an fsspec URL
    tierfs ls tiers.json                             every tier a config file describes
    tierfs verify TARGET [--step N] [--tier NAME]    check every checksum of a step

Both commands only read. They work on the tiers directly and never build a ``TieredStore``, whose
start-up removes uncommitted steps: a step that is still being written, or that a crash left behind,
is listed as ``partial`` and left alone.

A config file is ``{"tiers": [{"kind": "memory", "path": ..., "budget": ..., "name": ...},
{"kind": "object", "url": ..., "storage_options": {...}, "name": ...}]}``; relative paths are taken
from the config file's directory.

Exit status: 0 on success, 1 when a check fails or a tier cannot be read, 2 for a bad command line.
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
from .format import Manifest, crc32c, manifest_filename
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


_MEMORY_KEYS = {"kind", "name", "path", "budget"}
_OBJECT_KEYS = {"kind", "name", "url", "storage_options"}


def tiers_from_config(path: Path) -> list[Tier]:
    """The tiers a JSON config file describes (see the module docstring for the format)."""
    from .tiers import MemoryTier, ObjectTier

    try:
        cfg = json.loads(path.read_text())
    except ValueError as e:
        raise FormatError(f"config {path}: not valid JSON ({e})") from None
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
            tiers.append(MemoryTier(p, budget=budget, name=name or "ram"))
        else:
            url, so = spec.get("url"), spec.get("storage_options") or {}
            if not isinstance(url, str) or not url:
                raise FormatError(f'{where}: an object tier needs "url", e.g. "s3://bucket/run"')
            if not isinstance(so, dict):
                raise FormatError(f"{where}: storage_options must be an object")
            tiers.append(ObjectTier(url, so, name=name))
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

#: files read and checked at once: bounds memory and keeps an object tier's downloads concurrent
_BATCH_BYTES = 256 << 20
_BATCH_FILES = 8


def _batches(files: dict[str, int]) -> list[list[str]]:
    out: list[list[str]] = [[]]
    size = 0
    for name, n in files.items():
        if out[-1] and (size + n > _BATCH_BYTES or len(out[-1]) >= _BATCH_FILES):
            out.append([])
            size = 0
        out[-1].append(name)
        size += n
    return [b for b in out if b]


def verify_step(tier: Tier, step: int, threads: int | None = None,
                progress: Callable[[int], None] | None = None) -> tuple[int, int]:
    """Check every checksum of ``step`` on ``tier``, for every rank the marker lists.

    Returns ``(bytes checked, manifests checked)``; raises a TierfsError/OSError naming the first
    problem (``<manifest>: checksum mismatch in '<entry>' ...``).
    """
    from .store import _verify

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
            for names in _batches(manifest.files):
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


# -- entry point ------------------------------------------------------------------------------------

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
    parser = _Parser(prog=PROG, description="Inspect and check tierfs checkpoints. Read-only: never "
                                            "deletes or changes a step.")
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
    p.add_argument("-j", "--threads", type=int, metavar="N", help="checksum threads (default: up to 4)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: shown on a terminal)")
    p.set_defaults(func=cmd_verify)
    return parser


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
