"""What people read: ``verify`` naming a damaged block by its file, bytes and key; ``plan`` and ``simulate``
output and options; sizes, durations and rates in human units (:mod:`tierfs.util.readable`) in the CLI, in
``RestoreInfo`` and in the store's log lines."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import numpy as np
import pytest

from tierfs import CheckpointManager, TieredStore
from tierfs.util import readable as _readable
from tierfs.cli import main
from tierfs.core.restore.pipeline import RestoreInfo
from tierfs.format import manifest_filename, step_dirname, user_key
from tierfs.cli.steps import find_damage
from tierfs.policies import FixedIntervalPolicy, LatestN, PreserveAll
from tierfs.tiers import MemoryTier, ObjectTier

BLOCK = 4096


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def manifest(step_dir: Path, rank: int = 0) -> dict:
    return json.loads((step_dir / manifest_filename(rank)).read_text())


def damaged_block(m: dict, file: str, pos: int) -> tuple[dict, int, int]:
    """The entry of manifest ``m`` holding byte ``pos`` of ``file`` and the file bytes of its block there."""
    entry = next(e for e in m["entries"] if e["kind"] == "array" and e["file"] == file
                 and e["offset"] <= pos < e["offset"] + e["length"])
    bs = m["block_size"]
    start = entry["offset"] + (pos - entry["offset"]) // bs * bs
    return entry, start, min(start + bs, entry["offset"] + entry["length"])


def failed_line(out: str) -> str:
    lines = [ln for ln in out.splitlines() if "FAILED" in ln]
    assert len(lines) == 1, out
    return lines[0]


# -- verify names the damaged file, its bytes and the user's key --------------------------------------

def test_verify_names_the_damaged_shard_file_its_bytes_and_the_key(shm_dir, capsys):
    # small blocks and files: an entry spans several blocks, the shard several files
    state = {"model": {"embed": np.arange(16384, dtype=np.float32), "head": np.ones(3000, np.float32)},
             "step": 7}
    with TieredStore([MemoryTier(shm_dir, keep=PreserveAll())], block_size=BLOCK, file_size=32 << 10) as store:
        store.save(7, state)
    step_dir = Path(shm_dir) / step_dirname(7)
    m = manifest(step_dir)
    assert len(m["files"]) > 1
    # a byte in the third block of the entry "model/embed", somewhere inside its shard file
    embed = next(e for e in m["entries"] if e["name"] == "model/embed")
    pos = embed["offset"] + 2 * BLOCK + 123
    flip_byte(step_dir / embed["file"], pos)
    entry, start, end = damaged_block(m, embed["file"], pos)
    assert entry["name"] == "model/embed" and end - start == BLOCK

    code, out, err = run(capsys, "verify", shm_dir)
    assert code == 1, err
    line = failed_line(out)
    assert line.startswith("ram (memory): FAILED: step 7 rank 0 on ram: ")
    assert f"{embed['file']} bytes {start}-{end}, part of 'model/embed': checksum mismatch (stored 0x" in line
    assert manifest_filename(0) not in line

    # a block of the last entry of another file: the range is in that file, cut at the entry's end
    flip_byte(step_dir / embed["file"], pos)  # undo
    head = next(e for e in m["entries"] if e["name"] == "model/head")
    assert head["file"] != embed["file"] or head["offset"] > 0
    pos = head["offset"] + head["length"] - 1
    flip_byte(step_dir / head["file"], pos)
    _, start, end = damaged_block(m, head["file"], pos)
    code, out, _ = run(capsys, "verify", shm_dir)
    assert code == 1
    assert f"step 7 rank 0 on ram: {head['file']} bytes {start}-{end}, part of 'model/head': checksum mismatch" in out
    assert end == head["offset"] + head["length"]


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_verify_names_the_users_key_of_a_dcp_step(shm_dir, capsys):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    with CheckpointManager([MemoryTier(shm_dir, save=FixedIntervalPolicy(1), keep=LatestN(2))],
                           block_size=BLOCK) as mgr:
        mgr.save(7, {"model": model.state_dict(), "epoch": 3})
        mgr.store.wait_until_finished()
    step_dir = Path(shm_dir) / step_dirname(7)
    m = manifest(step_dir)
    assert "dcp_shard" in m["metadata"]
    weight = next(e for e in m["entries"] if e["name"].endswith("|model.0.weight"))
    assert weight["name"] == "0,0|model.0.weight" and weight["length"] == 64 * 64 * 4
    pos = weight["offset"] + BLOCK + 17  # the entry's second block
    flip_byte(step_dir / weight["file"], pos)
    _, start, end = damaged_block(m, weight["file"], pos)

    code, out, err = run(capsys, "verify", shm_dir)
    assert code == 1, err
    line = failed_line(out)
    assert (f"FAILED: step 7 rank 0 on ram: {weight['file']} bytes {start}-{end}, part of 'model.0.weight' (the "
            "chunk at 0,0): checksum mismatch") in line
    assert "0,0|" not in line  # never the internal name
    assert user_key(weight["name"], dcp=True) == "'model.0.weight' (the chunk at 0,0)"


def test_find_damage_lists_every_bad_block_in_file_order(shm_dir):
    with TieredStore([MemoryTier(shm_dir)], block_size=BLOCK) as store:
        store.save(1, {"a": np.zeros(5 * BLOCK // 4, np.float32)})
    step_dir = Path(shm_dir) / step_dirname(1)
    m = manifest(step_dir)
    (e,) = [e for e in m["entries"] if e["kind"] == "array"]
    for pos in (e["offset"] + 3 * BLOCK + 1, e["offset"] + 5):
        flip_byte(step_dir / e["file"], pos)
    tier = MemoryTier(shm_dir)
    from tierfs.format import Manifest

    mf = Manifest.from_bytes((step_dir / manifest_filename(0)).read_bytes())
    found = find_damage(mf, tier.read_files(1, list(mf.files)))
    assert [(d.file, d.start - e["offset"], d.end - e["offset"]) for d in found] == [
        (e["file"], 0, BLOCK), (e["file"], 3 * BLOCK, 4 * BLOCK)]
    assert str(found[0]).startswith(f"{e['file']} bytes {e['offset']}-{e['offset'] + BLOCK}, part of 'a': checksum")


def test_cp_of_a_damaged_step_names_the_file_and_bytes(shm_dir, tmp_path, capsys):
    with TieredStore([MemoryTier(shm_dir)], block_size=BLOCK) as store:
        store.save(2, {"w": np.arange(3 * BLOCK, dtype=np.uint8)})
    step_dir = Path(shm_dir) / step_dirname(2)
    m = manifest(step_dir)
    (e,) = [e for e in m["entries"] if e["kind"] == "array"]
    flip_byte(step_dir / e["file"], e["offset"] + BLOCK)
    code, _, err = run(capsys, "cp", shm_dir, str(tmp_path / "out"))
    assert code == 1
    assert (f"step 2 rank 0 on ram: {e['file']} bytes {e['offset'] + BLOCK}-{e['offset'] + 2 * BLOCK}, part of "
            "'w': checksum mismatch") in err
    assert "nothing committed" in err and err.count("\n") == 1


# -- plan -------------------------------------------------------------------------------------------

PLAN = ["--params", "70B", "--hosts", "32", "--accelerator-mttf", "5.66y", "--ram-bw", "5GB/s", "--peer-bw", "3GB/s",
        "--object-bw", "200MB/s", "--step-time", "10s"]


def strategy_rows(out: str) -> list[list[str]]:
    """The rows of the strategies table, cut where the header's columns start (a blank first cell stays)."""
    header, *lines = out.split("strategies (")[1].split("\n\n")[0].splitlines()[1:]
    starts = [m.start() for m in re.finditer(r"\S+(?: \S+)*", header)] + [None]
    return [[ln[a:b].strip() for a, b in zip(starts, starts[1:])] for ln in lines]


def test_plan_explains_its_columns_and_never_prints_never(capsys):
    code, out, err = run(capsys, "plan", *PLAN)
    assert code == 0, err
    assert "never" not in out
    header = next(ln for ln in out.splitlines() if ln.strip().startswith("strategy ") and "tier" in ln)
    legend = out.split("\ncolumns\n")[1].split("\n\n")[0]
    legend_names = {ln[2:15].strip() for ln in legend.splitlines() if ln[2:15].strip()}
    for col in re.split(r"\s{2,}", header.strip())[2:]:
        assert col in legend_names, col
    for col in ("share", "reads from"):
        assert col in legend_names
    assert "blocks" not in header and "stall" in header
    # the object tier of RAM + peers + object: no failure restores from it (--replica-loss 0)
    rows = strategy_rows(out)
    first = next(i for i, r in enumerate(rows) if r[0] == "RAM + peers + object")
    assert [r[1] for r in rows[first:]] == ["ram", "peer", "object"]
    obj = rows[first + 2]
    assert obj[3:5] == ["-", "none"]
    assert ("note: RAM + peers + object: no failure reads the object tier (--node-loss 0.5, --replica-loss 0); "
            "it is saved for durability only, every 60.0 min (--max-object-interval)") in out
    # with some node losses that take the replicas too, the object tier has a real MTTF again
    code, out, err = run(capsys, "plan", *PLAN, "--replica-loss", "0.1")
    assert code == 0, err
    assert "none" not in " ".join(" ".join(r) for r in strategy_rows(out))


def test_plan_write_per_host_follows_each_tiers_interval_and_bytes(capsys):
    code, out, err = run(capsys, "plan", *PLAN, "--json")
    assert code == 0, err
    data = json.loads(out)
    shard = 840e9 / 32
    for sp in data["strategies"]:
        for t in sp["tiers"]:
            # each host writes its shard per save (to peers --replicas 1 x its shard) over the wall time
            # between saves, which is at least the interval
            assert t["bandwidth_total"] == pytest.approx(32 * t["bandwidth_per_host"])
            assert shard / t["interval_s"] * 0.99 < t["bandwidth_per_host"] <= shard / t["interval_s"]
    # two replicas: the peer tier writes twice what the RAM tier does at the same interval
    code, out, err = run(capsys, "plan", *PLAN, "--replicas", "2", "--peer-interval", "60min", "--ram-interval",
                         "60min", "--object-interval", "2h", "--json")
    assert code == 0, err
    tiers = {t["name"]: t for t in json.loads(out)["strategies"][2]["tiers"]}
    assert tiers["peer"]["bandwidth_per_host"] == pytest.approx(2 * tiers["ram"]["bandwidth_per_host"])
    assert tiers["object"]["bandwidth_per_host"] == pytest.approx(tiers["ram"]["bandwidth_per_host"] / 2)


def test_plan_object_cap_holds_when_no_failure_needs_the_peer_tier(capsys):
    # --node-loss 0: no failure reads the peer or object tier; the object interval still keeps to its cap
    code, out, err = run(capsys, "plan", *PLAN, "--node-loss", "0", "--json")
    assert code == 0, err
    for sp in json.loads(out)["strategies"][1:]:
        obj = next(t for t in sp["tiers"] if t["name"] == "object")
        assert obj["interval_s"] <= 3600.0
        assert obj["mttf_s"] is None
    code, out, err = run(capsys, "plan", *PLAN, "--node-loss", "0")
    assert code == 0 and "never" not in out
    rows = strategy_rows(out)
    assert all(not r[2].endswith(" d") for r in rows)  # no interval of days: every one within the 1 h cap
    assert [r[1] for r in rows if r[4] == "none"] == ["object", "peer", "object"]


def test_plan_options_match_their_help(capsys):
    # --restart and --replace default to 60s and 0: zero is a value they take
    code, out, err = run(capsys, "plan", "--params", "7B", "--hosts", "4", "--mttf", "1d", "--object-bw", "1GB/s",
                         "--restart", "0", "--replace", "0s", "--json")
    assert code == 0, err
    code, _, err = run(capsys, "plan", "--checkpoint-size", "1TB", "--bytes-per-param", "2", "--hosts", "4")
    assert code == 2 and "--bytes-per-param goes with --params" in err
    code, out, err = run(capsys, "plan", "--params", "1B", "--bytes-per-param", "2", "--hosts", "4")
    assert code == 0 and "checkpoint 2.00 GB" in out
    code, _, err = run(capsys, "plan", "--params", "7B", "--hosts", "4", "--headroom", "-1")
    assert code == 2 and "--headroom" in err
    code, _, err = run(capsys, "plan", "--params", "7B", "--accelerators", "0.2")
    assert code == 2 and "--accelerators" in err


# -- simulate ---------------------------------------------------------------------------------------

SIM = ["--params", "70B", "--accelerator-mttf", "5y", "--ram-bw", "5GB/s", "--object-bw", "1GB/s", "--runs", "20"]


def test_simulate_sizes_alone_needs_no_hosts(capsys):
    code, out, err = run(capsys, "simulate", *SIM, "--sizes", "1k,10k,100k")
    assert code == 0, err
    assert err == ""
    sizes = {ln.split()[0] for ln in out.splitlines()[2:] if ln[:1].isdigit()}
    assert sizes == {"1000", "10000", "100000"}
    assert "columns (means over the runs" in out
    # --hosts or --accelerators beside --sizes are not used, and a note says so
    code, out2, err = run(capsys, "simulate", *SIM, "--sizes", "1k,10k,100k", "--accelerators", "24000")
    assert code == 0 and "--accelerators 24000 not used" in err and err.count("\n") == 1
    assert out2 == out


def test_simulate_shows_the_object_store_at_each_size_with_data_parallelism(capsys):
    code, out, err = run(capsys, "simulate", *SIM, "--peer-bw", "10GB/s", "--sizes", "1k,100k", "--data-parallel", "8")
    assert code == 0, err
    assert "RAM + data-parallel peers + object" in out
    lines = [ln for ln in out.splitlines() if "if every copy were stored" in ln]
    assert [ln.split()[0] for ln in lines] == ["1000", "100000"]
    assert all("782.3 GiB per save (6.1 TiB if every copy were stored)" in ln for ln in lines)  # 840 GB once
    code, out, err = run(capsys, "simulate", *SIM, "--sizes", "1k", "--data-parallel", "200")
    assert code == 2 and "data-parallel degree 200" in err  # 125 hosts


def test_simulate_shows_what_coordinating_a_save_costs_at_each_size(capsys):
    code, out, err = run(capsys, "simulate", *SIM, "--sizes", "1k,100k")
    assert code == 0, err
    assert "per rank, the same at any size: 7 all-reduces of a few integers, at most 39 sockets" in out
    lines = [ln.strip() for ln in out.splitlines() if "object-store requests, " in ln and "sockets held" in ln]
    assert lines == ["1000 accelerators: 6,000 object-store requests, at most 39,000 sockets held in the job; no rank lists or "
                     "deletes another rank's objects",
                     "100000 accelerators: 600,000 object-store requests, at most 3,900,000 sockets held in the job; no rank "
                     "lists or deletes another rank's objects"]
    code, out, err = run(capsys, "simulate", *SIM, "--sizes", "1k", "--json")
    assert code == 0, err
    assert json.loads(out)[0]["coordination_per_save"]["object_requests"] == 6000


def test_simulate_shows_an_object_tier_save_s_requests_and_how_long_the_busiest_prefix_takes(capsys):
    from tierfs.planning import store_requests as requests

    code, out, err = run(capsys, "simulate", *SIM, "--sizes", "1k,8192")
    assert code == 0, err
    lines = [ln.strip() for ln in out.splitlines() if " requests (PUT " in ln]
    assert [ln.split()[0] for ln in lines] == ["1000", "8192"]
    small = requests.SMALL
    puts = 8192 * (7 + small["PUT"])  # 840 GB over 8,192 ranks: 97.8 MiB each, 7 files of 16 MiB
    assert lines[1].startswith(f"8192 accelerators, 97.8 MiB per rank in 7 files: "
                               f"{8192 * (7 + sum(small.values())):,.0f} requests (PUT {puts:,.0f}, GET"), lines[1]
    # 256 buckets of 32 ranks, each rank's 7 uploads and 5 small requests, the busiest; the step's prefix
    # takes only rank 0's marker requests (no rank asks the store for another's)
    busiest = 32 * (7 + 5)
    assert busiest > requests.AT_STEP and "HEAD" not in lines[1]
    assert lines[1].endswith(f"under 257 prefixes; the busiest ({busiest:,}) takes {busiest / 3.5:.0f} ms at S3's "
                             f"3,500 writes/s, {busiest / 1:.0f} ms at GCS's 1,000"), lines[1]
    code, out, err = run(capsys, "simulate", *SIM, "--sizes", "8192", "--json")
    got = json.loads(out)[0]["object_requests_per_save"]
    assert got["by_type"]["PUT"] == puts and got["busiest_prefix"] == busiest and got["prefixes"] == 257
    assert got["files_per_rank"] == 7


def test_the_request_model_counts_multipart_uploads_and_the_files_of_a_shard():
    from tierfs.planning.store_requests import object_save

    o = object_save(20e9, 8192)  # 20 GB per rank in 16 MiB files, each one PUT
    assert o.files == 1193 and o.per_file == 1 and o.busiest == o.busiest_bucket == 32 * (1193 + 5)
    assert object_save(20e9, 12).busiest_bucket == 1193 + 5 and object_save(20e9, 12).prefixes == 13
    m = object_save(64 << 20, 2, file_size=64 << 20, part_size=16 << 20)  # one file, 4 parts: start, parts, end
    assert m.files == 1 and m.per_file == 6
    assert object_save(1 << 20, 4, file_size=64 << 20, part_size=1 << 20).per_file == 15  # parts of 5 MiB at least


def test_simulate_options_match_their_help(capsys):
    code, _, err = run(capsys, "simulate", *SIM, "--sizes", "1k", "--runs", "1")
    assert code == 2 and "--runs" in err and "at least 2" in err
    code, _, err = run(capsys, "simulate", "--params", "70B", "--mttf", "1h", "--object-bw", "1GB/s", "--sizes", "1k")
    assert code == 2 and "--accelerator-mttf" in err
    code, _, err = run(capsys, "simulate", "--params", "70B", "--accelerator-mttf", "5y", "--object-bw", "1GB/s")
    assert code == 2 and "--hosts or --accelerators" in err
    code, out, err = run(capsys, "simulate", *SIM, "--hosts", "16", "--work", "2d")
    assert code == 0, err
    assert out.startswith("20 runs of 2 days of training")


# -- human units ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1, "1 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (16384, "16.0 KiB"), (1536, "1.5 KiB"),
    (1048575, "1.0 MiB"), (5 << 20, "5.0 MiB"), (3 << 30, "3.0 GiB"), (2 << 40, "2.0 TiB"),
])
def test_size(n, text):
    assert _readable.size(n) == text


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (999, "999 B"), (1500, "1.5 kB"), (5e6, "5.0 MB"), (26.25e9, "26.25 GB"), (60.375e9, "60.38 GB"),
    (840e9, "840.00 GB"), (5e12, "5.00 TB"),
])
def test_size_si(n, text):
    assert _readable.size(n, si=True) == text


@pytest.mark.parametrize("s, text", [
    (0, "0 ms"), (1e-7, "<0.01 ms"), (0.00025, "0.25 ms"), (0.0012, "1.2 ms"), (0.0125, "12.5 ms"),
    (0.95, "950 ms"), (0.9999, "1.0 s"), (1.5, "1.5 s"), (90, "90.0 s"), (372, "6.2 min"), (7200, "2.0 h"),
    (3 * 86400, "3.0 d"), (math.inf, "never"), (math.nan, "-"),
])
def test_duration(s, text):
    assert _readable.duration(s) == text


def test_rate():
    assert _readable.rate(13.44e9) == "13.44 GB/s"
    assert _readable.rate(200e6) == "200.0 MB/s"
    assert _readable.rate(16384, 0.0012) == "13.7 MB/s"
    assert _readable.rate(5e3) == "5.0 kB/s"
    assert _readable.rate(10, 0) == "-"
    assert _readable.rate(0) == "0 B/s"


def test_log_arguments_read_well_and_stay_numbers():
    r = logging.LogRecord("tierfs", logging.INFO, __file__, 1, "step %d replicated to peers: %s sent in %s",
                          (3, _readable.Bytes(16384), _readable.Seconds(0.0012)), None)
    assert r.getMessage() == "step 3 replicated to peers: 16.0 KiB sent in 1.2 ms"
    assert float(r.args[2]) == pytest.approx(0.0012) and r.args[1] == 16384  # type: ignore[index]


def test_restore_info_of_a_small_restore(shm_dir):
    info = RestoreInfo(step=3, tier="ram", nbytes=16384, seconds=0.0012)
    assert str(info) == "step 3 from tier 'ram': 16.0 KiB in 1.2 ms (13.7 MB/s)"
    with TieredStore([MemoryTier(shm_dir)]) as store:
        store.save(3, {"w": np.zeros(4096, np.float32)})
        _, info = store.restore()
    assert info.nbytes == 16384
    assert re.fullmatch(r"step 3 from tier 'ram': 16\.0 KiB in [0-9.]+ (ms|s) \([0-9.]+ [kMG]?B/s\)", str(info))


def test_copy_and_restore_log_lines_use_human_units(shm_dir, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tierfs")
    tiers = [MemoryTier(shm_dir), ObjectTier(f"file://{tmp_path}/obj", save=FixedIntervalPolicy(1))]
    with TieredStore(tiers) as store:
        store.save(1, {"w": np.zeros(4096, np.float32)})
        store.wait_until_finished()
        store.restore()
    msgs = [r.getMessage() for r in caplog.records]
    copied = next(m for m in msgs if m.startswith("step 1 copied"))
    assert re.fullmatch(r"step 1 copied ram -> \S+: 16\.0 KiB in [0-9.]+ (ms|s)", copied), copied
    restored = next(m for m in msgs if m.startswith("restored step 1"))
    assert "16.0 KiB in " in restored and "MB in" not in restored


def test_cli_outputs_use_human_units(shm_dir, tmp_path, capsys):
    with TieredStore([MemoryTier(shm_dir)]) as store:
        store.save(1, {"w": np.zeros(4096, np.float32)})
    code, out, err = run(capsys, "ls", shm_dir)
    assert code == 0, err
    assert re.search(r"^ +1 +committed +3 +16\.[0-9] KiB +1 ", out, re.M), out
    code, out, err = run(capsys, "verify", shm_dir)
    assert code == 0, err
    assert re.search(r"step 1: OK  16\.[0-9] KiB checked \(1 rank\) in [0-9.]+ (ms|s), ", out), out
    code, out, err = run(capsys, "cp", shm_dir, str(tmp_path / "copy"))
    assert code == 0, err
    assert re.search(r": 16\.0 KiB verified in [0-9.]+ (ms|s) \([0-9.]+ [kMG]?B/s\), commit marker written last",
                     out), out
    assert " MB in" not in out and "0.0 MB" not in out
