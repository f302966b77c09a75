"""The ``tierfs`` command: inspect, check, copy, clean and export checkpoints; plan and simulate.

    tierfs ls TARGET                                  steps per tier (committed or partial)
    tierfs verify TARGET [--step N] [--tier NAME]     check every checksum of a step
    tierfs status TARGET [--watch [S]]                each tier's newest step, its age, lag, what is in flight
    tierfs cp SRC [DST] [--step N] [--from T] [--to T]   copy a step, verified, marker last
    tierfs gc TARGET [--older-than DUR] [--force] [--dry-run]   retention now; stale partial steps
    tierfs export TARGET DIR --dcp [--step N]         a plain DCP checkpoint (FileSystemReader reads it)
    tierfs plan ...                                   RAM per host, intervals, goodput, bandwidth
    tierfs simulate ...                               Monte-Carlo of a training run under failures
    tierfs bench [--object URL -o ...]                measure the tiers here; plan/simulate read it
    tierfs doctor [TARGET] [--state-size SIZE]        check this node before launching a job on it

A TARGET is a RAM tier directory (/dev/shm/tierfs/job-42), an fsspec URL (s3://bucket/run, with
``-o endpoint_url=...``) or a JSON config listing tiers (format: :mod:`tierfs.config`). ``ls`` and
``verify`` only read: they work on the tiers directly and never build a ``TieredStore``, whose start-up
removes uncommitted steps; a step still being written, or that a crash left behind, is listed as
``partial`` and left alone.

The commands, by concern: :mod:`~tierfs.cli.targets` (a TARGET into tiers), :mod:`~tierfs.cli.inspect`
(ls, verify), :mod:`~tierfs.cli.status`, :mod:`~tierfs.cli.manage` (cp, gc, export; what they do to steps: :mod:`~tierfs.cli.steps`),
:mod:`~tierfs.cli.plan`, :mod:`~tierfs.cli.simulate`, :mod:`~tierfs.cli.bench` (its measurements:
:mod:`~tierfs.cli.measure`) and :mod:`~tierfs.cli.doctor`. Each registers its subcommands with ``add_commands``.

Exit status: 0 on success, 1 when a check fails or a tier cannot be read or written, 2 for a bad
command line (a bad argument, or a TARGET that cannot be a tier, such as a system directory). Errors are
one line on stderr: ``tierfs: error: ...``, never a traceback (``TIERFS_DEBUG=1`` shows the traceback
of an unexpected error).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn, Sequence

from ..util import args as _args
from ..errors import ArgumentError, TierfsError

PROG = "tierfs"


class UsageError(Exception):
    """Something wrong with the command line itself (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr: ``tierfs: error: ...``."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def error(msg: str) -> None:
    """Print ``tierfs: error: MSG`` on stderr, always on one line."""
    msg = " ".join(str(msg).split())
    print(f"{PROG}: error: {msg}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    """The ``tierfs`` parser with every subcommand; each parsed namespace has ``func(args) -> status``."""
    from .. import __version__
    from . import bench, doctor, inspect, manage, plan, simulate, status

    parser = _Parser(prog=PROG, description="Inspect, check, copy, clean up and export tierfs checkpoints; "
                                            "plan and simulate checkpointing for a training job. ls and "
                                            "verify only read.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for module in (inspect, status, manage, plan, simulate, bench, doctor):
        module.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``tierfs`` with ``argv`` (default: the process's arguments); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if getattr(args, "threads", None) is not None and args.threads < 1:
            raise UsageError("--threads must be at least 1")
        if getattr(args, "step", None) is not None:
            _args.step(args.step, "--step")
        return args.func(args)
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except (UsageError, ArgumentError) as e:
        error(str(e))
        return 2
    except (TierfsError, OSError) as e:
        error(str(e) or type(e).__name__)
        return 1
    except KeyboardInterrupt:
        error("interrupted")
        return 130
    except Exception as e:  # noqa: BLE001 - a bug: still one line, unless asked for the traceback
        if os.environ.get("TIERFS_DEBUG"):
            raise
        error(f"unexpected {type(e).__name__}: {e} (a bug in tierfs: please report it; TIERFS_DEBUG=1 shows the "
              "traceback)")
        return 1
