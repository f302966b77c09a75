"""End to end: ``tierfs cp``, ``gc``, ``export --dcp``, ``bench``, ``plan`` and ``simulate`` against a store
with a RAM tier (/dev/shm) and an S3 object tier (moto server), through ``main([...])`` and as a program."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from _ports import free_port

from tierfs import TieredStore
from tierfs.cli import main
from tierfs.format import MARKER, step_dirname
from tierfs.policies import FixedIntervalPolicy, PreserveAll
from tierfs.tiers import MemoryTier, ObjectTier

HERE = Path(__file__).parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))


def state(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal(20000).astype(np.float32), "opt": {"m": rng.standard_normal((50, 40))},
            "step": step}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def config(tmp_path: Path, shm_dir: str, url: str, opts: dict, ram_keep=None, s3_keep=None) -> Path:
    ram = {"kind": "memory", "path": shm_dir, "name": "ram"}
    s3 = {"kind": "object", "url": url, "storage_options": opts, "name": "s3"}
    if ram_keep is not None:
        ram["keep"] = ram_keep
    if s3_keep is not None:
        s3["keep"] = s3_keep
    cfg = tmp_path / "tiers.json"
    cfg.write_text(json.dumps({"tiers": [ram, s3]}))
    return cfg


def save_steps(shm_dir: str, url: str, opts: dict, steps=(1, 2, 3, 4), every: int = 2) -> None:
    """Steps in RAM (all kept) and every ``every``-th on S3 (all kept)."""
    with TieredStore([MemoryTier(shm_dir, keep=PreserveAll()),
                      ObjectTier(url, opts, save=FixedIntervalPolicy(every), keep=PreserveAll(), name="s3")],
                     background_bandwidth=None) as store:
        for s in steps:
            store.save(s, state(s))
        store.wait_until_finished()


def restored(path_or_url: str, opts: dict | None = None, step: int | None = None) -> dict:
    tier = ObjectTier(path_or_url, opts or {}) if "://" in path_or_url else MemoryTier(path_or_url)
    with TieredStore([tier], cleanup=False) as store:
        st, info = store.restore(step)
    return st


@contextlib.contextmanager
def mapped_elsewhere(shard: Path) -> Iterator[subprocess.Popen]:
    """Another process mapping ``shard`` while the block runs (as a running job maps its RAM tier's files)."""
    child = subprocess.Popen([sys.executable, "-c", (
        "import mmap, sys\n"
        f"f = open({str(shard)!r}, 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n"
        "print('mapped', flush=True); sys.stdin.read()\n")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "mapped"
        yield child
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=60)


def same(a: dict, b: dict) -> bool:
    return (np.array_equal(a["w"], b["w"]) and np.array_equal(a["opt"]["m"], b["opt"]["m"])
            and a["step"] == b["step"])


# -- cp ---------------------------------------------------------------------------------------------

@pytest.mark.s3
def test_cp_between_tiers_of_a_config_and_out_to_a_directory(shm_dir, s3_url, tmp_path, capsys):
    url, opts = s3_url
    save_steps(shm_dir, url, opts)  # RAM: 1 2 3 4; S3: 2 4
    cfg = config(tmp_path, shm_dir, url, opts)

    code, out, err = run(capsys, "cp", cfg, "--step", 3, "--from", "ram", "--to", "s3")
    assert code == 0, err
    assert "copied step 3 from ram" in out and "to s3" in out and "verified" in out
    assert same(restored(url, opts, 3), state(3))

    # out of tierfs into a plain directory: the newest step, from the fastest tier holding it (RAM)
    plain = tmp_path / "plain"
    code, out, err = run(capsys, "cp", cfg, plain)
    assert code == 0, err
    assert "copied step 4 from ram" in out
    assert (plain / step_dirname(4) / MARKER).is_file()
    assert same(restored(f"file://{plain}"), state(4))
    code, out, err = run(capsys, "verify", f"file://{plain}")
    assert code == 0 and "step 4: OK" in out

    # a second copy is refused, --overwrite replaces it
    code, _, err = run(capsys, "cp", cfg, plain, "--step", 4)
    assert code == 1 and err.startswith("tierfs: error: step 4 is already committed") and err.count("\n") == 1
    code, _, err = run(capsys, "cp", cfg, plain, "--step", 4, "--overwrite")
    assert code == 0, err

    # from the S3 URL itself (storage options with -o) to a directory
    out_dir = tmp_path / "from-s3"
    code, out, err = run(capsys, "cp", url, out_dir, "--step", 2, *sum((["-o", f"{k}={v}"] for k, v in opts.items()), []))
    assert code == 0, err
    assert same(restored(f"file://{out_dir}", step=2), state(2))


@pytest.mark.s3
def test_cp_never_commits_a_damaged_copy(shm_dir, s3_url, tmp_path, capsys):
    url, opts = s3_url
    save_steps(shm_dir, url, opts, steps=(1,), every=100)
    shard = Path(shm_dir) / step_dirname(1) / "rank_00000.0000.bin"
    with open(shard, "r+b") as f:
        f.seek(7)
        b = f.read(1)
        f.seek(7)
        f.write(bytes([b[0] ^ 0x10]))
    cfg = config(tmp_path, shm_dir, url, opts)
    code, _, err = run(capsys, "cp", cfg, "--step", 1, "--from", "ram", "--to", "s3")
    assert code == 1
    assert err.startswith("tierfs: error: ") and "checksum" in err and "nothing committed" in err
    assert err.count("\n") == 1
    assert ObjectTier(url, opts).list_steps().get(1) is not True  # nothing committed on S3


def test_cp_overwrite_keeps_the_destination_s_copy_unless_the_source_verifies_and_never_copies_over_itself(
        shm_dir, tmp_path, capsys):
    """``cp --overwrite`` deletes the step already at the destination only once every byte of the source
    verified, and refuses a destination that is the source (which it would have deleted first)."""
    with TieredStore([MemoryTier(shm_dir)]) as store:
        store.save(3, state(3))
    out = tmp_path / "out"
    assert run(capsys, "cp", shm_dir, out, "--step", 3)[0] == 0
    code, _, err = run(capsys, "cp", f"file://{out}", out, "--step", 3, "--overwrite")
    assert code == 2 and "are the same place" in err and err.count("\n") == 1
    assert same(restored(f"file://{out}"), state(3))  # still there, whole
    shard = Path(shm_dir) / step_dirname(3) / "rank_00000.0000.bin"
    data = bytearray(shard.read_bytes())
    data[7] ^= 0x10
    shard.write_bytes(bytes(data))
    code, _, err = run(capsys, "cp", shm_dir, out, "--step", 3, "--overwrite")
    assert code == 1 and "checksum" in err and "rank_00000.0000.bin" in err
    assert same(restored(f"file://{out}"), state(3))  # the good copy the damaged source would have replaced


def test_cp_refuses_a_directory_a_running_process_uses(shm_dir, tmp_path, capsys):
    """A plain directory as cp's destination that a running job uses (its RAM tier) is refused: cp would
    delete and write steps under the job."""
    with TieredStore([MemoryTier(shm_dir)]) as store:
        store.save(3, state(3))
    ram = tmp_path / "ram"
    with TieredStore([MemoryTier(str(ram))]) as store:
        store.save(3, state(4))
    shard = ram / step_dirname(3) / "rank_00000.0000.bin"
    with mapped_elsewhere(shard) as child:
        code, _, err = run(capsys, "cp", shm_dir, ram, "--step", 3, "--overwrite")
        assert code == 1 and f"in use by running process(es) [{child.pid}]" in err and err.count("\n") == 1
        assert same(restored(str(ram)), state(4))  # the job's step, untouched


def test_cp_command_line_errors(shm_dir, tmp_path, capsys):
    with TieredStore([MemoryTier(shm_dir)]) as store:
        store.save(5, state(5))
    code, _, err = run(capsys, "cp", shm_dir)
    assert code == 2 and "--to" in err
    code, _, err = run(capsys, "cp", shm_dir, tmp_path / "x", "--step", 9)
    assert code == 1 and "step 9 is not committed" in err


# -- gc ---------------------------------------------------------------------------------------------

@pytest.mark.s3
def test_gc_applies_each_tiers_keep_policy(shm_dir, s3_url, tmp_path, capsys):
    url, opts = s3_url
    save_steps(shm_dir, url, opts, steps=(1, 2, 3, 4, 5, 6), every=1)  # both tiers: 1..6
    cfg = config(tmp_path, shm_dir, url, opts, ram_keep={"latest": 2}, s3_keep={"latest": 3, "steps": [1]})

    code, out, err = run(capsys, "gc", cfg, "--dry-run")
    assert code == 0, err
    assert "would delete 6 step(s)" in out  # RAM: 1-4; S3: 2, 3
    assert sorted(MemoryTier(shm_dir).committed_steps()) == [1, 2, 3, 4, 5, 6]  # nothing deleted

    code, out, err = run(capsys, "gc", cfg)
    assert code == 0, err
    assert MemoryTier(shm_dir).committed_steps() == [5, 6]
    assert ObjectTier(url, opts).committed_steps() == [1, 4, 5, 6]
    assert "tier ram: deleted step 1" in out and "tier s3: deleted step 2" in out
    assert "deleted 6 step(s)" in out
    code, out, _ = run(capsys, "gc", cfg)
    assert code == 0 and "deleted 0 step(s)" in out


def test_gc_never_deletes_the_only_copy_of_the_newest_step(shm_dir, capsys):
    with TieredStore([MemoryTier(shm_dir, keep=PreserveAll())]) as store:
        for s in (10, 20, 30):
            store.save(s, state(s))
    # a keep policy that keeps nothing but multiples of 1000: the newest step stays all the same
    code, out, err = run(capsys, "gc", shm_dir, "--keep", '{"every_n_steps": 1000}')
    assert code == 0, err
    assert MemoryTier(shm_dir).committed_steps() == [30]
    code, _, err = run(capsys, "gc", shm_dir)
    assert code == 2 and "needs --keep" in err
    code, _, err = run(capsys, "gc", shm_dir, "--keep", '{"newest": 1}')
    assert code == 2 and "unknown keep keys" in err


def test_gc_counts_a_step_whose_marker_cannot_be_read_for_nothing_and_keeps_the_good_ones(shm_dir, capsys):
    """Step 3's commit marker is garbage: gc must not take it for the newest step (whose only copy it keeps)
    and delete every good step under LatestN(1); it keeps step 3 as it is and the newest good step, 2."""
    with TieredStore([MemoryTier(shm_dir, keep=PreserveAll())]) as store:
        for s in (1, 2, 3):
            store.save(s, state(s))
    (Path(shm_dir) / step_dirname(3) / MARKER).write_bytes(b"not a marker")
    code, out, err = run(capsys, "gc", shm_dir, "--keep", '{"latest": 1}')
    assert code == 0, err
    assert sorted(MemoryTier(shm_dir).list_steps()) == [2, 3]
    assert same(restored(shm_dir, step=2), state(2))


def test_a_step_directory_that_is_a_link_is_never_followed(shm_dir, tmp_path, capsys):
    """A link named as a step (planted while the RAM directory was open to others, say) is no step of the
    tier's: gc neither counts it nor deletes what it points to."""
    with TieredStore([MemoryTier(shm_dir, keep=PreserveAll())]) as store:
        for s in (1, 2):
            store.save(s, state(s))
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("mine")
    (victim / MARKER).write_text("{}")
    os.symlink(victim, Path(shm_dir) / step_dirname(9))
    assert sorted(MemoryTier(shm_dir).list_steps()) == [1, 2]
    code, out, err = run(capsys, "gc", shm_dir, "--keep", '{"latest": 1}')
    assert code == 0, err
    assert sorted(MemoryTier(shm_dir).list_steps()) == [2]
    assert sorted(p.name for p in victim.iterdir()) == [MARKER, "notes.txt"]


def test_gc_keeps_a_fresh_partial_step_and_removes_a_stale_one(shm_dir, capsys):
    with TieredStore([MemoryTier(shm_dir, keep=PreserveAll())]) as store:
        for s in (1, 2, 3):
            store.save(s, state(s))
    os.remove(Path(shm_dir) / step_dirname(3) / MARKER)  # as a save in progress (or a crash) leaves it
    code, out, err = run(capsys, "gc", shm_dir, "--keep", '{"latest": 5}')
    assert code == 0, err
    assert "kept partial step 3" in out and (Path(shm_dir) / step_dirname(3)).is_dir()
    # written 10 minutes ago: older than --older-than 5min, so it goes
    old = time.time() - 600
    for p in [Path(shm_dir) / step_dirname(3), *(Path(shm_dir) / step_dirname(3)).iterdir()]:
        os.utime(p, (old, old))
    code, out, err = run(capsys, "gc", shm_dir, "--keep", '{"latest": 5}', "--older-than", "1h")
    assert code == 0 and "kept partial step 3" in out
    code, out, err = run(capsys, "gc", shm_dir, "--keep", '{"latest": 5}', "--older-than", "5min")
    assert code == 0, err
    assert "removed partial step 3 (last written 10 min ago)" in out
    assert not (Path(shm_dir) / step_dirname(3)).exists()
    assert MemoryTier(shm_dir).committed_steps() == [1, 2]


def test_gc_refuses_a_ram_tier_a_running_process_uses(shm_dir, capsys):
    with TieredStore([MemoryTier(shm_dir, keep=PreserveAll())]) as store:
        for s in (1, 2, 3):
            store.save(s, state(s))
    shard = Path(shm_dir) / step_dirname(1) / "rank_00000.0000.bin"
    with mapped_elsewhere(shard) as child:
        code, _, err = run(capsys, "gc", shm_dir, "--keep", '{"latest": 1}')
        assert code == 1
        assert f"in use by running process(es) [{child.pid}]" in err and err.count("\n") == 1
        assert MemoryTier(shm_dir).committed_steps() == [1, 2, 3]
        code, out, err = run(capsys, "gc", shm_dir, "--keep", '{"latest": 1}', "--force")
        assert code == 0, err
        assert MemoryTier(shm_dir).committed_steps() == [3]


# -- export --dcp -----------------------------------------------------------------------------------

@pytest.mark.s3
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_export_dcp_from_ram_and_from_s3(shm_dir, s3_url, tmp_path, capsys):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from dcp_child import make_state, same as dcp_same
    from tierfs.adapters.dcp import TieredWriter

    url, opts = s3_url
    with TieredStore([MemoryTier(shm_dir), ObjectTier(url, opts, name="s3")], background_bandwidth=None) as store:
        dcp.save(make_state(5, 1), storage_writer=TieredWriter(store, 1))
        dcp.save(make_state(7, 2), storage_writer=TieredWriter(store, 2))
        store.wait_until_finished()
    cfg = config(tmp_path, shm_dir, url, opts)

    out = tmp_path / "plain"
    code, text, err = run(capsys, "export", cfg, out, "--dcp")
    assert code == 0, err
    assert "FileSystemReader" in text and "1 .distcp file(s)" in text
    got = make_state(1, 1)
    got["extra"] = {"epoch": -1, "blob": b""}
    dcp.load(got, storage_reader=FileSystemReader(str(out)))
    assert dcp_same(make_state(7, 2), got)

    # an older step from the S3 tier alone; an existing checkpoint needs --overwrite
    code, _, err = run(capsys, "export", cfg, out, "--dcp", "--step", 1, "--tier", "s3")
    assert code == 1 and "pass --overwrite to replace it" in err and "overwrite=True" not in err and ".metadata" in err
    code, _, err = run(capsys, "export", cfg, out, "--dcp", "--step", 1, "--tier", "s3", "--overwrite")
    assert code == 0, err
    got = make_state(1, 1)
    got["extra"] = {"epoch": -1, "blob": b""}
    dcp.load(got, storage_reader=FileSystemReader(str(out)))
    assert dcp_same(make_state(5, 1), got)

    code, _, err = run(capsys, "export", cfg, out)
    assert code == 2 and "--dcp" in err


def test_export_of_a_step_not_saved_through_dcp_is_one_line(shm_dir, tmp_path, capsys):
    with TieredStore([MemoryTier(shm_dir)]) as store:
        store.save(1, state(1))
    code, _, err = run(capsys, "export", shm_dir, tmp_path / "o", "--dcp")
    assert code == 1 and "not written by TieredWriter" in err and err.count("\n") == 1


# -- bench ------------------------------------------------------------------------------------------

@pytest.mark.s3
def test_bench_measures_ram_and_s3_and_plan_reads_it(s3_url, tmp_path, capsys):
    url, opts = s3_url
    out = tmp_path / "bench.json"
    code, text, err = run(capsys, "bench", "--size", "4MiB", "--repeats", 1, "--object", url,
                          "--storage-options", json.dumps(opts), "--out", out)
    assert code == 0, err
    data = json.loads(out.read_text())
    assert data["format"] == "tierfs-bench" and data["size_bytes"] == 4 << 20
    for k in ("save_gbps", "commit_gbps", "restore_gbps"):
        assert data["ram"][k] > 0
    assert data["object"]["write_gbps"] > 0 and data["object"]["read_gbps"] > 0
    assert data["peer"] is None and any("torchrun" in n for n in data["notes"])
    assert "RAM tier: save" in text and "object tier" in text
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    assert not [p for p in fs.find(url.split("://", 1)[1]) if "tierfs-bench-" in p]  # scratch removed
    assert not Path(data["ram"]["path"]).exists()

    code, text, err = run(capsys, "plan", "--params", "7B", "--hosts", 4, "--mttf", "12h", "--bench", out,
                          "--replicas", 0, "--json")
    assert code == 0, err
    plan = json.loads(text)
    assert [s["name"] for s in plan["strategies"]] == ["object alone", "RAM + object"]
    ram = plan["strategies"][1]["tiers"][0]
    assert ram["blocking_s"] == pytest.approx(7e9 * 12 / 4 / (data["ram"]["save_gbps"] * 1e9))


@pytest.mark.parametrize("nodes", [1, 2])
def test_bench_peer_transfer_under_torchrun(tmp_path, nodes):
    """Two processes with the environment torchrun gives them (RANK, WORLD_SIZE, MASTER_ADDR/PORT): on one
    node a gloo exchange, on two nodes (each its own) a real peer-tier replication."""
    port = free_port()
    out = tmp_path / "bench.json"
    procs = []
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "TIERFS_NODE_RANK": str(rank % nodes)}
        procs.append(subprocess.Popen([sys.executable, "-m", "tierfs.cli", "bench", "--size", "2MiB", "--repeats",
                                       "1", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env))
    try:
        for p in procs:
            _, err = p.communicate(timeout=180)
            assert p.returncode == 0, err[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    data = json.loads(out.read_text())
    assert data["peer"]["world_size"] == 2 and data["peer"]["gbps"] > 0
    assert ("PeerTier" in data["peer"]["method"]) == (nodes == 2)
    assert not any("peer transfer skipped" in n for n in data["notes"])


# -- plan and simulate ------------------------------------------------------------------------------

def test_plan_seed_examples_as_printed(capsys):
    code, out, err = run(capsys, "plan", "--params", "70B", "--hosts", 32, "--keep", 1, "--in-flight", 1,
                         "--replicas", 0)
    assert code == 0, err
    assert re.search(r"^  total +60\.38 GB$", out, re.M)
    code, out, err = run(capsys, "plan", "--checkpoint-size", "5TB", "--accelerators", "24000", "--mttf", "124min",
                         "--saves-per-mttf", 20)
    assert code == 0, err
    assert "every 6.2 min, 232 checkpoints/day, 1.16 PB/day" in out
    assert "sustained write 13.44 GB/s for the job" in out


def test_plan_and_simulate_full(capsys, tmp_path):
    args = ["--checkpoint-size", "5TB", "--accelerators", "24k", "--accelerator-mttf", "5.66y",
            "--ram-bw", "5GB/s", "--peer-bw", "3GB/s", "--object-bw", "200MB/s", "--object-total-bw", "100GB/s",
            "--step-time", "5s"]
    code, out, err = run(capsys, "plan", *args)
    assert code == 0, err
    for name in ("object alone", "RAM + object", "RAM + peers + object"):
        assert name in out
    code, out, err = run(capsys, "simulate", *args, "--sizes", "1k,100k", "--runs", 50, "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert [(r["accelerators"], r["strategy"]) for r in rows][:3] == [
        (1000, "object alone"), (1000, "RAM + object"), (1000, "RAM + peers + object")]
    for r in rows:
        lo, hi = r["goodput"]["ci95"]
        assert lo <= r["goodput"]["mean"] <= hi
        assert abs(r["goodput"]["mean"] - r["plan_goodput"]) < 0.005
    png = tmp_path / "g.png"
    code, out, err = run(capsys, "simulate", *args, "--sizes", "1k,10k", "--runs", 20, "--plot", png)
    assert code == 0, err
    assert "goodput [95% CI]" in out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in err and not png.exists()
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, needle", [
    (["plan", "--hosts", "4"], "one of the arguments --params --checkpoint-size is required"),
    (["plan", "--params", "7B"], "give --hosts or --accelerators"),
    (["plan", "--params", "7X", "--hosts", "4"], "expected e.g. 70B"),
    (["plan", "--params", "7B", "--hosts", "4", "--node-loss", "2"], "fraction"),
    (["plan", "--params", "7B", "--hosts", "4", "--bench", "/nonexistent/b.json"], "does not exist"),
    (["simulate", "--params", "7B", "--hosts", "4", "--sizes", "1k"], "--accelerator-mttf"),
    (["simulate", "--params", "7B", "--hosts", "4", "--mttf", "1h"], "nothing to simulate"),
])
def test_plan_and_simulate_errors_are_one_line(capsys, argv, needle):
    code, _, err = run(capsys, *argv)
    assert code in (1, 2)
    assert err.startswith("tierfs: error: ") and err.count("\n") == 1 and needle in err


def test_help_for_every_subcommand(capsys):
    for cmd in ("ls", "verify", "cp", "gc", "export", "plan", "simulate", "bench"):
        code, out, _ = run(capsys, cmd, "--help")
        assert code == 0 and f"usage: tierfs {cmd}" in out


def test_plan_as_a_program():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "tierfs.cli", "plan", "--params", "70B", "--hosts", "32",
                        "--keep", "1", "--replicas", "0"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "60.38 GB" in r.stdout


def test_the_worked_examples_in_docs_planning_print_what_the_page_shows(capsys):
    """Every ``$ tierfs plan|simulate ...`` block of docs/planning.md is this code's output, verbatim."""
    import shlex

    text = (REPO / "docs" / "planning.md").read_text()
    blocks = re.findall(r"```\n(\$ tierfs (?:plan|simulate) [^\n]*)\n(.*?)```", text, re.S)
    assert len(blocks) >= 5
    for command, shown in blocks:
        code, out, err = run(capsys, *shlex.split(command)[2:])
        assert code == 0, err
        assert out.rstrip() == shown.rstrip(), command


def test_simulate_takes_the_intervals_a_config_file_gives(tmp_path, capsys):
    cfg = tmp_path / "tiers.json"
    cfg.write_text(json.dumps({"tiers": [
        {"kind": "memory", "path": str(tmp_path / "ram"), "save": {"every_n_steps": 12}},
        {"kind": "object", "url": "s3://b/run", "save": {"every_n_seconds": 600}}]}))
    args = ["--checkpoint-size", "840GB", "--hosts", "32", "--mttf", "2h", "--ram-bw", "5GB/s",
            "--object-bw", "200MB/s", "--replicas", "0", "--step-time", "5s", "--config", cfg]
    code, out, err = run(capsys, "plan", *args, "--json")
    assert code == 0, err
    ram_obj = json.loads(out)["strategies"][1]
    assert [t["interval_s"] for t in ram_obj["tiers"]] == [60.0, 600.0]  # 12 steps of 5 s; 600 s
    code, out, err = run(capsys, "simulate", *args, "--runs", 20, "--json")
    assert code == 0, err
    assert [r["strategy"] for r in json.loads(out)] == ["object alone", "RAM + object"]
    code, _, err = run(capsys, "plan", *[a for a in args if a not in ("--step-time", "5s")])
    assert code == 2 and "give --step-time" in err
