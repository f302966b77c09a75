"""The on-tier format: names, manifests and markers read from a tier are validated before use."""

from __future__ import annotations

import json

import pytest

from tierfs import FormatError
from tierfs.format import (FORMAT_VERSION, Entry, Manifest, Marker, crc32c, parse_step_dirname, plan_files,
                           step_dirname)


def test_step_dirnames_sort_by_step():
    names = [step_dirname(s) for s in (0, 9, 10, 100, 12345678901)]
    assert names == sorted(names)
    assert [parse_step_dirname(n) for n in names] == [0, 9, 10, 100, 12345678901]
    assert parse_step_dirname("step_12") is None and parse_step_dirname("../step_000000000001") is None
    for bad in (-1, 10**12, 1.5, True, "3"):
        with pytest.raises(FormatError):
            step_dirname(bad)


def test_crc32c_is_castagnoli_and_continues_across_pieces():
    """Stored checksums must stay valid whichever library computes them: the standard check values."""
    import numpy as np

    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc32c(bytes(32)) == 0x8A9136AA and crc32c(b"\xff" * 32) == 0x62A8AB43  # RFC 3720 B.4
    assert crc32c(b"") == 0 and crc32c(b"", 0x1234) == 0x1234
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)
    data.flags.writeable = False  # read-only mappings are checked too
    whole = crc32c(data)
    assert crc32c(data[12345:], crc32c(memoryview(data)[:12345])) == whole
    assert crc32c(data.tobytes()) == whole


def test_plan_packs_entries_aligned_and_never_spans_files():
    placement, files = plan_files([100, 100, 1000, 5000, 10], rank=3, file_size=1100)
    assert placement == [("rank_00003.0000.bin", 0), ("rank_00003.0000.bin", 128), ("rank_00003.0001.bin", 0),
                         ("rank_00003.0002.bin", 0), ("rank_00003.0003.bin", 0)]
    assert files == {"rank_00003.0000.bin": 228, "rank_00003.0001.bin": 1000, "rank_00003.0002.bin": 5000,
                     "rank_00003.0003.bin": 10}


def _manifest(**changes) -> bytes:
    m = Manifest(step=1, rank=0, world_size=1, files={"rank_00000.0000.bin": 8},
                 entries=[Entry("x", "array", "numpy", "<f4", [2], "rank_00000.0000.bin", 0, 8, [123])])
    d = json.loads(m.to_bytes())
    for path, value in changes.items():
        obj = d
        *parents, last = path.split(".")
        for p in parents:
            obj = obj[int(p)] if p.isdigit() else obj[p]
        obj[last] = value
    d.pop("self_crc32c", None)  # the manifest's own checksum (its last field), made again over the changes
    body = json.dumps(d, separators=(",", ":")).encode()
    return body[:-1] + b',"self_crc32c":' + str(crc32c(body)).encode() + b"}"


def test_manifest_round_trip():
    m = Manifest.from_bytes(_manifest())
    assert m.entries[0].name == "x" and m.nbytes == 8 and m.version == FORMAT_VERSION


@pytest.mark.parametrize("changes, message", [
    ({"files": {"../../etc/passwd": 8}}, "unsafe file name"),
    ({"files": {"/abs": 8}}, "unsafe file name"),
    ({"entries.0.file": "../x"}, "outside its shard file"),
    ({"entries.0.length": 9}, "outside its shard file"),
    ({"entries.0.offset": -1}, "outside its shard file"),
    ({"entries.0.crc32c": []}, "checksums"),
    ({"entries.0.kind": "pickle"}, "unknown kind"),
    ({"entries.0.name": "a\x00b"}, "bad entry name"),
    ({"entries.0.name": ""}, "bad entry name .* it is empty"),
    ({"entries.0.name": 7}, "bad entry name 7 .* not a string"),
    ({"entries.0.name": "a" * 5000}, "bad entry name .* more than 4096"),
    ({"entries.0.pickle": "x"}, "unexpected fields"),
    ({"entries": {"x": 1}}, "unexpected fields"),
    ({"version": 99}, "version 99 is not supported"),
    ({"format": "other"}, "not a tierfs manifest"),
    ({"extra_field": 1}, "unexpected fields"),
])
def test_bad_manifests_are_rejected(changes, message):
    with pytest.raises(FormatError, match=message):
        Manifest.from_bytes(_manifest(**changes))


def test_an_entry_without_some_fields_takes_their_defaults():
    d = json.loads(_manifest())
    del d["entries"][0]["value"], d["entries"][0]["lib"]
    d.pop("self_crc32c")
    body = json.dumps(d, separators=(",", ":")).encode()
    m = Manifest.from_bytes(body[:-1] + b',"self_crc32c":' + str(crc32c(body)).encode() + b"}")
    assert (m.entries[0].lib, m.entries[0].value, m.entries[0].crc32c) == ("numpy", None, d["entries"][0]["crc32c"])
    assert m.entries[0] == Manifest.from_bytes(_manifest()).entries[0]


def test_garbage_manifest_and_marker():
    with pytest.raises(FormatError, match="not valid JSON"):
        Manifest.from_bytes(b"\x80garbage")
    with pytest.raises(FormatError, match="damaged"):
        Marker.from_bytes(b"{")
    bad = json.loads(Marker(1, 1, {"rank_00000.manifest.json": 1}).to_bytes())
    bad["manifests"] = {"../x": 1}
    with pytest.raises(FormatError, match="unsafe"):
        Marker.from_bytes(json.dumps(bad).encode())


def test_unknown_dtypes_in_manifest_are_refused():
    from tierfs.state import allocate

    with pytest.raises(FormatError):
        allocate("numpy", "O", [1])
    with pytest.raises(FormatError):
        allocate("torch", "__class__", [1])


@pytest.mark.parametrize("threads", [1, 2])
def test_block_checksums_are_each_blocks_crc32c_on_any_path(threads):
    """A save's checksums: per block of each entry, the same whether computed on this thread (a commit's
    path for thousands of small entries) or spread over threads, empty entries included."""
    import numpy as np

    from tierfs.format import blockio

    rng = np.random.default_rng(1)
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in (0, 1, 100, 4096, 4097, 10000)]
    want = [[crc32c(a[s:s + 4096]) for s in range(0, a.size, 4096)] or [0] for a in arrays]
    jobs = [blockio.Job(f"e{i}", a, None, 4096) for i, a in enumerate(arrays)]
    assert blockio.run(jobs, threads) == want
    dst = [np.zeros_like(a) for a in arrays]  # a copy beside them takes the general path
    assert blockio.run([blockio.Job(f"e{i}", a, d, 4096) for i, (a, d) in enumerate(zip(arrays, dst))], 1) == want
    assert all(np.array_equal(a, d) for a, d in zip(arrays, dst))


@pytest.mark.parametrize("name", ["step_000000000001\n", "step_" + "\u0660" * 11 + "\u0661", " step_000000000001"])
def test_a_step_directory_name_is_exactly_twelve_ascii_digits(name):
    assert parse_step_dirname(name) is None


@pytest.mark.parametrize("name", ["rank_00000.0000.bin\n", "rank\n", "r\u0661.bin", "a/b", "..x", ""])
def test_a_file_name_from_a_manifest_or_a_peer_with_a_newline_or_other_scripts_is_refused(name):
    from tierfs.format import validate_filename

    with pytest.raises(FormatError):
        validate_filename(name)
    assert validate_filename("rank_00000.0000.bin") == "rank_00000.0000.bin"
