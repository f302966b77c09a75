"""Run by test_zero_copy.py: a process that only reads a RAM tier another process saves to.

It restores the newest step with ``zero_copy=True``, tries to write into the views (every try must raise),
writes past the guards into two scratch entries (the writes must stay in this process), and holds the
views while the writer goes on. Commands come on stdin, one per line; each answer is one JSON line.

    check    whether the views still hold the restored step's values, bit for bit
    restore  restore the newest step once more (zero-copy), holding those views too
    drop     let go of every view
"""

from __future__ import annotations

import gc
import hashlib
import json
import sys
from typing import Any, Callable

import numpy as np
import torch

from tierfs import TieredStore
from tierfs.state import flatten
from tierfs.tiers import MemoryTier


def state_for(step: int) -> dict[str, Any]:
    """A state with torch tensors (float32, bfloat16, a 0-d one) and numpy arrays over several pages."""
    g = torch.Generator().manual_seed(step)
    rng = np.random.default_rng(step)
    return {"model": {"w": torch.randn(300, 257, generator=g), "b": torch.full((7,), float(step)),
                      "h": torch.randn(640, generator=g).to(torch.bfloat16), "s": torch.tensor(step * 1.5)},
            "opt": {"m": rng.standard_normal(50_000).astype(np.float32), "i": np.arange(step, step + 10)},
            "scratch": {"t": torch.zeros(5000), "n": np.zeros(5000)},
            "step": step}


def raw(x: Any) -> bytes:
    """The bytes of an array or tensor (any dtype)."""
    if isinstance(x, torch.Tensor):
        return bytes(x.reshape(-1).view(torch.uint8).numpy().tobytes()) if x.dim() else raw(x.reshape(1))
    return x.tobytes() if isinstance(x, np.ndarray) else json.dumps(x).encode()


def digest(state: dict[str, Any]) -> dict[str, str]:
    """Each entry's sha256 but the scratch entries'."""
    return {k: hashlib.sha256(raw(v)).hexdigest() for k, v in flatten(state) if not k.startswith("scratch")}


def tries(out: dict[str, Any]) -> dict[str, str]:
    """Writes into the views, each by an ordinary route: the name of the error each one raised."""
    t, n = out["model"]["w"], out["opt"]["m"]

    def setitem() -> None:
        t[0, 0] = 1.0

    def iadd() -> None:
        nonlocal t
        t += 1

    def np_setitem() -> None:
        n[0] = 1.0

    ways: dict[str, Callable[[], Any]] = {
        "torch add_": lambda: t.add_(1), "torch setitem": setitem, "torch +=": iadd,
        "torch out=": lambda: torch.mul(t, 2, out=t), "torch copy_": lambda: t.copy_(torch.zeros_like(t)),
        "torch view zero_": lambda: t.view(-1)[:3].zero_(), "torch init": lambda: torch.nn.init.normal_(t),
        "torch numpy": lambda: t.numpy().__setitem__((0, 0), 1.0), "torch bf16 fill_": lambda: out["model"]["h"].fill_(0),
        "numpy setitem": np_setitem, "numpy slice": lambda: n[:10].__setitem__(slice(None), 0.0),
        "numpy out=": lambda: np.add(n, 1, out=n),
    }
    got = {}
    for name, fn in ways.items():
        try:
            fn()
            got[name] = "no error"
        except Exception as e:  # noqa: BLE001 - reported to the test
            got[name] = type(e).__name__
    return got


def sneak(out: dict[str, Any]) -> list[float]:
    """Write past the guards into the scratch entries; what this process sees afterwards."""
    t, n = out["scratch"]["t"], out["scratch"]["n"]
    with torch._C.DisableTorchFunctionSubclass():
        t.add_(1)
    n.flags.writeable = True
    n += 1
    return [float(t[0]), float(n[0])]


def main() -> None:
    store = TieredStore([MemoryTier(sys.argv[1])], cleanup=False)
    out, _ = store.restore(zero_copy=True)
    step = out["step"]
    held = [out]
    print(json.dumps({"step": step, "same": digest(out) == digest(state_for(step)), "tries": tries(out),
                      "sneaked": sneak(out), "torch_type": type(out["model"]["w"]).__name__}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "check":
            print(json.dumps({"same": digest(out) == digest(state_for(step))}), flush=True)
        elif cmd == "restore":
            again, _ = store.restore(zero_copy=True)
            held.append(again)
            print(json.dumps({"step": again["step"]}), flush=True)
        elif cmd == "drop":
            held.clear()
            out = again = None  # type: ignore[assignment]
            gc.collect()
            print(json.dumps({"dropped": True}), flush=True)
    store.close()


if __name__ == "__main__":
    main()
