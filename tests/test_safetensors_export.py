"""Export a committed step as a Hugging Face safetensors folder (API and ``tierfs export --safetensors``):
read back bit-exact by ``safetensors.torch.load_file`` and by ``transformers``' ``from_pretrained``.

A sharded (FSDP2) step exported whole is in tests/test_loader_state.py (its 2-rank job serves both)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from safetensors.torch import load, load_file  # noqa: E402

from tierfs import CheckpointManager, TieredStore  # noqa: E402
from tierfs.adapters.safetensors import export_safetensors, parse_size, plan_shards  # noqa: E402
from tierfs.cli import main  # noqa: E402
from tierfs.errors import ArgumentError  # noqa: E402
from tierfs.tiers import MemoryTier, ObjectTier  # noqa: E402


@pytest.fixture(scope="module")
def gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def _read(directory, files) -> dict:
    out: dict = {}
    for f in files:
        if f.endswith(".safetensors"):
            part = load_file(os.path.join(directory, f))
            assert not set(part) & set(out)
            out.update(part)
    return out


def test_a_dcp_step_exports_sharded_and_loads_with_from_pretrained(gpt2, shm_dir, tmp_path):
    """The manager's torch state (through DCP) with the model under "model.": several shards and their
    index; load_file and from_pretrained (config.json written beside) give the saved tensors bit for bit."""
    from transformers import GPT2LMHeadModel

    sd = gpt2.state_dict()
    with CheckpointManager([MemoryTier(shm_dir), ObjectTier(f"file://{tmp_path}/obj")]) as mgr:
        mgr.save(3, {"model": sd, "optim": {"lr": 0.1, "m": torch.ones(4)}})
        mgr.wait_until_finished()
        out = export_safetensors(mgr.store, tmp_path / "hf", prefix="model.", max_shard_size="100KB",
                                 config=gpt2.config.to_dict())
    assert out.step == 3 and len(out.files) > 2 and out.files[-1] == "model.safetensors.index.json"
    assert out.files[0] == f"model-00001-of-{len(out.files) - 1:05d}.safetensors"
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == out.weight_map and set(index["weight_map"]) == set(sd)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    assert all(os.path.getsize(tmp_path / "hf" / f) <= 100_000 + 4096 for f in out.files[:-1]
               if len([n for n, g in out.weight_map.items() if g == f]) > 1)
    got = _read(tmp_path / "hf", out.files)
    assert got.keys() == sd.keys()
    for k in sd:
        assert torch.equal(got[k], sd[k]), k
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").state_dict()
    for k in sd:
        assert torch.equal(loaded[k], sd[k]), k
    with pytest.raises(FileExistsError, match="already holds an export"):
        export_safetensors([ObjectTier(f"file://{tmp_path}/obj")], tmp_path / "hf", prefix="model")
    again = export_safetensors([ObjectTier(f"file://{tmp_path}/obj")], tmp_path / "hf", prefix="model",
                               overwrite=True)  # one shard now: the old ones and the index go
    assert again.files == ["model.safetensors"]
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]


def test_a_store_step_exports_whole_tensors_cast_to_bf16(shm_dir, tmp_path):
    """A step saved by the store directly (nested keys joined with '.'), cast to bfloat16 (ints stay)."""
    state = {"model": {"w": torch.randn(8, 4), "b": torch.randn(4, dtype=torch.float64), "n": torch.arange(3)},
             "extra": {"np": np.arange(6, dtype=np.float32).reshape(2, 3)}, "step": 7}
    with CheckpointManager([MemoryTier(shm_dir)], use_dcp=False) as mgr:
        mgr.save(5, state)
        mgr.wait_until_finished()
        out = export_safetensors(mgr.store, tmp_path / "hf", dtype="bf16")
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert out.files == ["model.safetensors"] and set(got) == {"model.w", "model.b", "model.n", "extra.np"}
    assert torch.equal(got["model.w"], state["model"]["w"].to(torch.bfloat16))
    assert torch.equal(got["model.b"], state["model"]["b"].to(torch.bfloat16))
    assert torch.equal(got["model.n"], state["model"]["n"]) and got["model.n"].dtype == torch.int64
    assert torch.equal(got["extra.np"], torch.arange(6.).reshape(2, 3).to(torch.bfloat16))


def test_a_lightning_step_exports_its_state_dict_by_name(shm_dir, tmp_path):
    pytest.importorskip("lightning")
    from tierfs.adapters.lightning import TieredCheckpointIO

    sd = {"net.0.weight": torch.randn(3, 2), "net.0.bias": torch.randn(3)}
    io = TieredCheckpointIO([MemoryTier(shm_dir)], blocking=True)
    io.save_checkpoint({"global_step": 4, "state_dict": sd, "optimizer_states": [{"state": {0: {"m": torch.ones(2)}}}]},
                       tmp_path / "last.ckpt")
    io.teardown()
    out = export_safetensors([MemoryTier(shm_dir)], tmp_path / "hf", prefix="state_dict")
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert out.step == 4 and got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)


def test_the_command_line_exports_to_a_directory_or_a_url_and_refuses_system_directories(shm_dir, tmp_path, capsys):
    import fsspec

    sd = {"a": torch.randn(64, 64), "b": torch.randn(64, 64), "c": torch.randn(10)}
    with CheckpointManager([MemoryTier(shm_dir)]) as mgr:
        mgr.save(2, {"model": sd})
        mgr.wait_until_finished()
    assert main(["export", shm_dir, str(tmp_path / "hf"), "--safetensors", "--step", "2", "--prefix", "model.",
                 "--max-shard-size", "10KB", "--dtype", "float16", "--no-progress"]) == 0
    assert "exported step 2" in capsys.readouterr().out
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                         "model-00002-of-00002.safetensors"]
    got = _read(tmp_path / "hf", sorted(set(index["weight_map"].values())))
    assert all(torch.equal(got[k], sd[k].half()) for k in sd)
    url = "memory://tierfs-test-export/hf"  # any fsspec URL
    assert main(["export", shm_dir, url, "--safetensors", "--prefix", "model", "--no-progress"]) == 0
    fs = fsspec.filesystem("memory")
    got = load(fs.cat(url + "/model.safetensors"))
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    fs.rm("/tierfs-test-export", recursive=True)
    for bad in ("/etc/tierfs-export", "file:///usr/local/x", "/proc/x", "s3:/bucket/x"):
        assert main(["export", shm_dir, bad, "--safetensors", "--no-progress"]) == 2, bad
        assert "tierfs: error:" in capsys.readouterr().err
    assert not os.path.exists("/etc/tierfs-export")
    assert main(["export", shm_dir, str(tmp_path / "x"), "--safetensors", "--dcp"]) == 2
    assert main(["export", shm_dir, str(tmp_path / "x"), "--dcp", "--prefix", "model."]) == 2
    assert main(["export", shm_dir, str(tmp_path / "x"), "--safetensors", "--prefix", "nope.", "--no-progress"]) == 2
    assert "no tensor named 'nope.'" in capsys.readouterr().err
    assert main(["export", shm_dir, str(tmp_path / "hf"), "--safetensors", "--prefix", "model",
                 "--no-progress"]) == 1  # an export is there already: --overwrite
    assert "overwrite" in capsys.readouterr().err


def test_sizes_shards_and_steps_that_are_not_tensors(shm_dir, tmp_path):
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(1000) == 1000
    assert parse_size("500mb") == 5 * 10**8
    for bad in ("5XB", 0, "-1GB", True):
        with pytest.raises(ArgumentError, match="max_shard_size"):
            parse_size(bad)
    assert plan_shards([("a", 6), ("b", 6), ("c", 20), ("d", 1)], 10) == [["a"], ["b"], ["c"], ["d"]]
    assert plan_shards([("a", 4), ("b", 4), ("c", 4)], 10) == [["a", "b"], ["c"]]
    with TieredStore([MemoryTier(shm_dir)]) as store:  # a Hugging Face Trainer step: its files
        store.save(1, {"model.safetensors": np.zeros(8, np.uint8)}, metadata={"transformers": {"checkpoint": "x"}})
        with pytest.raises(ArgumentError, match="Hugging Face Trainer"):
            export_safetensors(store, tmp_path / "hf")
        with pytest.raises(ArgumentError, match="dtype"):
            export_safetensors(store, tmp_path / "hf", dtype="int8")


def test_tied_weights_are_written_once_and_from_pretrained_ties_them_again(gpt2, shm_dir, tmp_path, capsys):
    """GPT-2's lm_head.weight is its token embedding: --tie writes it once, as save_pretrained does, and
    from_pretrained ties them again; files are 0644 under the usual umask (0600 when asked); a tie of two
    different tensors, and a config that unties embeddings, are refused; messages name the caller's argument."""
    from transformers import GPT2LMHeadModel

    sd = gpt2.state_dict()
    assert "lm_head.weight" in sd  # the state dict holds both names
    with TieredStore([MemoryTier(shm_dir)]) as store:
        store.save(4, {"model": sd})
        store.wait_until_finished()
        old = os.umask(0o022)
        try:
            out = export_safetensors(store, tmp_path / "hf", prefix="model.", config=gpt2.config.to_dict(),
                                     tie={"lm_head.weight": "transformer.wte.weight"})
        finally:
            os.umask(old)
        assert out.tied == {"lm_head.weight": "transformer.wte.weight"} and "lm_head.weight" not in out.weight_map
        got = load_file(tmp_path / "hf" / "model.safetensors")
        assert set(got) == set(sd) - {"lm_head.weight"}
        assert all(torch.equal(got[k], sd[k]) for k in got)
        assert {f: oct(os.stat(tmp_path / "hf" / f).st_mode & 0o777) for f in os.listdir(tmp_path / "hf")} == \
            {"model.safetensors": "0o644", "config.json": "0o644"}
        model = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
        assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
        loaded = model.state_dict()
        assert all(torch.equal(loaded[k], sd[k]) for k in sd)

        private = export_safetensors(store, tmp_path / "private", prefix="model.", file_mode=0o600)
        assert oct(os.stat(tmp_path / "private" / private.files[0]).st_mode & 0o777) == "0o600"
        with pytest.raises(ArgumentError, match=r"tie lm_head.weight=transformer.h.0.ln_1.bias: the two differ"):
            export_safetensors(store, tmp_path / "bad", prefix="model.", tie={"lm_head.weight": "transformer.h.0.ln_1.bias"})
        with pytest.raises(ArgumentError, match="no tensor 'lm_head.w'"):
            export_safetensors(store, tmp_path / "bad", prefix="model.", tie={"lm_head.w": "transformer.wte.weight"})
        with pytest.raises(ArgumentError, match="tie_word_embeddings: false"):
            export_safetensors(store, tmp_path / "bad", prefix="model.", tie={"lm_head.weight": "transformer.wte.weight"},
                               config={**gpt2.config.to_dict(), "tie_word_embeddings": False})
        with pytest.raises(FileExistsError, match=r"pass overwrite=True to replace it$"):
            export_safetensors(store, tmp_path / "hf", prefix="model.")
    assert not os.path.exists(tmp_path / "bad" / "model.safetensors")

    args = ["export", shm_dir, str(tmp_path / "cli"), "--safetensors", "--prefix", "model.", "--no-progress",
            "--tie", "lm_head.weight=transformer.wte.weight", "--mode", "640"]
    assert main(args) == 0
    assert "lm_head.weight" not in load_file(tmp_path / "cli" / "model.safetensors")
    assert oct(os.stat(tmp_path / "cli" / "model.safetensors").st_mode & 0o777) == "0o640"
    capsys.readouterr()
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "pass --overwrite to replace it" in err and "overwrite=True" not in err
    assert main(args[:-2] + ["--mode", "9"]) == 2
    assert "--mode must be octal" in capsys.readouterr().err
