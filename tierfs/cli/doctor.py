"""``tierfs doctor [TARGET]``: check a node before a job is launched on it.

Each check prints one line, ``✔`` and what it found, or ``✘``, what is wrong and the fix; the exit status
is 1 when any check failed, and ``--json`` prints the same as data. The checks:

- **torch**: installed, at least the version tierfs needs, and its CUDA build and devices;
- **node identity**: the variable tierfs takes the node's number from (``TIERFS_NODE_RANK``, or torchrun's
  ``GROUP_RANK``/``LOCAL_WORLD_SIZE``); without one every process counts as node 0's, which is right on one
  node only;
- **RAM tier space**, per RAM tier of TARGET (or ``--ram DIR``): the file system's size and free space
  against the tier's budget, and against what its policies need for ``--state-size`` per node (the figures
  ``tierfs plan`` uses: the kept steps, one in flight, 15% headroom);
- **locked memory** (``RLIMIT_MEMLOCK``), where a CUDA device is: page-locking the RAM tier makes device
  copies fast;
- **open files** (``RLIMIT_NOFILE``) against what a rank holds: tierfs's 39 sockets at most, one per peer rank with
  gloo (``--world-size``), and what the training process itself opens;
- **object store**, per object tier: a probe object written, read back bit-exact and deleted under the
  tier's prefix (each step a permission the job needs), and the clock's skew against the store's.

Nothing else is written, and the probe object is removed whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from ..ranks.nodenumbers import env_node_source
from ..util.readable import size
from ..tiers.base import Tier
from ..tiers.memory import MemoryTier
from ..tiers.object import ObjectTier
from .numbers import parse_bytes
from .targets import add_target_args, select, storage_options_from_args, tiers_from_target

#: the oldest torch tierfs works with
TORCH_MIN = (2, 6)
#: sockets tierfs's groups hold per rank (``docs/performance.md#scale``)
TIERFS_SOCKETS = 39
#: files a training process opens besides tierfs's and gloo's: data loader workers, libraries, logs
PROCESS_FILES = 4096
#: skew against the store's clock beyond which commit times and ages are off (S3 refuses past 15 minutes)
SKEW_LIMIT = 60.0


@dataclass
class Check:
    """One line of the report."""

    check: str
    ok: bool
    detail: str
    fix: str = ""

    def line(self) -> str:
        return f"✔ {self.check}: {self.detail}" if self.ok else f"✘ {self.check}: {self.detail}; fix: {self.fix}"


def check_torch() -> Check:
    try:
        import torch
    except ImportError:
        return Check("torch", False, "not installed",
                     "pip install 'tierfs[torch]' (torch >= 2.6; the CPU build from "
                     "https://download.pytorch.org/whl/cpu on a machine without a GPU)")
    version = torch.__version__
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    if parts < TORCH_MIN:
        return Check("torch", False, f"{version} is older than tierfs needs", "pip install 'torch>=2.6'")
    if getattr(torch.version, "cuda", None) and torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        return Check("torch", True, f"{version}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s) "
                                    f"({', '.join(names)})")
    cuda = getattr(torch.version, "cuda", None)
    build = f"CUDA {cuda} build, no device visible" if cuda else "CPU build"
    return Check("torch", True, f"{version} ({build})")


def check_node_identity(env: dict[str, str]) -> Check:
    var = env_node_source(env)  # the variable the store will take the node number from
    value = env.get(var, "").strip()
    if var in ("TIERFS_NODE_RANK", "GROUP_RANK"):
        if not value.isdigit():
            return Check("node identity", False, f"{var}={value!r} is not a node number",
                         f"set {var} to this node's index, 0 to the number of nodes - 1")
        return Check("node identity", True, f"node {int(value)} ({var})")
    if var == "LOCAL_WORLD_SIZE" and value.isdigit() and int(value) > 0:
        return Check("node identity", True, f"rank // {value} (torchrun's LOCAL_WORLD_SIZE)")
    slurm = env.get("SLURM_NODEID")
    hint = f" (this is Slurm node {slurm}: TIERFS_NODE_RANK=$SLURM_NODEID)" if slurm else ""
    return Check("node identity", False, "no TIERFS_NODE_RANK, GROUP_RANK or LOCAL_WORLD_SIZE: every process "
                 "would count as node 0's, so peers could hold copies on the same node",
                 f"export TIERFS_NODE_RANK=<this node's index>{hint}, or launch with torchrun, which sets GROUP_RANK")


def _existing(path: Path) -> Path:
    """``path``, or its nearest ancestor that exists (a RAM directory is made when the job starts)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def _fs_type(path: Path) -> str:
    """The type of the file system ``path`` is on (from /proc/mounts; ``?`` where unknown)."""
    best, kind, here = "", "?", str(path.resolve())
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) > 2]
    except OSError:
        return kind
    for point, fstype in mounts:
        inside = here == point or here.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fstype
    return kind


def check_ram(tier: MemoryTier, state: float | None) -> Check:
    """The RAM tier's file system against its budget and what its policies need for ``state`` per node."""
    where = _existing(Path(tier.path))
    sv = os.statvfs(where)
    total, free = sv.f_blocks * sv.f_frsize, sv.f_bavail * sv.f_frsize
    used = tier.capacity().used if Path(tier.path).exists() else 0  # its own steps: freed for the next ones
    room = free + used
    kind = _fs_type(where)
    name = f"RAM tier {tier.name} ({tier.path}, {kind})"
    resize = ("resize it (mount -o remount,size=<bytes> /dev/shm; docker --shm-size; Kubernetes: an emptyDir "
              "with medium: Memory and a sizeLimit)")
    if tier.budget is not None and tier.budget > room:
        return Check(name, False, f"the budget {size(tier.budget)} is more than the {size(room)} free",
                     f"lower the tier's budget to at most {size(room)}, or {resize}")
    if state is not None:
        from ..planning.formulas import ram_per_host

        keep = getattr(tier.keep_policy, "n", 2)
        need = ram_per_host(state, 1, keep=int(keep)).total
        if need > room:
            return Check(name, False, f"{size(need)} needed for {size(state)} of state per node ({keep} kept, one "
                         f"in flight, 15% headroom) but {size(room)} free", f"{resize}, or keep fewer steps in RAM")
        fits = f"; {size(need)} needed for {size(state)} per node"
    else:
        fits = " (give --state-size to check it against what the saves need)"
    note = "" if kind in ("tmpfs", "ramfs", "?") else f"; on {kind}, not tmpfs: saves go at that disk's speed"
    return Check(name, True, f"{size(free)} free of {size(total)}{fits}{note}")


def _limit(v: int) -> str:
    return "unlimited" if v == resource.RLIM_INFINITY else str(v)


def check_memlock(cuda: bool) -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return Check("locked memory", True, "unlimited")
    if not cuda:
        return Check("locked memory", True, f"{size(soft)} (no CUDA device here: only device copies page-lock)")
    return Check("locked memory", False, f"RLIMIT_MEMLOCK is {size(soft)}: the RAM tier cannot be page-locked, so "
                 "device copies go through pageable memory (slower)",
                 "ulimit -l unlimited (docker --ulimit memlock=-1; Slurm: PropagateResourceLimits or "
                 f"--propagate=MEMLOCK; the hard limit here is {_limit(hard)})")


def check_open_files(world: int) -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = TIERFS_SOCKETS + world + PROCESS_FILES
    if soft == resource.RLIM_INFINITY or soft >= need:
        return Check("open files", True, f"{_limit(soft)} per process (a rank needs about {need}: tierfs "
                                         f"{TIERFS_SOCKETS}, gloo {world}, the process {PROCESS_FILES})")
    fix = (f"ulimit -n {need}" if hard == resource.RLIM_INFINITY or hard >= need else
           f"raise the hard limit to at least {need} (/etc/security/limits.conf, systemd LimitNOFILE, docker "
           "--ulimit nofile=...)")
    return Check("open files", False, f"{soft} per process; a rank of a {world}-rank job needs about {need}", fix)


def check_object(tier: ObjectTier, clock: Callable[[], float] = time.time) -> Check:
    """Write, read back and delete a probe object under the tier's prefix; the store's clock against ours."""
    from ..tiers._listing import mtime

    name = f"object tier {tier.name} ({tier.url})"
    fs, key = tier.fs, f"{tier.root}/.tierfs-doctor-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    data = secrets.token_bytes(64)
    step = "write"
    try:
        if tier.protocol in ("file", "local"):
            os.makedirs(tier.root, mode=0o700, exist_ok=True)
        t0 = clock()
        fs.pipe_file(key, data)
        t1 = clock()
        step = "read"
        fs.invalidate_cache(key)
        if bytes(fs.cat_file(key)) != data:
            return Check(name, False, "the probe object read back differs from what was written",
                         "check the store (a proxy or cache rewriting objects?)")
        info = fs.info(key)
        step = "delete"
        fs.rm_file(key)
        fs.invalidate_cache(key)
        if fs.exists(key):
            return Check(name, False, "the probe object is still there after its deletion",
                         "check the store's delete permission and versioning")
    except Exception as e:  # noqa: BLE001 - any failure is this check's line
        perm = {"write": "PutObject", "read": "GetObject", "delete": "DeleteObject"}[step]
        if step != "write":
            try:
                fs.rm_file(key)
            except Exception:  # noqa: BLE001 - best effort: the line below names the key
                pass
        why = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        return Check(name, False, f"cannot {step} under the prefix ({why})",
                     f"grant the job's credentials {step} permission on {tier.url}/* (S3: s3:{perm}; GCS: "
                     f"roles/storage.objectAdmin), check the URL and the endpoint"
                     + (f"; remove {key} by hand" if step == "delete" else ""))
    when = mtime(info)
    if when is None:
        return Check(name, True, "write, read and delete work (the store gives no time: skew unknown)")
    skew = when - t0 if when < t0 - 1 else when - t1 if when > t1 + 1 else 0.0
    if abs(skew) > SKEW_LIMIT:
        return Check(name, False, f"write, read and delete work, but this clock is {abs(skew):.0f} s "
                     f"{'ahead of' if skew < 0 else 'behind'} the store's (commit times and ages are off; S3 "
                     "refuses requests past 15 minutes)", "synchronise the clock (chrony or ntpd)")
    return Check(name, True, f"write, read and delete work; clock within {max(1.0, abs(skew)):.0f} s of the store's")


def run_checks(tiers: list[Tier], *, state: float | None, world: int, env: dict[str, str]) -> list[Check]:
    """Every check, in the order the report prints them."""
    out = [check_torch(), check_node_identity(env)]
    out += [check_ram(t, state) for t in tiers if isinstance(t, MemoryTier)]
    cuda = False
    try:
        import torch

        cuda = bool(torch.cuda.is_available())
    except ImportError:
        pass
    out += [check_memlock(cuda), check_open_files(world)]
    out += [check_object(t) for t in tiers if isinstance(t, ObjectTier)]
    return out


def cmd_doctor(args: argparse.Namespace) -> int:
    tiers: list[Tier] = []
    if args.target:
        tiers = select(tiers_from_target(args.target, storage_options_from_args(args)), args.tier)
    if args.ram and not any(isinstance(t, MemoryTier) for t in tiers):
        tiers.insert(0, MemoryTier(args.ram))
    env = dict(os.environ)
    world = args.world_size or int(env.get("WORLD_SIZE") or env.get("SLURM_NTASKS") or 1)
    try:
        checks = run_checks(tiers, state=args.state_size, world=world, env=env)
    finally:
        for t in tiers:
            t.close()
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=1))
    else:
        for c in checks:
            print(c.line())
    return 0 if all(c.ok for c in checks) else 1


def add_commands(sub: Any) -> None:
    """Register ``doctor`` with the ``tierfs`` parser's subparsers."""
    p = sub.add_parser("doctor", help="check a node before launching a job on it", description=(
        "Check this node for a job: torch and CUDA, the node identity variable, each RAM tier's space "
        "against its budget and --state-size, the locked-memory and open-files limits, and each object "
        "tier's write, read and delete permission and clock skew (a probe object, removed). One line per "
        "check; exit status 1 if any failed."))
    add_target_args(p, optional=True)
    p.add_argument("--ram", metavar="DIR", help="a RAM tier directory to check when TARGET has none "
                                                "(e.g. /dev/shm/tierfs/JOB)")
    p.add_argument("--state-size", type=parse_bytes, metavar="SIZE",
                   help="this node's share of one checkpoint (e.g. 160GB): checked against each RAM tier's space")
    p.add_argument("--world-size", type=int, metavar="N",
                   help="ranks in the job (default: WORLD_SIZE or SLURM_NTASKS): for the open-files limit")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(func=cmd_doctor)
