"""A digest of a nested state for multi-process tests: what a rank saved against what it restored."""

import hashlib

import torch


def state_digest(state) -> str:
    """sha256 over every full (unsharded) tensor (a DTensor's ``full_tensor``, a collective) and every other
    value of a nested state, keys sorted."""
    h = hashlib.sha256()

    def walk(x, path):
        if isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k], f"{path}.{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{path}.{i}")
        elif isinstance(x, torch.Tensor):
            full = x.full_tensor() if hasattr(x, "full_tensor") else x
            h.update(path.encode() + str(full.dtype).encode() + str(tuple(full.shape)).encode())
            h.update(full.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{path}={x!r}".encode())

    walk(state, "")
    return h.hexdigest()
