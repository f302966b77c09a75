"""``tierfs status TARGET [--watch]``: where a job's checkpoints stand on each tier, read from the tiers
themselves (no server), from any node, while the job runs or after it ended.

Per tier: the newest committed step and its age, how many steps it is behind the newest any tier has (an
object tier's upload or a replication lagging), what is in flight (steps with files but no marker yet: a
save, an upload or a replication under way, its files and bytes so far and when it last wrote), and for a
tier of this machine's RAM, the processes using it (a running job). The copies a peer tier keeps for other
nodes, in the RAM tier's directory, are listed after it, one line per rank of this node. Where no process
uses the target's RAM tier, the job is not running on this node and a step in flight is one an interrupted
save left; the next store to open removes it.
``--watch`` prints it again every few seconds, in place, until interrupted. Nothing is changed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from ..util.readable import duration, size
from ..errors import TierfsError
from ..tiers.base import Tier
from ..tiers.capabilities import LocalFiles
from ..tiers.memory import MemoryTier
from . import UsageError, error
from .targets import add_target_args, select, storage_options_from_args, tiers_from_target


@dataclass
class InFlight:
    """A step with files on a tier but no marker yet."""

    step: int
    files: int
    bytes: int
    last_written: float | None  # seconds since the epoch; None where the store does not say


@dataclass
class TierStatus:
    """One tier, as ``status`` shows it."""

    name: str
    kind: str
    location: str
    newest: int | None = None
    committed: float | None = None  # when the newest step was committed (seconds since the epoch)
    behind: int | None = None  # steps behind the newest committed step of any tier
    in_flight: list[InFlight] = field(default_factory=list)
    users: list[int] | None = None  # processes using a local tier (None: not a local tier)
    error: str | None = None


def tier_status(tier: Tier) -> TierStatus:
    """Look at ``tier`` (reading only): its steps, the newest one's marker, the steps without one."""
    st = TierStatus(tier.name, tier.kind, tier.location)
    try:
        tier.check_readable()
        steps = tier.list_steps()
        committed = sorted(s for s, ok in steps.items() if ok)
        if committed:
            st.newest = committed[-1]
            st.committed = tier.read_marker(st.newest).committed
        for s in sorted(s for s, ok in steps.items() if not ok):
            try:
                sizes = tier.file_sizes(s)
            except FileNotFoundError:
                continue  # finished or removed meanwhile
            st.in_flight.append(InFlight(s, len(sizes), sum(sizes.values()), tier.last_written(s)))
        if tier.is_local and isinstance(tier, LocalFiles):  # a node's RAM: the job's processes map its files
            st.users = tier.live_users()
    except (TierfsError, OSError) as e:
        st.error = str(e)
    finally:
        tier.close()
    return st


#: the folders of a RAM tier where the peer tiers keep the copies a rank holds for other nodes
COPIES = {"peers": "PeerTier", "erasure": "ErasureCodedTier"}


def with_copies(tiers: list[Tier]) -> list[tuple[Tier, str]]:
    """``tiers`` with their kinds, each RAM tier followed by the copies its ranks keep for other nodes (a
    peer tier's, in the RAM tier's directory: ``<ram>/peers/rank_<r>``), each as a tier of its own."""
    out: list[tuple[Tier, str]] = []
    for t in tiers:
        out.append((t, t.kind))
        if isinstance(t, MemoryTier):
            for folder, kind in COPIES.items():
                for d in sorted((t.path / folder).glob("rank_*")) if (t.path / folder).is_dir() else []:
                    out.append((MemoryTier(d, name=f"{t.name}/{folder}/{d.name}"), f"{kind} copies for other nodes"))
    return out


def job_status(tiers: list[Tier]) -> list[TierStatus]:
    """Every tier's status (and of the copies kept for other nodes: their replication), with how far each is
    behind the newest committed step of any."""
    out = []
    for t, kind in with_copies(tiers):
        out.append(tier_status(t))
        out[-1].kind = kind
    top = max((s.newest for s in out if s.newest is not None), default=None)
    for s in out:
        if top is not None and s.error is None:
            s.behind = top - s.newest if s.newest is not None else None
    return out


def running(statuses: list[TierStatus]) -> bool | None:
    """Whether a job uses the target's local tiers now (None: the target has none to tell by)."""
    local = [s.users for s in statuses if s.users is not None]
    return any(local) if local else None


def _ago(t: float | None, now: float) -> str:
    return "at an unknown time" if t is None else f"{duration(max(0.0, now - t))} ago"


def lines(statuses: list[TierStatus], now: float) -> list[str]:
    """The report, a line per tier."""
    live = running(statuses)
    out = []
    for s in statuses:
        head = f"tier {s.name} ({s.kind}, {s.location}): "
        if s.error is not None:
            out.append(head + f"cannot be read ({s.error})")
            continue
        parts = [f"step {s.newest}, committed {_ago(s.committed, now)}" if s.newest is not None else "no committed step"]
        if s.behind:
            parts[0] += f", {s.behind} step{'s' if s.behind != 1 else ''} behind"
        for f in s.in_flight:
            what = "in flight" if live is not False else "left by an interrupted save (removed when a store opens)"
            parts.append(f"step {f.step} {what}: {f.files} files, {size(f.bytes)} so far, last written "
                         f"{_ago(f.last_written, now)}")
        if s.users is not None:
            parts.append(f"in use by {len(s.users)} process(es) (pid {', '.join(map(str, s.users[:8]))}"
                         f"{', ...' if len(s.users) > 8 else ''}): a job is running" if s.users else
                         "no process uses it: no job is running on this node")
        out.append(head + "; ".join(parts))
    return out


def cmd_status(args: argparse.Namespace, clock: Callable[[], float] = time.time) -> int:
    """``tierfs status``: print the report (again every ``--watch`` seconds, in place); 1 if a tier
    cannot be read."""
    opts = storage_options_from_args(args)
    if args.watch is not None and (args.json or not args.watch > 0):
        raise UsageError("--watch takes a positive number of seconds, and not --json")

    def once() -> list[TierStatus]:
        return job_status(select(tiers_from_target(args.target, opts), args.tier))

    if args.watch is None:
        statuses = once()
        if args.json:
            print(json.dumps({"time": clock(), "running": running(statuses),
                              "tiers": [asdict(s) for s in statuses]}, indent=1))
        else:
            print("\n".join(lines(statuses, clock())))
        for s in statuses:
            if s.error is not None:
                error(f"tier {s.name!r}: {s.error}")
        return 1 if any(s.error is not None for s in statuses) else 0
    try:
        while True:
            statuses = once()
            now = clock()
            sys.stdout.write("\x1b[H\x1b[2J" if sys.stdout.isatty() else "\n")
            print(f"tierfs status {args.target}  {time.strftime('%H:%M:%S', time.localtime(now))} "
                  f"(every {args.watch:g} s; Ctrl-C ends)")
            print("\n".join(lines(statuses, now)), flush=True)
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


def add_commands(sub: Any) -> None:
    """Register ``status`` with the ``tierfs`` parser's subparsers."""
    p = sub.add_parser("status", help="where a job's checkpoints stand on each tier", description=(
        "Per tier: the newest committed step and its age, how many steps it is behind, the steps in "
        "flight (files but no marker yet) and, for a RAM tier, the processes using it. Reads the tiers "
        "themselves, from any node, while the job runs; changes nothing."))
    add_target_args(p)
    p.add_argument("--watch", type=float, nargs="?", const=5.0, metavar="SECONDS",
                   help="print it again every SECONDS (default 5), in place, until interrupted")
    p.add_argument("--json", action="store_true", help="print the status as JSON (not with --watch)")
    p.set_defaults(func=cmd_status)
