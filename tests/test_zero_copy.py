"""Zero-copy restores are read-only, and what they map is never rewritten: in the writer's process, and in a
reader process while the writer saves on (tests/children/zero_copy_child.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tierfs import StateMismatchError, TieredStore, TierfsError
from tierfs.format import step_dirname
from tierfs.policies import LatestN
from tierfs.tiers import MemoryTier

from _commandchild import CommandChild
from zero_copy_child import digest, sneak, state_for, tries

#: what each write of ``zero_copy_child.tries`` raises
REFUSED = {k: "TierfsError" if k.startswith("torch") and k != "torch numpy" else "ValueError" for k in [
    "torch add_", "torch setitem", "torch +=", "torch out=", "torch copy_", "torch view zero_", "torch init",
    "torch numpy", "torch bf16 fill_", "numpy setitem", "numpy slice", "numpy out="]}


def files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def inodes(root: Path) -> set[int]:
    """The inodes of every file below ``root`` (steps and pools)."""
    return {os.stat(os.path.join(d, f)).st_ino for d, _, fs in os.walk(root) for f in fs}


def bins(step_dir: Path) -> set[int]:
    return {p.stat().st_ino for p in step_dir.glob("*.bin")}


class Reader(CommandChild):
    """tests/children/zero_copy_child.py over ``ram``: one JSON answer per command."""

    def __init__(self, ram: Path) -> None:
        super().__init__("zero_copy_child.py", str(ram))
        self.first = self.answer()


def test_a_reader_process_keeps_its_zero_copy_views_while_the_writer_saves_on(shm_dir):
    ram = Path(shm_dir) / "ram"
    tier = MemoryTier(ram, keep=LatestN(2))
    with TieredStore([tier]) as store:
        store.save(1, state_for(1))
        step1 = ram / step_dirname(1)
        committed, leased = files(step1), bins(step1)
        reader = Reader(ram)
        try:
            first = reader.first
            assert first["step"] == 1 and first["same"] and first["torch_type"] == "ReadOnlyTensor"
            assert first["tries"] == REFUSED
            assert first["sneaked"] == [1.0, 1.0]  # past the guards: the reader's own pages, not the file's
            assert files(step1) == committed
            store.verify(1, "ram")
            reused = tier.stats()["reused"]
            for s in range(2, 12):
                store.save(s, state_for(s))
            assert sorted(store.steps()) == [10, 11] and not step1.exists()
            assert not leased & inodes(ram), "a buffer of the leased step was recycled into a later save"
            assert tier.stats()["reused"] > reused  # other steps' buffers still are
            assert reader.ask("check") == {"same": True}
            # views dropped: the lease goes, and the next step the reader read is recycled as usual
            assert reader.ask("restore") == {"step": 11}
            assert reader.ask("drop") == {"dropped": True}
            step11 = bins(ram / step_dirname(11))
            for s in range(12, 14):
                store.save(s, state_for(s))
            assert step11 <= inodes(ram), "a step no view maps any longer was not recycled"
        finally:
            reader.close()


def test_zero_copy_views_in_the_writers_process_refuse_writes_and_keep_their_bytes(shm_dir):
    ram = Path(shm_dir) / "ram"
    with TieredStore([MemoryTier(ram, keep=LatestN(2))]) as store:
        store.save(1, state_for(1))
        step1 = ram / step_dirname(1)
        committed, mapped = files(step1), bins(step1)
        out, _ = store.restore(zero_copy=True)
        assert tries(out) == REFUSED
        assert sneak(out) == [1.0, 1.0]  # past the guards: private pages of this process
        assert files(step1) == committed
        store.verify(1, "ram")
        for s in range(2, 12):
            store.save(s, state_for(s))
        assert digest(out) == digest(state_for(1))
        assert not mapped & inodes(ram)


def test_a_zero_copy_tensor_is_read_only_in_everything_derived_from_its_memory(shm_dir):
    with TieredStore([MemoryTier(shm_dir)]) as store:
        store.save(1, {"t": torch.arange(12, dtype=torch.float32).reshape(3, 4)})
        t = store.restore(zero_copy=True)[0]["t"]
        for view in (t[1], t.T, t.detach(), t.view(-1), t.unbind(0)[2], t.data):
            with pytest.raises(TierfsError, match=r"'t' \(step 1\) is a read-only, zero-copy view.*clone\(\)"):
                view.mul_(2)
        with pytest.raises(TierfsError, match="zero-copy"):
            torch.nn.functional.relu(t, inplace=True)
        with pytest.raises(TierfsError, match="zero-copy"):
            torch._foreach_add_([t], 1)
        assert type(t + 1) is torch.Tensor and type(t.clone()) is torch.Tensor
        mine = t.clone()
        mine.add_(1)  # a copy of one's own is an ordinary tensor
        assert t.requires_grad_().requires_grad  # autograd's flags are not values
        model = torch.nn.Linear(4, 3)
        model.load_state_dict({"weight": t.detach(), "bias": torch.zeros(3)})  # read from, not written
        assert torch.equal(model.weight.detach(), torch.arange(12, dtype=torch.float32).reshape(3, 4))
        target = {"t": t.detach()}
        with pytest.raises(StateMismatchError, match="'t'.*read-only"):
            store.restore_into(target)
        assert np.array_equal(t.detach().numpy(), np.arange(12, dtype=np.float32).reshape(3, 4))
