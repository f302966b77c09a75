"""Files of an object store in parts. A file larger than a part is read as concurrent ranged reads into one
buffer, so a restore moves exactly the file's bytes, once; it is uploaded in parts fitted to the store: an
S3 multipart upload (parts of at least 5 MiB, the smallest S3 accepts), a GCS resumable upload (chunks in
multiples of 256 KiB, as GCS asks), and whole in one request below two parts on both."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from .base import Bytes


#: the smallest part S3 accepts in a multipart upload (every part but the last)
S3_MIN_PART = 5 << 20
#: GCS resumable uploads take chunks in multiples of this
GCS_CHUNK = 256 << 10


def upload(protocol: str, size: int, part: int) -> tuple[dict[str, Any], int]:
    """How to upload ``size`` bytes through fsspec's ``pipe_file`` to a store of ``protocol`` in parts of
    about ``part`` bytes: its keyword arguments, and the requests it makes (what the tier's request budget
    is charged). One request below two parts, else a multipart (S3) or resumable (GCS) upload: its parts
    and two more (S3: start and completion; GCS: start, and a final chunk that may be the last part)."""
    if protocol in ("s3", "s3a"):
        part = max(part, S3_MIN_PART)
        return {"chunksize": part}, (1 if size < 2 * part else -(-size // part) + 2)
    if protocol in ("gs", "gcs"):
        part = -(-part // GCS_CHUNK) * GCS_CHUNK
        if size < 2 * part:  # gcsfs uploads below its chunksize in one request
            return {"chunksize": size + 1}, 1
        return {"chunksize": part}, -(-size // part) + 1
    return {}, 1


def whole_read(protocol: str) -> dict[str, Any]:
    """Keyword arguments for fsspec's ``cat_file`` reading a whole file in one request: s3fs otherwise asks
    for the file's size first (a HEAD per file) to read a large one in concurrent chunks, which
    :func:`download` already does with ranged reads."""
    return {"max_concurrency": 1} if protocol in ("s3", "s3a") else {}


def download(sizes: Mapping[str, int], names: list[str], part_size: int, read: Callable[[str], Bytes],
             read_range: Callable[[str, int, int], bytes], run: Callable[[Callable[[Any], None], list[Any]], Any],
             missing: Callable[[str], str]) -> dict[str, Bytes]:
    """``{name: bytes}`` of ``names`` (each of ``sizes`` bytes), a file at a time up to ``part_size`` bytes and in
    ranged parts above; ``run(fn, items)`` runs the requests (concurrently); a name not in ``sizes`` is a
    FileNotFoundError of ``missing(name)``."""
    parts: list[tuple[str, int, int]] = []
    out: dict[str, Bytes] = {}
    whole: dict[str, np.ndarray] = {}  # large files, filled part by part
    for n in names:
        if n not in sizes:
            raise FileNotFoundError(missing(n))
        size = sizes[n]
        if size <= part_size:
            parts.append((n, 0, -1))
        else:
            out[n] = whole[n] = np.empty(size, dtype=np.uint8)
            parts += [(n, s, min(size, s + part_size)) for s in range(0, size, part_size)]

    def fetch(part: tuple[str, int, int]) -> None:
        n, s, e = part
        if e < 0:
            out[n] = read(n)
            return
        data = read_range(n, s, e)
        if len(data) != e - s:
            raise OSError(f"short read of {n} bytes {s}-{e}: got {len(data)}")
        whole[n][s:e] = np.frombuffer(data, dtype=np.uint8)

    run(fetch, parts)
    return out
