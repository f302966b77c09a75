"""An object tier's first look at its store: the bucket is there and the credentials work, or one line
saying which is wrong (a local directory: private to the job and readable)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..util.fileio import make_private_dir
from ..util.retry import retry, short
from .rootdir import check_root
from ..errors import TierUnavailableError

#: protocols whose "bucket" is a local directory
LOCAL = ("file", "local")


def probe(fs: Any, protocol: str, root: str, url: str, label: str, patience: float) -> None:
    """Fail now, in one line, if the bucket is missing or the credentials are wrong (a local root: create it,
    private to the job). The client has retried already: fail fast, but wait out a store refusing requests
    for the rate, up to ``patience`` seconds."""
    bucket = root.split("/", 1)[0]
    try:
        if protocol in LOCAL:
            check_root(Path(root), "ObjectTier url")
            make_private_dir(root)
        elif protocol not in ("memory",) and bucket:
            # info(), not exists(): exists() turns a refused connection into "missing"
            retry(lambda: fs.info(bucket), attempts=1, what="probe the bucket", label=label, patience=patience)
    except FileNotFoundError:
        raise TierUnavailableError(
            f"object tier {url}: bucket {bucket!r} does not exist; create it or fix the URL") from None
    except PermissionError as e:
        raise TierUnavailableError(
            f"object tier {url}: access denied ({short(e)}); check credentials in storage_options "
            "or the environment") from None
    except TierUnavailableError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to reach the store becomes one clear line
        raise TierUnavailableError(f"object tier {url}: cannot reach the store ({short(e)})") from None


def check_local_readable(root: str, name: str) -> None:
    """Raise TierUnavailableError unless local directory ``root`` can be read; create nothing."""
    if not os.path.isdir(root):
        raise TierUnavailableError(f"tier {name!r}: {root} is not a directory")
    if not os.access(root, os.R_OK | os.X_OK):
        raise TierUnavailableError(f"tier {name!r}: {root} is not readable")
