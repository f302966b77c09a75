"""A shard's header on the wire: its fields, and the manifest and marker bytes as they were, or a clear error."""

import numpy as np
import pytest

from tierfs.errors import FormatError
from tierfs.tiers._wire import header, parse_header


def test_a_header_carries_the_manifest_and_marker_bytes_unchanged():
    manifest = b'{"name":"a\\"b","x":"\xe9\x00"}'  # quotes, escapes, bytes past ASCII, a NUL
    marker = b'{"step":3}'
    h = parse_header(header(3, 1, manifest, marker, {"rank_00001.bin": np.zeros(10, np.uint8)}))
    assert (h["step"], h["rank"], h["error"], h["files"]) == (3, 1, None, [["rank_00001.bin", 10]])
    assert (h["manifest"], h["marker"]) == (manifest, marker)


def test_a_header_over_the_limit_says_why_instead():
    h = parse_header(header(3, 1, b"m" * 500, b"k", {}, limit=200))
    assert (h["manifest"], h["marker"], h["files"]) == (b"", b"", [])
    assert "over 200" in h["error"]


@pytest.mark.parametrize("raw", [b"short", header(3, 1, b"m", b"k", {})[:-1], header(3, 1, b"m", b"k", {}) + b"x"])
def test_a_header_whose_frame_does_not_add_up_is_a_format_error(raw):
    with pytest.raises(FormatError, match="header"):
        parse_header(raw)
