"""What the checkpoint IO and the strategy share: the Lightning versions supported (a warning on others),
the manifest metadata key, and a checkpoint path's key."""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import lightning

log = logging.getLogger("tierfs")

SUPPORTED_LIGHTNING = ">=2.2,<2.7"
META_KEY = "lightning"  # manifest.metadata[META_KEY] = {"paths": [...], "global_step": ..., ...}

_ver = tuple(int(p) for p in re.findall(r"\d+", lightning.__version__)[:2])
if not ((2, 2) <= _ver < (2, 7)):
    log.warning("tierfs.adapters.lightning supports lightning %s; this is %s", SUPPORTED_LIGHTNING,
                lightning.__version__)


def norm(path: Any) -> str:
    """A checkpoint path's key: a URL as it is, a local path made absolute."""
    p = os.fspath(path)
    return p if "://" in p else os.path.abspath(p)
