"""A committed step's model tensors as a Hugging Face-style safetensors folder.

    from tierfs.adapters.safetensors import export_safetensors
    export_safetensors(store, "./hf-1200", 1200, prefix="model.", dtype="bfloat16", max_shard_size="5GB")
    # or from the command line: tierfs export TARGET ./hf-1200 --safetensors --step 1200 --prefix model.

The folder is what ``save_pretrained`` writes: ``model.safetensors`` when the tensors fit in one shard,
else ``model-00001-of-0000N.safetensors`` ... plus ``model.safetensors.index.json`` (``{"metadata":
{"total_size": bytes}, "weight_map": {name: file}}``), and ``config.json`` when a config is given.
``safetensors.torch.load_file`` and ``transformers``' ``from_pretrained`` read it.

Sharded steps (FSDP2/DTensor through DCP) are assembled into full tensors from every rank's chunks; each
byte is read through the store's verified path (:mod:`tierfs.adapters._steptensors` says which steps hold
which tensors). One output shard's tensors are in memory at a time. The files are written in the
safetensors format directly (an 8-byte header length, the JSON header, the tensors' bytes), one tensor
after another, to a local directory (each file under a temporary name, then renamed) or any fsspec URL;
the index, written last, says the folder is complete.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Mapping, Sequence

import torch

from ..util import args as _args
from ..util.fileio import atomic_write, shared_file_mode
from ..tiers.rootdir import check_local_url
from ..errors import ArgumentError, OutputExistsError, StepNotFoundError
from ..store import TieredStore
from ..tiers.base import AnyTier
from . import _steptensors as steptensors
from ._ties import check_ties, left_out
from .dcp.export import check_directory

log = logging.getLogger("tierfs")

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DEFAULT_MAX_SHARD_SIZE = "5GB"
#: safetensors' dtype names
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.complex64: "C64",
          torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64"}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B)?\s*$", re.I)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}
_SHARD = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")


@dataclass
class SafetensorsExport:
    """What :func:`export_safetensors` wrote: the step, the folder, the files, each tensor's file
    (``weight_map``, names as written) and the bytes of the tensors (``total_size``)."""

    step: int
    directory: str
    files: list[str]
    weight_map: dict[str, str]
    total_size: int
    tied: dict[str, str] = field(default_factory=dict)


def parse_size(value: Any, what: str = "max_shard_size") -> int:
    """Bytes from an int or a size as Hugging Face writes it: ``"5GB"`` (10**9), ``"500MiB"`` (2**20)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    m = _SIZE.match(value) if isinstance(value, str) else None
    if m is None or float(m.group(1)) <= 0:
        raise ArgumentError(f"{what} must be a positive number of bytes or a size such as '5GB' or '500MiB', got "
                            f"{_args.shown(value)}")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()])


def parse_dtype(value: Any) -> torch.dtype | None:
    """A floating torch dtype from itself or its name (``"bfloat16"``, ``"bf16"``, ``"torch.float16"``); None
    stays None."""
    if value is None:
        return None
    short = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    got = value
    if isinstance(value, str):
        name = value.removeprefix("torch.")
        got = getattr(torch, short.get(name, name), None)
    if not isinstance(got, torch.dtype) or not got.is_floating_point:
        raise ArgumentError(f"dtype must be a floating torch dtype or its name ('bfloat16', 'float16', 'float32'), "
                            f"got {_args.shown(value)}")
    return got


class Destination:
    """The output folder: a local directory (files written whole: temporary name, rename) or an fsspec URL."""

    def __init__(self, directory: Any, what: str, storage_options: Mapping[str, Any] | None,
                 mode: int | None = None) -> None:
        self.mode = shared_file_mode() if mode is None else mode
        if isinstance(directory, os.PathLike):
            directory = os.fspath(directory)
        if not isinstance(directory, str) or not directory:
            raise ArgumentError(f"{what} must be a local directory or an fsspec URL, got {_args.shown(directory)}")
        self.fs: Any = None
        self.where = directory
        if "://" in directory or "::" in directory or (_args.mangled(directory) and not directory.startswith("/")):
            _args.object_url(directory, what, relative=True)  # s3:/bucket is a typo, not a directory
            check_local_url(directory, what)  # file:///etc is a system directory
            for local in ("file://", "local://"):
                if directory.startswith(local):
                    directory = directory[len(local):]
                    break
            else:
                import fsspec

                self.fs, self.path = fsspec.core.url_to_fs(directory, **dict(storage_options or {}))
                return
        self.path = check_directory(directory, what)  # never a system directory, a file or a kernel fs

    def names(self) -> list[str]:
        if self.fs is None:
            return os.listdir(self.path) if os.path.isdir(self.path) else []
        try:
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.path, detail=False)]
        except FileNotFoundError:
            return []

    def prepare(self) -> None:
        if self.fs is None:
            os.makedirs(self.path, exist_ok=True)
        else:
            self.fs.makedirs(self.path, exist_ok=True)

    def write(self, name: str, data: Callable[[IO[bytes]], None] | bytes) -> None:
        if self.fs is None:
            atomic_write(os.path.join(self.path, name), data, mode=self.mode)
            return
        with self.fs.open(f"{self.path.rstrip('/')}/{name}", "wb") as f:
            data(f) if callable(data) else f.write(data)

    def remove(self, name: str) -> None:
        if self.fs is None:
            os.unlink(os.path.join(self.path, name))
        else:
            self.fs.rm(f"{self.path.rstrip('/')}/{name}")


def plan_shards(tensors: Sequence[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Names grouped into shards in order, as ``save_pretrained`` groups them: a shard takes the next
    tensor unless that would pass ``max_bytes`` (a tensor larger than that is a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in tensors:
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _header(tensors: Sequence[tuple[str, torch.Tensor]], metadata: Mapping[str, str]) -> bytes:
    """A safetensors header: 8 bytes of little-endian length, then the JSON, padded with spaces to 8 bytes."""
    head: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        head[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _write_shard(f: IO[bytes], tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    f.write(_header(tensors, {"format": "pt"}))
    for _, t in tensors:
        if t.numel():
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)


def export_safetensors(source: TieredStore | Sequence[AnyTier], directory: str | os.PathLike[str],
                       step: int | None = None, *, tiers: Sequence[str] | None = None, prefix: str | None = None,
                       dtype: torch.dtype | str | None = None, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                       config: Mapping[str, Any] | str | os.PathLike[str] | None = None, overwrite: bool = False,
                       storage_options: Mapping[str, Any] | None = None,
                       progress: Callable[[int], None] | None = None, tie: Mapping[str, str] | None = None,
                       file_mode: int | None = None) -> SafetensorsExport:
    """Write the tensors of ``step`` (default: the newest committed one) as a Hugging Face safetensors folder.

    Parameters
    ----------
    source : TieredStore or list of tiers
        An open store, or tiers to open one over for the call (one process, nothing cleaned up; the
        tiers are closed after).
    directory : str or os.PathLike
        A local directory or an fsspec URL (``s3://bucket/hf-1200``). A system directory (``/etc/x``,
        ``file:///usr/x``), a file or a kernel file system is refused before anything is read.
    step : int, optional
        The step; default the newest committed one (on ``tiers``).
    tiers : list of str, optional
        The tiers to read from (default: each byte from the fastest tier whose copy verifies).
    prefix : str, optional
        Keep only the tensors whose names start with it and strip it (``"model."``: Hugging Face expects
        bare parameter names; a ``.`` is added when it does not end with one). Nested keys of a step
        saved by the store directly are joined with ``.``.
    dtype : torch.dtype or str, optional
        Cast floating tensors to it (``"bfloat16"``); other tensors are written as saved.
    max_shard_size : int or str
        The most bytes per file, as ``save_pretrained`` takes it (``"5GB"`` = 5e9 bytes, ``"2GiB"``).
    config : mapping or path, optional
        Written as ``config.json`` beside the tensors (a dict, e.g. ``model.config.to_dict()``, or a file).
    overwrite : bool
        Replace an export already in ``directory`` (its ``model*.safetensors`` files and index go first);
        without it that is a ``FileExistsError``.
    storage_options : mapping, optional
        fsspec options for a URL ``directory``.
    progress : callable, optional
        Called with the bytes of each entry read.
    tie : mapping of str to str, optional
        Tied weights, written once as ``save_pretrained`` writes them: ``{"lm_head.weight":
        "model.embed_tokens.weight"}`` leaves the first out and keeps the second, by their names in the
        folder (after ``prefix``). The two must hold the same bytes in the step. ``from_pretrained`` ties
        them again when the model's config ties its embeddings (``tie_word_embeddings``, true unless the
        config says otherwise; a ``config`` that says false is refused).
    file_mode : int, optional
        The files' permissions. Default: what a plain ``open`` gives under the process's umask (0o644 with
        the usual one), as for any model folder meant to be read by others. A checkpoint's own files stay
        private to the job (0o600); an export is a model to share, so it is not.

    Returns
    -------
    SafetensorsExport
        The files written, each tensor's file, and the ties left out (``tied``).

    Raises
    ------
    OutputExistsError
        ``directory`` holds an export already and ``overwrite`` is false (a ``FileExistsError`` too).
    ArgumentError
        A bad argument, a step of another kind (a Hugging Face Trainer's files), no tensor with ``prefix``.
    StepNotFoundError
        No committed step (or not ``step``) on the tiers.
    ChecksumError, RestoreError, FormatError, OSError
        No tier holds a verified copy of a needed entry, or the folder cannot be written.
    """
    what = "export_safetensors directory"
    if file_mode is not None and (not isinstance(file_mode, int) or isinstance(file_mode, bool)
                                  or not 0 <= file_mode <= 0o777):
        raise ArgumentError(f"file_mode must be permission bits such as 0o644, got {_args.shown(file_mode)}")
    folder = Destination(directory, what, storage_options, file_mode)
    ties = check_ties(tie)
    step = _args.optional_step(step)
    cast = parse_dtype(dtype)
    limit = parse_size(max_shard_size)
    if prefix is not None and not isinstance(prefix, str):
        raise ArgumentError(f"prefix must be a str such as 'model.', got {_args.shown(prefix)}")
    data = None if config is None else config_bytes(config)  # read and checked before anything is written
    if ties and data is not None and json.loads(data).get("tie_word_embeddings", True) is False:
        raise ArgumentError(f"config says tie_word_embeddings: false, so from_pretrained would not tie "
                            f"{', '.join(f'{a}={b}' for a, b in ties.items())}: drop the tie or fix the config")
    if isinstance(source, TieredStore):
        return _export(source, folder, step, tiers, prefix, cast, limit, data, overwrite, progress, ties)
    from ..ranks.groups import SingleProcess

    with TieredStore(list(source), group=SingleProcess(), cleanup=False, background_bandwidth=None) as store:
        return _export(store, folder, step, tiers, prefix, cast, limit, data, overwrite, progress, ties)


def _export(store: TieredStore, folder: Destination, step: int | None, tiers: Sequence[str] | None,
            prefix: str | None, cast: torch.dtype | None, limit: int, config: bytes | None, overwrite: bool,
            progress: Callable[[int], None] | None, ties: Mapping[str, str]) -> SafetensorsExport:
    names = _args.names(tiers, "tiers", [t.name for t in store.tiers])
    held = store.common_steps(names)
    if step is None:
        if not held:
            raise StepNotFoundError("nothing to export: no committed step")
        step = held[-1]
    elif step not in held:
        raise StepNotFoundError(f"step {step} is not committed for every rank on {names or 'the tiers'}; committed: "
                                f"{held[-10:]}")
    found = steptensors.tensors(store, step, names)
    wanted = _select(found, prefix, step)
    rename = {t.name: _strip(t.name, prefix) for t in wanted}
    if ties:
        dropped = left_out(store, step, names, wanted, rename, ties)
        wanted = [t for t in wanted if t.name not in dropped]
    out_dtype = {t.name: cast if cast is not None and t.dtype.is_floating_point else t.dtype for t in wanted}
    bad = sorted({str(d) for d in out_dtype.values() if d not in DTYPES})
    if bad:
        raise ArgumentError(f"step {step}: safetensors cannot hold dtype {', '.join(bad)}")
    size = {t.name: t.nbytes // t.dtype.itemsize * out_dtype[t.name].itemsize for t in wanted}
    shards = plan_shards([(t.name, size[t.name]) for t in wanted], limit)
    files = [SINGLE] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    old = [n for n in folder.names() if _SHARD.match(n) or n == INDEX]
    if old and not overwrite:
        raise OutputExistsError(f"{folder.where} already holds an export ({sorted(old)[0]})")
    folder.prepare()
    for n in old:
        folder.remove(n)
    by_name = {t.name: t for t in wanted}
    weight_map: dict[str, str] = {}
    for file, shard in zip(files, shards):
        got = steptensors.read(store, step, names, [by_name[n] for n in shard], progress)
        ordered = [(rename[n], got[n].to(out_dtype[n])) for n in shard]
        folder.write(file, lambda f, ordered=ordered: _write_shard(f, ordered))  # type: ignore[misc]
        weight_map.update((name, file) for name, _ in ordered)
        del got, ordered
        log.info("export_safetensors: step %d -> %s/%s", step, folder.where, file)
    if config is not None:
        folder.write("config.json", config)
    total = sum(size.values())
    if len(files) > 1:  # last: the folder is complete
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        folder.write(INDEX, json.dumps(index, indent=2, sort_keys=True).encode() + b"\n")
    return SafetensorsExport(step, folder.where, files + ([INDEX] if len(files) > 1 else []), weight_map, total,
                             dict(ties))


def _select(found: list[steptensors.Tensor], prefix: str | None, step: int) -> list[steptensors.Tensor]:
    if prefix:
        prefix = _norm_prefix(prefix)
        wanted = [t for t in found if t.name.startswith(prefix) and len(t.name) > len(prefix)]
    else:
        wanted = list(found)
    if not wanted:
        some = ", ".join(repr(t.name) for t in found[:5]) or "none"
        raise ArgumentError(f"step {step} has no tensor named {prefix!r}...; its tensors include {some}"
                            if prefix else f"step {step} holds no tensors")
    return wanted


def _norm_prefix(prefix: str) -> str:
    prefix = prefix.replace("/", ".")
    return prefix if prefix.endswith(".") else prefix + "."


def _strip(name: str, prefix: str | None) -> str:
    return name[len(_norm_prefix(prefix)):] if prefix else name


def config_bytes(config: Any) -> bytes:
    """``config.json``'s bytes, from a mapping or a file; ArgumentError when it is neither, or not JSON."""
    if isinstance(config, Mapping):
        try:
            return json.dumps(dict(config), indent=2, sort_keys=True, allow_nan=False).encode() + b"\n"
        except (TypeError, ValueError) as e:
            raise ArgumentError(f"config is not JSON-serialisable ({e}); give a dict of JSON values, e.g. "
                                "model.config.to_dict()") from None
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ArgumentError(f"config {os.fspath(config)!r} cannot be read ({e.strerror or e}); give a "
                                "config.json file") from None
        try:
            json.loads(data)
        except ValueError as e:
            raise ArgumentError(f"config {os.fspath(config)!r} is not a JSON file ({e})") from None
        return data
    raise ArgumentError(f"config must be a dict (e.g. model.config.to_dict()) or a config.json path, got "
                        f"{_args.shown(config)}")
