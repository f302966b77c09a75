"""``tierfs ls`` and ``tierfs verify``: look at the steps on each tier, changing nothing.

Both work on the tiers directly (never a ``TieredStore``, whose start-up removes uncommitted steps) and
only check that a tier can be read (:meth:`Tier.check_readable`): a missing directory is reported, not
created.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..util.readable import duration, rate, size
from ..errors import ChecksumError, FormatError, TierfsError
from ..protocol import step_manifests
from ..tiers.base import Tier
from . import error
from .display import add_no_progress, add_threads, progress_bar, step_bytes
from .steps import verify_shard_naming_damage
from .targets import add_target_args, describe, select, storage_options_from_args, tiers_from_target

# -- ls ---------------------------------------------------------------------------------------------


@dataclass
class StepRow:
    """One step directory on a tier, as ``ls`` lists it."""

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


def _print_rows(rows: list[StepRow]) -> None:
    table = [("STEP", "STATE", "FILES", "SIZE", "WORLD", "COMMITTED")]
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.committed)) if r.committed else "-"
        table.append((str(r.step), r.state, str(r.files), size(r.nbytes),
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


def cmd_ls(args: argparse.Namespace) -> int:
    """``tierfs ls``: a table of steps per tier; 1 if a tier cannot be read."""
    tiers = select(tiers_from_target(args.target, storage_options_from_args(args)), args.tier)
    status = 0
    newest: dict[str, int | None] = {}
    for i, tier in enumerate(tiers):
        if i:
            print()
        print(f"tier {describe(tier)}")
        try:
            tier.check_readable()
            rows = list_tier(tier)
        except (TierfsError, OSError) as e:
            error(f"tier {tier.name!r}: {e}")
            status = 1
            continue
        finally:
            tier.close()
        newest[tier.name] = max((r.step for r in rows if r.state == "committed"), default=None)
        if rows:
            _print_rows(rows)
        else:
            print("  (no steps)")
    _print_lag(newest)
    return status


def _steps(n: int) -> str:
    return f"{n} step" + ("" if n == 1 else "s")


def _print_lag(newest: dict[str, int | None]) -> None:
    """With several tiers: each one's newest committed step, and how far behind the newest it is (a
    slower tier's copy lagging: uploads in flight, throttled, or failing)."""
    top = max((s for s in newest.values() if s is not None), default=None)
    if len(newest) < 2 or top is None:
        return
    parts = [f"{n} {'-' if s is None else s}" + ("" if s == top else " (no step)" if s is None else
                                                  f" ({_steps(top - s)} behind)") for n, s in newest.items()]
    print(f"\nnewest committed step: {', '.join(parts)}")


# -- verify -----------------------------------------------------------------------------------------

def verify_step(tier: Tier, step: int, threads: int | None = None,
                progress: Callable[[int], None] | None = None) -> tuple[int, int]:
    """Check every checksum of ``step`` on ``tier``, for every rank the marker lists.

    Parameters
    ----------
    tier : Tier
        A readable tier holding the step committed.
    step : int
        The step.
    threads : int, optional
        Checksum threads.
    progress : callable, optional
        Called with the bytes of each batch checked.

    Returns
    -------
    tuple of int
        ``(bytes checked, manifests checked)``.

    Raises
    ------
    TierfsError, OSError
        The first problem. A damaged block names its shard file, its bytes in that file and the user's
        key (``step 7 rank 0 on ram: rank_00000.0003.bin bytes 1048576-2097152, part of 'model.0.weight'
        (the chunk at 0,0): checksum mismatch ...``, :func:`.steps.verify_shard_naming_damage`); a
        truncated or missing shard file starts with the rank.
    """
    _, _, manifests = step_manifests(tier, step)
    checked = sum(len(mbytes) for _, mbytes, _ in manifests)
    for _, _, manifest in manifests:
        try:
            checked += verify_shard_naming_damage(tier, step, manifest, threads=threads, progress=progress)
        except ChecksumError:
            raise  # already names the step, the rank, the tier, the file and its bytes
        except (TierfsError, OSError) as e:
            raise type(e)(f"step {step} rank {manifest.rank} on {tier.name}: {e}") from e
    return checked, len(manifests)


def _step_to_verify(args: argparse.Namespace, label: str, steps: dict[int, bool]) -> tuple[int | None, bool]:
    """The step to check on a tier listing ``steps``; else None, having printed why, and whether that is a
    failure (a step asked for with ``--tier`` that the tier lacks)."""
    if args.step is None:
        committed = sorted(s for s, ok in steps.items() if ok)
        if not committed:
            print(f"{label}: no committed step, nothing to verify")
            return None, False
        return committed[-1], False
    if steps.get(args.step):
        return args.step, False
    why = "is partial (no commit marker)" if args.step in steps else "is not on this tier"
    if args.tier is None:
        print(f"{label}: step {args.step} {why}, skipped")
        return None, False
    print(f"{label}: FAILED: step {args.step} {why}")
    return None, True


def _verify_tier(args: argparse.Namespace, tier: Tier) -> str:
    """Check one tier; prints its line and returns ``"ok"``, ``"failed"`` or ``"skipped"``."""
    label = f"{tier.name} ({tier.kind})"
    try:
        tier.check_readable()
        steps = tier.list_steps()
    except (TierfsError, OSError) as e:
        print(f"{label}: FAILED: cannot read the tier: {' '.join(str(e).split())}")
        return "failed"
    step, failed = _step_to_verify(args, label, steps)
    if step is None:
        return "failed" if failed else "skipped"
    bar: Any = progress_bar(step_bytes(tier, step), f"verify {tier.name} step {step}", args)
    t0 = time.perf_counter()
    try:
        nbytes, nman = verify_step(tier, step, args.threads, bar.update if bar else None)
    except (TierfsError, OSError) as e:
        msg = " ".join(str(e).split())
        print(f"{label}: FAILED: {msg if msg.startswith(f'step {step} ') else f'step {step}: {msg}'}")
        return "failed"
    finally:
        if bar is not None:
            bar.close()
    dt = time.perf_counter() - t0
    ranks = f"{nman} rank{'s' if nman != 1 else ''}"
    print(f"{label}: step {step}: OK  {size(nbytes)} checked ({ranks}) in {duration(dt)}, {rate(nbytes, dt)}")
    return "ok"


def cmd_verify(args: argparse.Namespace) -> int:
    """``tierfs verify``: OK or FAILED per tier; 1 if any failed or nothing was checked."""
    tiers = select(tiers_from_target(args.target, storage_options_from_args(args)), args.tier)
    results = []
    for tier in tiers:
        try:
            results.append(_verify_tier(args, tier))
        finally:
            tier.close()
    if "failed" in results:
        return 1
    if "ok" not in results:
        error("nothing was verified: no tier holds "
              + ("a committed step" if args.step is None else f"a committed step {args.step}"))
        return 1
    return 0


# -- the subcommands --------------------------------------------------------------------------------

def add_commands(sub: Any) -> None:
    """Register ``ls`` and ``verify`` with the ``tierfs`` parser's subparsers."""
    p = sub.add_parser("ls", help="list the steps on each tier", description=(
        "List every step directory on each tier: committed or partial (no commit marker: an interrupted "
        "or still running save), number of files, total size, and the world size and commit time the "
        "marker records. Partial steps are shown, never removed."))
    add_target_args(p)
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("verify", help="check every checksum of a step", description=(
        "Check a step on each tier: the commit marker, the crc32c of every rank's manifest it lists, and "
        "the crc32c of every block of every array. Prints OK or FAILED per tier; exits 1 if any failed."))
    add_target_args(p)
    p.add_argument("--step", type=int, metavar="N",
                   help="the step to check (default: each tier's newest committed step)")
    add_threads(p)
    add_no_progress(p)
    p.set_defaults(func=cmd_verify)
