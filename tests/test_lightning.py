"""TieredCheckpointIO with real Lightning on CPU: kill and resume bit-exact, object-tier resume, DDP."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

from _ports import free_port  # noqa: E402
from _steps import committed  # noqa: E402
from tierfs import TieredStore  # noqa: E402
from tierfs.adapters.lightning import TieredCheckpointIO, codec  # noqa: E402
from tierfs.errors import StepNotFoundError  # noqa: E402
from tierfs.policies import FixedIntervalPolicy, LatestN  # noqa: E402
from tierfs.tiers import MemoryTier, ObjectTier  # noqa: E402

CHILD = str(Path(__file__).parent / "children" / "lightning_child.py")
ROOT = str(Path(__file__).resolve().parents[1])


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TIERFS_EXIT_TIMEOUT", "60")
    return env


def _start(cfg, port=None):
    env = _env()
    if port is not None:
        env["MASTER_PORT"] = str(port)
    return subprocess.Popen([sys.executable, CHILD, json.dumps(cfg)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=os.path.dirname(cfg["out"]))


def _finish(p, cfg, timeout=120):
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, out[-3000:] + err[-5000:]
    return torch.load(cfg["out"], weights_only=True)


def _run(cfg, timeout=120):
    return _finish(_start(cfg), cfg, timeout)


def _same(a, b):
    assert a["global_step"] == b["global_step"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    sa, sb = a["optim"]["state"], b["optim"]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            assert torch.equal(torch.as_tensor(sa[i][k]), torch.as_tensor(sb[i][k])), (i, k)
    assert a["optim"]["param_groups"] == b["optim"]["param_groups"]


@pytest.fixture
def dirs(tmp_path, shm_dir):
    return {"ram": shm_dir, "obj": f"file://{tmp_path}/obj", "ckpt_dir": str(tmp_path / "ckpts"), "tmp": tmp_path}


def _cfg(d, **kw):
    cfg = {"ram": d["ram"], "obj": d["obj"], "ckpt_dir": d["ckpt_dir"], "obj_every": 3, "top_k": 2}
    cfg.update(kw)
    return cfg


# -- the codec: no pickle for tensors, JSON for the rest ----------------------------------------------------
def test_codec_roundtrip_keeps_types_and_keys():
    ckpt = {"global_step": 3, "epoch": 0, "state_dict": OrderedDict(w=torch.arange(6.).reshape(2, 3)),
            "optimizer_states": [{"state": {0: {"step": torch.tensor(3.), "exp_avg": torch.ones(2, dtype=torch.bfloat16)}},
                                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}]}],
            "loops": {"x": {"nan": math.nan, "inf": -math.inf, "none": None, "arr": np.arange(3)}},
            "hyper_parameters": {"dtype": torch.float16}, "t": torch.tensor([1, 2])[::2]}
    state, summary = codec.encode(ckpt, trust_pickle=False)
    assert summary["tensors"] == 4 and summary["pickles"] == 1 and summary["arrays"] == 1
    assert all(not k.startswith("p") or isinstance(v, np.ndarray) for k, v in state.items())
    back = codec.decode(state, allow_unpickle=False)
    assert type(back["state_dict"]) is OrderedDict and torch.equal(back["state_dict"]["w"], ckpt["state_dict"]["w"])
    st = back["optimizer_states"][0]["state"][0]
    assert st["exp_avg"].dtype == torch.bfloat16 and torch.equal(st["step"], torch.tensor(3.))
    assert back["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert math.isnan(back["loops"]["x"]["nan"]) and back["loops"]["x"]["inf"] == -math.inf
    assert back["loops"]["x"]["none"] is None and np.array_equal(back["loops"]["x"]["arr"], np.arange(3))
    assert back["hyper_parameters"]["dtype"] == torch.float16 and torch.equal(back["t"], torch.tensor([1]))


class _Custom:
    pass


def test_codec_rejects_what_only_full_unpickling_loads():
    with pytest.raises(codec.UnsafePickleError, match="hyper_parameters/obj.*trust_pickle"):
        codec.encode({"global_step": 1, "hyper_parameters": {"obj": _Custom()}}, trust_pickle=False)
    state, summary = codec.encode({"global_step": 1, "obj": _Custom()}, trust_pickle=True)
    assert summary["unsafe_pickles"] == ["/obj"]
    with pytest.raises(Exception):
        codec.decode(state, allow_unpickle=False)
    assert isinstance(codec.decode(state, allow_unpickle=True)["obj"], _Custom)


def test_importing_tierfs_does_not_import_lightning():
    code = "import sys, tierfs, tierfs.adapters; assert 'lightning' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], env=_env(), check=True)


# -- the plugin alone: paths, aliases, deferred removal ------------------------------------------------------
def test_paths_aliases_and_removal(tmp_path, shm_dir):
    io = TieredCheckpointIO([MemoryTier(shm_dir, keep=LatestN(10)),
                             ObjectTier(f"file://{tmp_path}/obj", save=FixedIntervalPolicy(2), keep=LatestN(10))],
                            remove_from="all", background_bandwidth=None)
    ck = lambda s: {"global_step": s, "epoch": 0, "state_dict": {"w": torch.full((4,), float(s))}}  # noqa: E731
    io.save_checkpoint(ck(1), tmp_path / "epoch=0-step=1.ckpt")
    io.save_checkpoint(ck(2), tmp_path / "epoch=0-step=2.ckpt")
    io.save_checkpoint(ck(2), tmp_path / "last.ckpt")  # the same step: an alias, not a second copy
    io.remove_checkpoint(tmp_path / "epoch=0-step=1.ckpt")  # right after the save: deferred, no race
    io.remove_checkpoint(tmp_path / "epoch=0-step=2.ckpt")  # last.ckpt still names step 2: kept
    assert io.load_checkpoint(tmp_path / "last.ckpt")["state_dict"]["w"][0] == 2
    io.teardown()
    store = TieredStore([MemoryTier(shm_dir), ObjectTier(f"file://{tmp_path}/obj")], cleanup=False)
    try:
        assert store.steps() == {2: ["ram", "file"]}
        assert store.manifest(2).metadata["lightning"]["paths"] == [str(tmp_path / "epoch=0-step=2.ckpt")]
    finally:
        store.close()
    # a new process (a new plugin): by the path in the step's metadata, "last*" = the newest step
    io2 = TieredCheckpointIO([MemoryTier(shm_dir), ObjectTier(f"file://{tmp_path}/obj")])
    assert io2.load_checkpoint(tmp_path / "epoch=0-step=2.ckpt")["global_step"] == 2
    assert io2.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 2
    with pytest.raises(StepNotFoundError):
        io2.load_checkpoint(tmp_path / "epoch=0-step=1.ckpt")
    io2.teardown()


def test_a_path_saved_again_in_a_step_no_tier_can_read_is_an_error_not_the_older_save(tmp_path):
    """model.ckpt was saved at steps 10 and 20, and step 20's manifest is damaged on its only tier: loading
    model.ckpt raises, naming step 20, rather than quietly resuming from step 10; a path that names its own
    step (as Lightning names checkpoints) still loads; a path no readable step was saved as names the
    unreadable step too."""
    from tierfs.errors import RestoreError

    io = TieredCheckpointIO([ObjectTier(f"file://{tmp_path}/obj")], blocking=True)
    io.save_checkpoint({"global_step": 5, "epoch": 0, "state_dict": {"w": torch.full((2,), 5.0)}},
                       tmp_path / "epoch=0-step=5.ckpt")
    for s in (10, 20):
        ck = {"global_step": s, "epoch": s // 10, "state_dict": {"w": torch.full((2,), float(s))}}
        io.save_checkpoint(ck, tmp_path / "model.ckpt")
    io.teardown()
    manifest = next(p for p in (tmp_path / "obj").rglob("*manifest*") if "step_000000000020" in str(p))
    manifest.write_bytes(manifest.read_bytes().replace(b'"global_step"', b'"global_stop"'))
    io2 = TieredCheckpointIO([ObjectTier(f"file://{tmp_path}/obj")])
    with pytest.raises(RestoreError, match=r"'.*model.ckpt': step 20 cannot be read .* step 10 was saved as it"):
        io2.load_checkpoint(tmp_path / "model.ckpt")
    # a path that names its own step is that step's, whatever newer step cannot be read
    assert io2.load_checkpoint(tmp_path / "epoch=0-step=5.ckpt")["global_step"] == 5
    with pytest.raises(StepNotFoundError, match=r"saved as '.*other.ckpt'; committed steps: \[5, 10, 20\]; step 20 "
                                                 r"cannot be read"):
        io2.load_checkpoint(tmp_path / "other.ckpt")
    io2.teardown()


# -- real training, killed and resumed -----------------------------------------------------------------------
def test_kill_and_resume_bit_exact_then_from_object_tier(dirs):
    total = 12
    ref = _run(_cfg(dirs, ckpt_dir=str(dirs["tmp"] / "ref" / "ckpts"), ram=dirs["ram"] + "-ref",
                    obj=dirs["obj"] + "-ref", max_steps=total, out=str(dirs["tmp"] / "ref.pt")))
    cfg = _cfg(dirs, max_steps=total, sleep=0.2, out=str(dirs["tmp"] / "killed.pt"))
    p = subprocess.Popen([sys.executable, CHILD, json.dumps(cfg)], env=_env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, cwd=str(dirs["tmp"]))
    deadline = time.time() + 60
    try:
        while True:  # until RAM holds a step >= 7 and the object tier a step >= 6 (committed, by listing)
            assert p.poll() is None, p.stderr.read().decode()[-3000:]
            assert time.time() < deadline, "no step committed in time"
            steps = committed(dirs["ram"], dirs["obj"])
            if any(s >= 7 for s in steps) and any(s >= 6 and "file" in t for s, t in steps.items()):
                break
            time.sleep(0.05)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert not os.path.exists(cfg["out"])
    steps = committed(dirs["ram"], dirs["obj"])
    newest = max(steps)
    assert newest < total
    last = os.path.join(dirs["ckpt_dir"], "last.ckpt")  # what callback.last_model_path named
    got = _run(_cfg(dirs, max_steps=total, resume=last, out=str(dirs["tmp"] / "resumed.pt")))
    assert got["restored"] == [newest, "ram"]
    _same(got, ref)
    # RAM wiped (another machine): the object tier serves its newest step, by its checkpoint path
    for f in Path(dirs["ram"]).iterdir():
        subprocess.run(["rm", "-rf", str(f)], check=True)
    obj_steps = sorted(s for s, t in committed(dirs["ram"], dirs["obj"]).items() if "file" in t)
    step = obj_steps[-1]
    path = os.path.join(dirs["ckpt_dir"], f"epoch={step - 1}-step={step}.ckpt")
    got = _run(_cfg(dirs, max_steps=total, resume=path, out=str(dirs["tmp"] / "resumed2.pt")))
    assert got["restored"] == [step, "file"]
    _same(got, ref)


def test_a_rollback_and_a_fresh_start_then_restarts_resume_the_new_timeline(dirs):
    _run(_cfg(dirs, max_steps=12, out=str(dirs["tmp"] / "first.pt")))  # RAM: 11, 12; object: 6, 9, 12
    path6 = os.path.join(dirs["ckpt_dir"], "epoch=5-step=6.ckpt")
    back = _run(_cfg(dirs, max_steps=9, resume=path6, data_seed=1, out=str(dirs["tmp"] / "back.pt")))
    assert back["restored"] == [6, "file"]  # back to step 6; steps 7, 8, 9 of another run
    assert sorted(committed(dirs["ram"], dirs["obj"])) == [6, 8, 9]  # 10, 11, 12 of the first run are gone
    again = _run(_cfg(dirs, max_steps=9, resume="auto", data_seed=1, out=str(dirs["tmp"] / "again.pt")))
    assert again["restored"] == [9, "ram"]
    _same(again, back)
    fresh = _run(_cfg(dirs, max_steps=2, data_seed=2, out=str(dirs["tmp"] / "fresh.pt")))  # no ckpt_path
    assert fresh["restored"] is None and sorted(committed(dirs["ram"], dirs["obj"])) == [1, 2]
    again = _run(_cfg(dirs, max_steps=2, resume="auto", data_seed=2, out=str(dirs["tmp"] / "again2.pt")))
    assert again["restored"] == [2, "ram"]
    _same(again, fresh)


def test_ddp_two_processes_rank0_saves_and_all_resume(dirs):
    rank_file = str(dirs["tmp"] / "rank")
    common = dict(devices=2, strategy="ddp", obj_every=2)
    ref_cfg = _cfg(dirs, ckpt_dir=str(dirs["tmp"] / "ref" / "ckpts"), ram=dirs["ram"] + "-ref",
                   obj=dirs["obj"] + "-ref", max_steps=6, out=str(dirs["tmp"] / "ref.pt"), **common)
    first_cfg = _cfg(dirs, max_steps=3, out=str(dirs["tmp"] / "a.pt"), **common)
    pr, pf = _start(ref_cfg, free_port()), _start(first_cfg, free_port())  # two jobs at once
    ref, first = _finish(pr, ref_cfg), _finish(pf, first_cfg)
    assert first["global_step"] == 3
    got = _run(_cfg(dirs, max_steps=6, resume=first["last_model_path"], out=str(dirs["tmp"] / "b.pt"),
                    rank_file=rank_file, **common))
    assert got["restored"] == [3, "ram"]
    _same(got, ref)
    ranks = [json.load(open(f"{rank_file}.{r}")) for r in (0, 1)]
    assert ranks[0]["step"] == ranks[1]["step"] == 6 and ranks[0]["w"] == ranks[1]["w"]
