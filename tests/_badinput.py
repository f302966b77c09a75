"""Helpers of the bad-input tests (test_bad_input.py, test_bad_input_cli.py): what a clear error is, small
states (numpy; a small ``torch.nn`` model with its Adam state), and a context that makes stores, a manager
and a ``tiered::`` filesystem on first use."""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from tierfs import CheckpointManager, CheckpointManagerOptions, TieredStore, TierfsError
from tierfs.adapters.dcp import TieredWriter
from tierfs.format import step_dirname
from tierfs.fs import TieredFileSystem
from tierfs.tiers import MemoryTier

ENTRY_SYNTAX = re.compile(r"(?:^|[\s'\"(\[,:])(?:\d+(?:,\d+)*|b|x)?\|")


def assert_clear(err: BaseException, cls: type, *needles: str) -> str:
    """``err`` is a tierfs error of class ``cls`` whose message is one line, holds every needle and no
    internal entry name; returns the message."""
    assert isinstance(err, TierfsError), f"not a tierfs error: {type(err).__name__}: {err}"
    assert isinstance(err, cls), f"expected {cls.__name__}, got {type(err).__name__}: {err}"
    msg = str(err)
    assert msg and "\n" not in msg, f"not one line: {msg!r}"
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    assert not ENTRY_SYNTAX.search(msg), f"internal entry name in {msg!r}"
    return msg


def small_state() -> dict[str, Any]:
    return {"w": np.arange(4.0), "layer": {"b": np.ones(3, np.float32)}, "lr": 0.1}


def model_state(n_in: int = 4) -> dict[str, Any]:
    """A small model's and its Adam optimizer's state (after one step), plus a plain value."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(n_in, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, n_in)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3}


class Ctx:
    """What a case needs, made on first use: stores with step 1 saved, a manager, a ``tiered::`` fs."""

    def __init__(self, shm: Path, tmp: Path) -> None:
        self.shm, self.tmp = shm, tmp
        self._open: list[Any] = []

    @cached_property
    def store(self) -> TieredStore:
        s = TieredStore([MemoryTier(self.shm / "ram")])
        s.save(1, small_state())
        self._open.append(s)
        return s

    @cached_property
    def manager(self) -> CheckpointManager:
        m = CheckpointManager([MemoryTier(self.shm / "mgr")],
                              options=CheckpointManagerOptions(enable_async_checkpointing=False))
        assert m.save(1, model_state())
        self._open.append(m)
        return m

    @cached_property
    def dcp_store(self) -> TieredStore:
        s = TieredStore([MemoryTier(self.shm / "dcp")])
        dcp.save(model_state()["model"], storage_writer=TieredWriter(s, 1))
        self._open.append(s)
        return s

    @cached_property
    def fs(self) -> TieredFileSystem:
        fs = TieredFileSystem(str(self.shm / "fsram"), fo=f"file://{self.tmp}/target", skip_instance_cache=True)
        self.root = f"{self.tmp}/target"
        return fs

    @cached_property
    def a_file(self) -> Path:
        p = self.shm / "a-file"
        p.write_bytes(b"not a directory")
        return p

    def close(self) -> None:
        for x in reversed(self._open):
            x.close()


def context(shm_dir: str, tmp_path: Path) -> Iterator[Ctx]:
    """A :class:`Ctx` in ``shm_dir`` and ``tmp_path``, closed after the test (for a ``ctx`` fixture)."""
    c = Ctx(Path(shm_dir), tmp_path)
    yield c
    c.close()



SYSTEM_DIRS = ["/", "/proc", "/proc/self", "/sys", "/sys/kernel", "/dev", "/dev/pts", "/etc", "/etc/ssl", "/usr",
               "/usr/lib", "/tmp", "/dev/shm", "/var", "/home"]

def flip_first_byte_of(tier_dir: Path, step: int) -> None:
    shard = tier_dir / step_dirname(step) / "rank_00000.0000.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
