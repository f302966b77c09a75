"""A process's node number (its failure domain) from the environment: ``TIERFS_NODE_RANK``, else torchrun's
``GROUP_RANK``, else ``rank // LOCAL_WORLD_SIZE``, else 0 (see :mod:`tierfs.ranks.groups`)."""

from __future__ import annotations

import os
from typing import Mapping


def env_node_rank(rank: int) -> int:
    """This process's node number from the environment (see the module docstring)."""
    var = env_node_source()
    if var in ("TIERFS_NODE_RANK", "GROUP_RANK"):
        return int(os.environ[var])
    local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return rank // int(local) if local else 0


#: the variables a node number is taken from, first set first: a node's index (tierfs's own, torchrun's),
#: else ``rank // LOCAL_WORLD_SIZE``
NODE_VARS = ("TIERFS_NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE")


def env_node_source(env: Mapping[str, str] | None = None) -> str:
    """Where :func:`env_node_rank` takes the node number from (in ``env``, default this process's
    environment): the variable's name, or ``"default"``."""
    env = os.environ if env is None else env
    for var in NODE_VARS:
        if env.get(var, "").strip():
            return var
    return "default"
