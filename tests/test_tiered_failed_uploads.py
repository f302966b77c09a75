"""``tiered::`` uploads that fail for good (a bucket that does not exist) at interpreter exit: the process
exits with status 1 and one line naming the target as the user wrote it; the files are moved aside in the
RAM directory (``.tierfs-failed``), so later processes neither retry them nor lose them, until
``retry_failed()`` is asked for. Real processes against the moto S3 server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import fsspec

FILES = {"a.bin": b"alpha" * 1000, "sub/b.bin": b"beta"}
WRITE = """
    import fsspec, json, sys
    url, opts, files = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    for name, text in files.items():
        with fsspec.open(f"{url}/{name}", "wb", **opts) as f:  # as pandas' to_parquet does: no flush()
            f.write(text.encode())
    fs, _ = fsspec.url_to_fs(url, **opts)
    print(json.dumps(fs.stats()))
"""


def _child(url: str, opts: dict, files: dict[str, bytes]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(WRITE), url, json.dumps(opts),
                           json.dumps({k: v.decode() for k, v in files.items()})],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ))


def test_uploads_to_a_missing_bucket_fail_the_exit_and_are_set_aside_until_retried(s3_storage_options, shm_dir):
    url = "tiered::s3://missing-bucket/x"
    opts = {"tiered": {"path": shm_dir}, "s3": s3_storage_options}
    out = _child(url, opts, FILES)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    lost = [line for line in out.stderr.splitlines() if "NOT durable" in line]
    assert len(lost) == 1, out.stderr
    failed = Path(shm_dir, ".tierfs-failed")
    assert "NOT durable on s3://missing-bucket/x " in lost[0] and "will not be retried" in lost[0]
    assert "The specified bucket does not exist" in lost[0] and f"remain in RAM at {failed}" in lost[0]
    for name, data in FILES.items():
        assert (failed / "missing-bucket/x" / name).read_bytes() == data
        assert not (Path(shm_dir) / "missing-bucket/x" / name).exists()

    # a later process with the same RAM directory and target leaves them alone: no retry, status 0
    again = _child(url, opts, {})
    assert again.returncode == 0 and "upload" not in again.stderr, again.stderr
    assert json.loads(again.stdout)["upload_failures"] == 0
    assert all((failed / "missing-bucket/x" / name).exists() for name in FILES)

    # once the bucket exists, asking for it uploads them
    s3 = fsspec.filesystem("s3", skip_instance_cache=True, **s3_storage_options)
    s3.mkdir("missing-bucket")
    fs = fsspec.filesystem("tiered", path=shm_dir, target_protocol="s3", target_options=s3_storage_options,
                           skip_instance_cache=True)
    assert not [i for i in fs.ls("", detail=False) if ".tierfs-failed" in i]  # never listed
    assert fs.retry_failed() == len(FILES)
    fs.flush()
    for name, data in FILES.items():
        assert s3.cat_file(f"missing-bucket/x/{name}") == data
    assert not failed.exists()
