"""The README's code runs as written, any number of times, and its first example is examples/quickstart.py.

Each run is a fresh process in directories of the test's own (the quickstart's TIERFS_QUICKSTART_RAM and
TIERFS_QUICKSTART_URL; for the store example, LOGNAME, which getpass.getuser() reads first, and TMPDIR), so
nothing of the user's /dev/shm/tierfs-*-$USER is touched.
"""

import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "quickstart.py"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", (ROOT / "README.md").read_text(), re.S | re.M)


def run(args: list[str], env: dict[str, str]) -> str:
    p = subprocess.run([sys.executable, *args], cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, f"{args} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return p.stdout


def test_readme_first_example_is_quickstart():
    blocks = python_blocks()
    assert blocks, "README.md has no ```python block"
    assert blocks[0] == QUICKSTART.read_text(), (
        "README.md's first example differs from examples/quickstart.py: paste the file into the README")


def test_quickstart_resumes_exactly(shm_dir, tmp_path):
    env = {"TIERFS_QUICKSTART_RAM": os.path.join(shm_dir, "ram"),
           "TIERFS_QUICKSTART_URL": f"file://{tmp_path}/object"}
    first = run([str(QUICKSTART)], env)
    assert "restored" not in first
    saved = re.search(r"trained steps 1\.\.10, .*state crc32 ([0-9a-f]{8})", first)
    assert saved, first
    assert re.search(r"^ram +holds steps \[8, 10\]", first, re.M), first
    assert re.search(r"^file +holds steps \[10\]", first, re.M), first

    # the second run loads step 10 from RAM: the same bits as the first run had at its end
    second = run([str(QUICKSTART)], env)
    restored = re.search(r"restored step (\d+) from tier '(\w+)'.*state crc32 ([0-9a-f]{8})", second)
    assert restored and restored.groups() == ("10", "ram", saved.group(1)), second
    again = re.search(r"trained steps 11\.\.20, .*state crc32 ([0-9a-f]{8})", second)
    assert again, second
    assert re.search(r"^file +holds steps \[10, 20\]", second, re.M), second

    # without the RAM tier (a reboot), the object tier serves step 20, exactly as saved
    shutil.rmtree(env["TIERFS_QUICKSTART_RAM"])
    third = run([str(QUICKSTART)], env)
    restored = re.search(r"restored step (\d+) from tier '(\w+)'.*state crc32 ([0-9a-f]{8})", third)
    assert restored and restored.groups() == ("20", "file", again.group(1)), third


@pytest.fixture
def fresh_user(tmp_path):
    """A user name of the test's own, so /dev/shm/tierfs-store-<user> is fresh; removed afterwards."""
    user = f"tierfs-test-{uuid.uuid4().hex[:8]}"
    yield {"LOGNAME": user, "USER": user, "TMPDIR": str(tmp_path)}
    shutil.rmtree(f"/dev/shm/tierfs-store-{user}", ignore_errors=True)


def test_readme_other_examples_run_twice(fresh_user, tmp_path):
    for i, code in enumerate(python_blocks()[1:], start=1):
        script = tmp_path / f"readme_example_{i}.py"
        script.write_text(code)
        run([str(script)], fresh_user)
        run([str(script)], fresh_user)
