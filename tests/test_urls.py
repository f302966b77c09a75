"""Object-store URLs as users write them: a typo is one clear error wherever a URL is given (``ObjectTier``,
the ``tiered::`` filesystem's target, the command line's TARGET, DEST and config files), never a directory
``./s3:/bucket/run`` on local disk; errors of the object tier name the tier and its URL; ``tierfs export``
never writes into a system directory.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import fsspec
import numpy as np
import pytest

from tierfs import TieredStore
from tierfs.cli import main
from tierfs.errors import ArgumentError, BackgroundError, TierUnavailableError
from tierfs.tiers import MemoryTier, ObjectTier

#: (URL, what the message says besides the URL as written)
BAD = [
    ("s3:/bucket/run", "did you mean 's3://bucket/run'?"),
    ("s3//bucket/run", "did you mean 's3://bucket/run'?"),
    ("s3:bucket/run", "did you mean 's3://bucket/run'?"),
    ("gs:/b/x", "did you mean 'gs://b/x'?"),
    ("s3:///", "names no bucket"),
    ("s4://b/r", "unknown protocol 's4'; did you mean 's3'"),
    ("bucket/run", "neither a URL nor an absolute path"),
    ("ckpt/dir", "neither a URL nor an absolute path"),
    ("file://s3:/bucket/run", "did you mean 's3://bucket/run'?"),
]


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    """An empty current directory: a rejected URL must leave it empty."""
    d = tmp_path / "cwd"
    d.mkdir()
    monkeypatch.chdir(d)
    yield d
    assert list(d.iterdir()) == []


def _one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text and text, text
    return text


@pytest.mark.parametrize("url,says", BAD)
def test_an_object_tier_url_with_a_typo_is_one_clear_error(cwd, shm_dir, url, says):
    with pytest.raises(ArgumentError) as info:
        TieredStore([MemoryTier(Path(shm_dir) / "ram"), ObjectTier(url)])
    text = _one_line(info.value)
    assert text.startswith(f"ObjectTier url {url!r}") and says in text
    assert isinstance(info.value, TierUnavailableError)  # what a bad URL raised before
    assert not (Path(shm_dir) / "ram").exists()


def test_an_empty_url_is_one_clear_error(cwd):
    with pytest.raises(ArgumentError, match="ObjectTier url must be a URL such as 's3://bucket/run'"):
        ObjectTier("")


def test_urls_and_absolute_paths_are_accepted_without_contacting_the_store(cwd, tmp_path):
    for url, protocol, root in [(f"file://{tmp_path}/a", "file", f"{tmp_path}/a"),
                                (f"{tmp_path}/b", "file", f"{tmp_path}/b"),
                                ("memory://x", "memory", "/x"), ("s3://bucket/run", "s3", "bucket/run")]:
        tier = ObjectTier(url)  # s3: no request before open()
        assert (tier.protocol, tier.root) == (protocol, root)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # created when a store opens them


# -- tiered:: ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("url,says", [b for b in BAD if b[0] not in ("bucket/run", "ckpt/dir", "s4://b/r")])
def test_a_tiered_target_with_a_typo_is_one_clear_error_through_fsspec(cwd, shm_dir, url, says):
    ram = Path(shm_dir) / "ram"
    opts = {"tiered": {"path": str(ram)}}
    calls = [lambda: fsspec.url_to_fs(f"tiered::{url}", **opts),
             lambda: fsspec.open(f"tiered::{url}/a.bin", "wb", **opts).open(),
             lambda: fsspec.filesystem("tiered", fo=url, path=str(ram), skip_instance_cache=True)]
    for call in calls:
        with pytest.raises(ArgumentError) as info:
            call()
        text = _one_line(info.value)
        assert text.startswith("tiered:: target") and says.split("'")[0] in text, text
    assert not ram.exists()


@pytest.mark.parametrize("url,says", [b for b in BAD if b[0] in ("bucket/run", "ckpt/dir", "s4://b/r", "s3:///")])
def test_a_tiered_target_given_directly_is_checked_as_written(cwd, shm_dir, url, says):
    with pytest.raises(ArgumentError, match="tiered:: target") as info:
        fsspec.filesystem("tiered", fo=url, path=f"{shm_dir}/ram", skip_instance_cache=True)
    assert says in _one_line(info.value)


def test_through_a_chained_url_fsspec_answers_an_unknown_protocol_and_a_relative_path_is_said(cwd, shm_dir, caplog):
    """fsspec resolves a chained URL before the filesystem sees it: it refuses an unknown protocol itself,
    and hands a relative path over made absolute, so that only a warning can say it is local."""
    with pytest.raises(ValueError, match="s4"):
        fsspec.url_to_fs("tiered::s4://b/r", tiered={"path": f"{shm_dir}/ram"})
    with caplog.at_level(logging.WARNING, logger="tierfs"):
        fs, path = fsspec.url_to_fs("tiered::bucket/run", tiered={"path": f"{shm_dir}/ram"})
    assert path == f"{cwd}/bucket/run"
    assert any("tiered::s3://bucket/run" in r.getMessage() and "local disk" in r.getMessage() for r in caplog.records)


# -- the command line -------------------------------------------------------------------------------
def _cli(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tierfs: error: "), err
    return rc, err


@pytest.mark.parametrize("url,says", BAD + [("", "TARGET must be a URL")])
def test_a_target_with_a_typo_is_one_line_on_the_command_line(cwd, capsys, url, says):
    rc, err = _cli(capsys, "ls", url)
    if url in ("bucket/run", "ckpt/dir"):  # a relative path is a tier directory on the command line
        assert rc == 1 and f"{url}: no such directory" in err and "s3://bucket/run" in err
    else:
        assert rc == 2 and says in err


def test_cp_to_a_destination_with_a_typo_writes_nothing(cwd, capsys, shm_dir):
    with TieredStore([MemoryTier(shm_dir)]) as store:
        store.save(1, {"x": np.arange(4)})
    rc, err = _cli(capsys, "cp", shm_dir, "s3:/bucket/run")
    assert rc == 2 and "DEST 's3:/bucket/run' is not a URL: did you mean 's3://bucket/run'?" in err


def test_a_config_file_url_with_a_typo_names_the_entry(cwd, capsys, tmp_path):
    cfg = tmp_path / "tiers.json"
    cfg.write_text(json.dumps({"tiers": [{"kind": "object", "url": "s3:/bucket/run"}]}))
    rc, err = _cli(capsys, "ls", str(cfg))
    assert rc == 2 and f"config {cfg}: tiers[0]: url 's3:/bucket/run' is not a URL" in err


def test_export_never_writes_into_a_system_directory(capsys, shm_dir, tmp_path):
    pytest.importorskip("torch")
    from tierfs.adapters.dcp import export_dcp

    for target in ("/etc/tierfs-export", "/usr/local/x", "/tmp", "/"):
        rc, err = _cli(capsys, "export", shm_dir, target, "--dcp")
        assert rc == 2 and f"DIR {target!r}" in err and "system directory" in err
        assert not os.path.exists("/etc/tierfs-export") and not os.path.exists("/usr/local/x")
    rc, err = _cli(capsys, "export", shm_dir, "s3://bucket/run", "--dcp")
    assert rc == 2 and "an export writes a local directory" in err
    with TieredStore([MemoryTier(shm_dir)]) as store:
        store.save(1, {"x": np.arange(4)})
        with pytest.raises(ArgumentError, match="export_dcp directory '/etc/x' is a system directory"):
            export_dcp(store, "/etc/x")
    assert not os.path.exists("/etc/x")


# -- errors of the object tier name it --------------------------------------------------------------
def test_a_missing_bucket_in_the_background_names_the_tier_the_url_and_the_step(s3_storage_options, shm_dir):
    s3 = fsspec.filesystem("s3", skip_instance_cache=True, **s3_storage_options)
    s3.mkdir("going-away")
    url = "s3://going-away/run"
    store = TieredStore([MemoryTier(shm_dir), ObjectTier(url, s3_storage_options)])
    try:
        s3.rmdir("going-away")  # after the store checked it: the copy finds it gone
        store.save(1, {"x": np.arange(1000)})
        with pytest.raises(BackgroundError) as info:
            store.wait_until_finished()
        text = _one_line(info.value)
        assert f"tier 's3' ({url}): step 1: upload rank_00000" in text and "does not exist" in text, text
        assert isinstance(info.value.__cause__, FileNotFoundError)  # the client's type, kept
    finally:
        store.close()
