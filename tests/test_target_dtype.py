"""``restore_into`` a torch tensor of another dtype is a StateMismatchError naming the key and both dtypes,
as for numpy; never a silent conversion (also in a process that read the checkpoint before it imported
torch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from tierfs import StateMismatchError, TieredStore
from tierfs.tiers import MemoryTier

SAVED = {"w": torch.arange(6, dtype=torch.float32), "big": torch.ones(300_000, dtype=torch.bfloat16)}


@pytest.mark.parametrize("key, target", [
    ("w", torch.zeros(6, dtype=torch.float64)),
    ("w", torch.nn.Parameter(torch.zeros(6, dtype=torch.float16))),
    ("big", torch.zeros(300_000, dtype=torch.float16)),
    ("w", np.zeros(6, np.float64)),
])
def test_a_target_of_another_dtype_is_an_error_naming_both(shm_dir, key, target):
    with TieredStore([MemoryTier(shm_dir)]) as store:
        store.save(1, SAVED)
        before = target.detach().clone() if isinstance(target, torch.Tensor) else target.copy()
        want = str(SAVED[key].dtype).removeprefix("torch.")
        have = str(target.dtype).removeprefix("torch.")
        with pytest.raises(StateMismatchError, match=rf"'{key}': the target has dtype {have} .* the checkpoint {want}"):
            store.restore_into({key: target})
        assert (torch.equal(target.detach(), before) if isinstance(target, torch.Tensor)
                else np.array_equal(target, before))


def test_a_process_that_imports_torch_after_reading_the_checkpoint_converts_nothing(shm_dir):
    with TieredStore([MemoryTier(shm_dir)]) as store:
        store.save(1, SAVED)
    code = textwrap.dedent("""
        import json, sys
        import numpy as np
        from tierfs import TieredStore
        from tierfs.tiers import MemoryTier
        out = []
        with TieredStore([MemoryTier(sys.argv[1])], cleanup=False) as store:
            assert "torch" not in sys.modules
            target = {"w": np.zeros(6, np.float32)}
            store.restore_into(target)  # the manifest is read before torch is imported
            out.append(target["w"].tolist())
            import torch
            for t in (torch.zeros(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float32)):
                try:
                    store.restore_into({"w": t})
                    out.append(["restored", str(t.dtype), t.tolist()])
                except Exception as e:
                    out.append([type(e).__name__, str(e)])
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", code, shm_dir], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TIERFS_TEST_SPAWN": "exec"})  # a fresh interpreter: no torch yet
    assert proc.returncode == 0, proc.stderr
    numpy_first, other, same = json.loads(proc.stdout.splitlines()[-1])
    assert numpy_first == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert other[0] == "StateMismatchError" and "'w'" in other[1] and "float64" in other[1] and "float32" in other[1]
    assert same == ["restored", "torch.float32", [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]
