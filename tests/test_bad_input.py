"""Bad input at every public entry point of the library: one clear, one-line, actionable tierfs error in the
user's terms.

For each case the error is a ``TierfsError`` of the right subclass (``ArgumentError``,
``StateMismatchError``, ``TierUnavailableError``, ...), its message is one line, names the user's
argument, key or step, and shows no internal entry name (``0,0|model.0.weight``, ``b|fqn``, ``x|...``).
Cases run in one process on small states, with a small real ``torch.nn`` model and its Adam state for the
DCP and manager paths. The command line and tier directories: test_bad_input_cli.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierfs import (ArgumentError, CheckpointManager, CheckpointManagerOptions, ChecksumError, RestoreError,
                    StateMismatchError, TieredStore, TierfsError, TierUnavailableError)
from tierfs.util.worker import Throttle
from tierfs.adapters.dcp import TieredReader, TieredWriter, export_dcp
from tierfs.cli import main
from tierfs.fs import TieredFileSystem
from tierfs.policies import (AnySavePolicy, BestN, ContinuousCheckpointingPolicy, CustomSteps, EveryNSeconds,
                             FixedIntervalPolicy, LatestN, RestorePolicy, SpecificStepsPolicy)
from tierfs.policies.spec import keep_policy, save_policy
from tierfs.tiers import MemoryTier, ObjectTier, PeerTier

sys.path.insert(0, str(Path(__file__).parent))
from _badinput import (SYSTEM_DIRS, Ctx, assert_clear, context, flip_first_byte_of, model_state,  # noqa: E402
                       small_state)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture
def ctx(shm_dir, tmp_path):
    yield from context(shm_dir, tmp_path)


def case(id: str, fn: Callable[[Ctx], Any], cls: type = ArgumentError, *needles: str) -> Any:
    return pytest.param(fn, cls, needles, id=id)


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def other_shape() -> dict[str, Any]:
    return model_state(n_in=5)  # model.0.weight (3, 5) where the checkpoint has (3, 4); Adam's state too


def with_tensor(**extra: Any) -> dict[str, Any]:
    s = model_state()
    s["model"].update(extra)
    return s


def _nested(depth: int) -> dict[str, Any]:
    state: dict[str, Any] = {"x": 1}
    for _ in range(depth):
        state = {"a": state}
    return state


#: states whose keys no reader would take back (as they were): (id, state, what the error shows)
BAD_KEYS = [
    ("empty", lambda: {"": np.zeros(2)}, ["empty key"]),
    ("empty-nested", lambda: {"loader": {"": np.zeros(2)}}, ["empty key", "under 'loader'"]),
    ("nul", lambda: {"a\0b": np.zeros(2)}, ["'a\\x00b'", "control character"]),
    ("tab-nested", lambda: {"loader": {"a\tb": np.arange(3)}}, ["'loader/a\\tb'", "control character"]),
    ("newline-in-json-leaf", lambda: {"cfg\n": 1}, ["'cfg\\n'", "control character"]),
    ("too-long", lambda: {"k" * 5000: np.zeros(2)}, ["5000 characters", "4096"]),
    ("slash", lambda: {"a/b": np.zeros(2)}, ["'a/b'", "'/'"]),
    ("dot-dot-slash", lambda: {"../x": np.zeros(2)}, ["'../x'", "'/'"]),
    ("absolute", lambda: {"/etc/passwd": np.zeros(2)}, ["'/etc/passwd'", "'/'"]),
    ("slash-nested", lambda: {"opt": {"a/b": 1.0}}, ["'a/b'", "under 'opt'"]),
]

CASES = [
    # -- TieredStore.save: steps ----------------------------------------------------------------------
    *[case(f"store.save-step-{name}", lambda c, v=v: c.store.save(v, small_state()), ArgumentError, "step", shown)
      for name, v, shown in [("str", "7", "'7' (a str)"), ("negative", -1, "got -1"),
                             ("too-large", 10**13, "999999999999"), ("none", None, "required"),
                             ("float", 1.0, "1.0 (a float)"), ("bool", True, "True (a bool)")]],
    # -- TieredStore.save: states, leaves, options -----------------------------------------------------
    case("store.save-set-leaf", lambda c: c.store.save(2, {"a": {1, 2}}), ArgumentError, "'a'", "set"),
    case("store.save-object-array", lambda c: c.store.save(2, {"opt": {"a": np.array([object()])}}),
         ArgumentError, "'opt/a'", "object"),
    case("store.save-lambda-leaf", lambda c: c.store.save(2, {"fn": lambda: 1}), ArgumentError, "'fn'", "function"),
    case("store.save-not-a-mapping", lambda c: c.store.save(2, [1, 2]), ArgumentError, "state", "mapping"),
    case("store.save-float-key", lambda c: c.store.save(2, {3.0: np.zeros(2)}), ArgumentError,
         "keys must be strings or ints"),
    case("store.save-same-name", lambda c: c.store.save(2, {3: np.zeros(2), "3": np.ones(2)}), ArgumentError,
         "two leaves named '3'"),
    case("store.save-nan-leaf", lambda c: c.store.save(2, {"loss": float("nan")}), ArgumentError, "'loss'", "JSON"),
    # -- keys a reader would not take back, or not as they were: refused before anything is written -----
    *[case(f"store.save-key-{name}", lambda c, state=state: c.store.save(2, state()), ArgumentError, *shown)
      for name, state, shown in BAD_KEYS],
    case("store.save-sparse-tensor", lambda c: c.store.save(2, {"adj": torch.eye(3).to_sparse()}), ArgumentError,
         "'adj'", "sparse_coo", "to_dense"),
    case("store.save-meta-tensor", lambda c: c.store.save(2, {"w": torch.empty(3, device="meta")}), ArgumentError,
         "'w'", "meta tensor"),
    case("store.save-meta-tensor-known-structure", lambda c: (c.store.save(2, {"t": torch.zeros(3)}), c.store.save(
        3, {"t": torch.empty(3, device="meta")})), ArgumentError, "'t'", "meta tensor"),
    case("store.save-too-deep", lambda c: c.store.save(2, _nested(3000)), ArgumentError, "deep"),
    case("store.save-empty-state", lambda c: c.store.save(2, {}), ArgumentError, "step 2", "empty"),
    case("store.save-only-empty-dicts", lambda c: c.store.save(2, {"opt": {}}), ArgumentError, "step 2", "empty"),
    case("store.save-bad-metadata", lambda c: c.store.save(2, small_state(), metadata={"f": object()}),
         ArgumentError, "metadata", "JSON"),
    case("store.save-bad-metrics", lambda c: c.store.save(2, small_state(), metrics=[1]), ArgumentError, "metrics"),
    case("store.save-blocking-str", lambda c: c.store.save(2, small_state(), blocking="no"), ArgumentError,
         "blocking", "True or False"),
    case("store.save-bad-timeout", lambda c: c.store.save(2, small_state(), timeout=-1), ArgumentError, "timeout"),
    case("store.should_save-str", lambda c: c.store.should_save("3"), ArgumentError, "step", "'3'"),
    # -- TieredStore.restore / restore_into / localize / delete / verify ------------------------------
    case("store.restore-step-str", lambda c: c.store.restore("1"), ArgumentError, "step", "'1' (a str)"),
    case("store.restore-step-negative", lambda c: c.store.restore(-1), ArgumentError, "step", "-1"),
    case("store.restore-step-bool", lambda c: c.store.restore(True), ArgumentError, "step", "True"),
    case("store.restore-tiers-str", lambda c: c.store.restore(tiers="ram"), ArgumentError, "tiers", "['ram']"),
    case("store.restore-tiers-unknown", lambda c: c.store.restore(tiers=["s3"]), ArgumentError, "'s3'", "ram"),
    case("store.restore-zero-copy-str", lambda c: c.store.restore(zero_copy="yes"), ArgumentError, "zero_copy"),
    case("store.restore-missing-step", lambda c: c.store.restore(5), TierfsError, "step 5", "[1]"),
    case("store.restore_into-shape", lambda c: c.store.restore_into({"w": np.zeros(5)}), StateMismatchError,
         "'w'", "(5,)", "(4,)", "shape"),
    case("store.restore_into-dtype", lambda c: c.store.restore_into({"w": np.zeros(4, np.float32)}),
         StateMismatchError, "'w'", "float32", "float64"),
    case("store.restore_into-nested-shape", lambda c: c.store.restore_into({"layer": {"b": np.ones(2, np.float32)}}),
         StateMismatchError, "'layer/b'", "(2,)", "(3,)"),
    case("store.restore_into-torch-shape",
         lambda c: c.store.restore_into({"w": torch.zeros(2, 2, dtype=torch.float64)}),
         StateMismatchError, "'w'", "(2, 2)", "(4,)"),
    case("store.restore_into-read-only", lambda c: c.store.restore_into({"w": _read_only(np.zeros(4))}),
         StateMismatchError, "'w'", "read-only"),
    case("store.restore_into-unexpected-key", lambda c: c.store.restore_into({"w": np.zeros(4), "extra": np.zeros(1)}),
         StateMismatchError, "'extra'", "step 1"),
    case("store.restore_into-not-a-mapping", lambda c: c.store.restore_into([np.zeros(4)]), ArgumentError, "state"),
    case("store.restore_into-step-float", lambda c: c.store.restore_into({"w": np.zeros(4)}, 1.0), ArgumentError,
         "step", "1.0"),
    case("store.localize-step-str", lambda c: c.store.localize("1"), ArgumentError, "step", "'1'"),
    case("store.localize-too-large", lambda c: c.store.localize(10**12), ArgumentError, "step", "1000000000000"),
    case("store.delete-step-str", lambda c: c.store.delete("1"), ArgumentError, "step", "'1'"),
    case("store.delete-tiers-unknown", lambda c: c.store.delete(1, tiers=["nope"]), ArgumentError, "'nope'"),
    case("store.verify-step-none", lambda c: c.store.verify(None, "ram"), ArgumentError, "step", "required"),
    case("store.verify-unknown-tier", lambda c: c.store.verify(1, "nope"), ArgumentError, "'nope'", "ram"),
    case("store.read_manifest-rank", lambda c: c.store.read_manifest(1, -1), ArgumentError, "rank", "-1"),
    # -- constructors: the store, tiers, policies, the throttle ---------------------------------------
    case("TieredStore-no-tiers", lambda c: TieredStore([]), ArgumentError, "at least one tier"),
    case("TieredStore-group-str", lambda c: TieredStore([MemoryTier(c.shm / "r")], group="x"), ArgumentError,
         "group", "'x' (a str)"),
    case("MemoryTier-nul-in-path", lambda c: MemoryTier(f"{c.shm}/r\0x"), ArgumentError, "NUL"),
    case("MemoryTier-path-too-long", lambda c: MemoryTier(f"{c.shm}/{'a' * 5000}"), ArgumentError, "too long"),
    case("MemoryTier-name-too-long", lambda c: MemoryTier(f"{c.shm}/{'a' * 300}/r"), ArgumentError, "too long",
         "300 bytes"),
    case("ObjectTier-path-too-long", lambda c: ObjectTier(f"file://{c.tmp}/{'b/' * 2500}"), ArgumentError,
         "too long"),
    case("TieredStore-a-str", lambda c: TieredStore("/dev/shm/x"), ArgumentError, "list of tiers"),
    case("TieredStore-not-a-tier", lambda c: TieredStore([object()]), ArgumentError, "tiers[0]"),
    case("TieredStore-max-in-flight", lambda c: TieredStore([MemoryTier(c.shm / "r")], max_in_flight=0),
         ArgumentError, "max_in_flight", "0"),
    case("TieredStore-when-busy", lambda c: TieredStore([MemoryTier(c.shm / "r")], when_busy="never"),
         ArgumentError, "when_busy", "'never'"),
    case("TieredStore-threads", lambda c: TieredStore([MemoryTier(c.shm / "r")], threads="4"), ArgumentError,
         "threads"),
    case("TieredStore-bandwidth", lambda c: TieredStore([MemoryTier(c.shm / "r")], background_bandwidth=-5),
         ArgumentError, "background bandwidth", "-5"),
    case("TieredStore-timeout", lambda c: TieredStore([MemoryTier(c.shm / "r")], timeout="soon"), ArgumentError,
         "timeout"),
    case("MemoryTier-budget", lambda c: MemoryTier(c.shm / "r", budget=-1), ArgumentError, "budget", "-1"),
    case("MemoryTier-name", lambda c: MemoryTier(c.shm / "r", name=""), ArgumentError, "name"),
    case("MemoryTier-path-type", lambda c: MemoryTier(5), ArgumentError, "MemoryTier path", "5"),
    case("MemoryTier-keep-is-a-save-policy", lambda c: MemoryTier(c.shm / "r", keep=FixedIntervalPolicy(2)),
         ArgumentError, "keep", "LatestN"),
    case("MemoryTier-save-is-a-keep-policy", lambda c: MemoryTier(c.shm / "r", save=LatestN(2)), ArgumentError,
         "save", "FixedIntervalPolicy"),
    *[case(f"MemoryTier-system-dir-{d}", lambda c, d=d: MemoryTier(d), ArgumentError, repr(d), "system directory")
      for d in SYSTEM_DIRS],
    case("MemoryTier-path-is-a-file", lambda c: TieredStore([MemoryTier(c.a_file)]), TierUnavailableError,
         "is a file"),
    case("MemoryTier-path-below-a-file", lambda c: TieredStore([MemoryTier(c.a_file / "job")]),
         TierUnavailableError, "is a file"),
    *[case(f"ObjectTier-system-dir-{d}", lambda c, d=d: ObjectTier(f"file://{d}"), ArgumentError, repr(d),
           "system directory") for d in SYSTEM_DIRS],
    case("ObjectTier-url-type", lambda c: ObjectTier(5), ArgumentError, "URL", "5"),
    case("ObjectTier-retries", lambda c: ObjectTier(f"file://{c.tmp}/o", retries=0), ArgumentError, "retries", "0"),
    case("ObjectTier-concurrency", lambda c: ObjectTier(f"file://{c.tmp}/o", concurrency="8"), ArgumentError,
         "concurrency", "'8'"),
    case("ObjectTier-path-is-a-file", lambda c: TieredStore([MemoryTier(c.shm / "r"), ObjectTier(f"file://{c.a_file}")]),
         TierUnavailableError, "is a file"),
    case("PeerTier-replicas", lambda c: PeerTier(replicas=0), ArgumentError, "replicas"),
    case("PeerTier-strategy", lambda c: PeerTier(strategy="star"), ArgumentError, "strategy", "'star'"),
    case("PeerTier-connections", lambda c: PeerTier(connections="2"), ArgumentError, "connections", "'2'"),
    case("FixedIntervalPolicy-str", lambda c: FixedIntervalPolicy("10"), ArgumentError, "interval", "'10'"),
    case("LatestN-zero", lambda c: LatestN(0), ArgumentError, "LatestN", "0"),
    case("LatestN-bool", lambda c: LatestN(True), ArgumentError, "LatestN", "True"),
    case("EveryNSeconds-str", lambda c: EveryNSeconds("1h"), ArgumentError, "interval_secs", "'1h'"),
    case("ContinuousCheckpointing-negative", lambda c: ContinuousCheckpointingPolicy(-1), ArgumentError,
         "minimum_interval_secs"),
    case("BestN-metric-not-callable", lambda c: BestN("loss", 2), ArgumentError, "metric_fn", "'loss'"),
    case("BestN-mode", lambda c: BestN(lambda m: m["loss"], 2, "median"), ArgumentError, "mode", "'median'"),
    case("SpecificSteps-str", lambda c: SpecificStepsPolicy(["a"]), ArgumentError, "steps", "'a'"),
    case("SpecificSteps-not-a-list", lambda c: SpecificStepsPolicy(5), ArgumentError, "steps", "5"),
    case("CustomSteps-negative", lambda c: CustomSteps([3, -1]), ArgumentError, "steps", "-1"),
    case("AnySavePolicy-keep-policy", lambda c: AnySavePolicy([LatestN(1)]), ArgumentError, "policies[0]"),
    case("RestorePolicy-prefer-str", lambda c: RestorePolicy(prefer="ram"), ArgumentError, "prefer", "['ram']"),
    case("RestorePolicy-step-str", lambda c: RestorePolicy(step="3"), ArgumentError, "step", "'3'"),
    case("keep-spec-zero", lambda c: keep_policy({"latest": 0}), ArgumentError, '"latest"', "0"),
    case("save-spec-unknown", lambda c: save_policy({"every": 10}), ArgumentError, "every"),
    case("Throttle-rate", lambda c: Throttle("fast"), ArgumentError, "bandwidth", "'fast'"),
    # -- CheckpointManager (torch state through DCP) -------------------------------------------------
    *[case(f"manager.save-step-{name}", lambda c, v=v: c.manager.save(v, model_state()), ArgumentError, "step", shown)
      for name, v, shown in [("negative", -5, "got -5"), ("str", "7", "'7' (a str)"), ("none", None, "required"),
                             ("float", 2.0, "2.0 (a float)"), ("bool", True, "True (a bool)"),
                             ("too-large", 10**13, "999999999999")]],
    case("manager.save-set-leaf", lambda c: c.manager.save(2, model_state() | {"seen": {1, 2}}), ArgumentError,
         "'seen'", "set"),
    case("manager.save-lambda-leaf", lambda c: c.manager.save(2, model_state() | {"fn": lambda: 1}), ArgumentError,
         "'fn'", "function"),
    case("manager.save-object-array", lambda c: c.manager.save(2, model_state() | {"ids": np.array([object()])}),
         ArgumentError, "'ids'", "object"),
    case("manager.save-bad-metrics", lambda c: c.manager.save(2, model_state(), metrics={"loss": object()}),
         ArgumentError, "metrics"),
    case("manager.save-not-a-mapping", lambda c: c.manager.save(2, [torch.zeros(2)]), ArgumentError, "state"),
    case("manager.save-tab-in-key", lambda c: c.manager.save(2, with_tensor(**{"a\tb": torch.zeros(2)})),
         ArgumentError, "'model.a\\tb'", "control character"),
    case("manager.save-sparse-tensor", lambda c: c.manager.save(2, with_tensor(adj=torch.eye(3).to_sparse())),
         ArgumentError, "'model.adj'", "sparse"),
    case("manager.save-meta-tensor", lambda c: c.manager.save(2, with_tensor(w=torch.empty(3, device="meta"))),
         ArgumentError, "'model.w'", "meta tensor"),
    case("manager.save-meta-tensor-known-structure", lambda c: c.manager.save(2, {**model_state(), "model": {
        k: torch.empty_like(v, device="meta") for k, v in model_state()["model"].items()}}), ArgumentError,
         "'model.0.weight'", "meta tensor"),
    case("manager.save-too-deep", lambda c: c.manager.save(2, {**model_state(), "cfg": _nested(3000)}), ArgumentError,
         "deep"),
    case("manager.restore-too-deep", lambda c: c.manager.restore({**model_state(), "cfg": _nested(3000)}),
         ArgumentError, "deep"),
    case("manager.save-long-key", lambda c: c.manager.save(2, with_tensor(**{"k" * 5000: torch.zeros(2)})),
         ArgumentError, "5008 characters"),
    case("manager.should_save-str", lambda c: c.manager.should_save("2"), ArgumentError, "step", "'2'"),
    case("manager.delete-str", lambda c: c.manager.delete("1"), ArgumentError, "step", "'1'"),
    case("manager.restore-step-str", lambda c: c.manager.restore(model_state(), step="1"), ArgumentError, "step"),
    case("manager.restore-not-a-mapping", lambda c: c.manager.restore([1]), ArgumentError, "state"),
    case("manager.restore-other-shape", lambda c: c.manager.restore(other_shape()), StateMismatchError,
         "'model.0.weight'", "(3, 5)", "(3, 4)"),
    case("manager.restore-unexpected-tensor", lambda c: c.manager.restore(with_tensor(**{"9.weight": torch.zeros(2)})),
         StateMismatchError, "'model.9.weight'"),
    case("manager.restore-unexpected-value", lambda c: c.manager.restore(model_state() | {"extra": 1}),
         StateMismatchError, "'extra'"),
    case("manager.restore-missing-step", lambda c: c.manager.restore(model_state(), step=4), TierfsError,
         "step 4", "[1]"),
    case("CheckpointManager-use-dcp", lambda c: CheckpointManager([MemoryTier(c.shm / "r")], use_dcp="yes"),
         ArgumentError, "use_dcp"),
    case("CheckpointManager-both", lambda c: CheckpointManager([MemoryTier(c.shm / "r")], directory="/x"),
         ArgumentError, "directory"),
    case("CheckpointManager-directory-type", lambda c: CheckpointManager(directory=5), ArgumentError, "directory"),
    case("CheckpointManager-directory-etc", lambda c: CheckpointManager(directory="/etc"), ArgumentError,
         "directory", "'/etc'", "system directory"),
    case("CheckpointManager-directory-file-url", lambda c: CheckpointManager(directory="file:///usr/lib/ckpt"),
         ArgumentError, "'/usr/lib/ckpt'", "system directory"),
    case("CheckpointManagerOptions-max-to-keep", lambda c: CheckpointManagerOptions(max_to_keep=0), ArgumentError,
         "max_to_keep"),
    case("CheckpointManagerOptions-best-mode", lambda c: CheckpointManagerOptions(best_mode="median"),
         ArgumentError, "best_mode"),
    # -- TieredWriter / TieredReader, dcp.save / dcp.load through them -------------------------------
    *[case(f"TieredWriter-step-{name}", lambda c, v=v: TieredWriter(c.dcp_store, v), ArgumentError, "step", shown)
      for name, v, shown in [("str", "7", "'7' (a str)"), ("negative", -1, "-1"), ("none", None, "required"),
                             ("float", 1.0, "1.0")]],
    case("TieredWriter-store", lambda c: TieredWriter(object(), 1), ArgumentError, "store", "TieredStore"),
    case("TieredWriter-replicated", lambda c: TieredWriter(c.dcp_store, 2, replicated="all"), ArgumentError,
         "replicated", "'all'"),
    case("TieredWriter-extra-names", lambda c: TieredWriter(c.dcp_store, 2, extra={1: "x"}), ArgumentError,
         "str names"),
    case("TieredWriter-extra-leaf", lambda c: TieredWriter(c.dcp_store, 2, extra={"s": {1}}), ArgumentError, "'s'"),
    case("TieredWriter-metrics", lambda c: TieredWriter(c.dcp_store, 2, metrics={"a": object()}), ArgumentError,
         "metrics"),
    case("TieredWriter-force-str", lambda c: TieredWriter(c.dcp_store, 2, force="yes"), ArgumentError, "force"),
    case("dcp.save-checkpoint-id", lambda c: dcp.save(model_state()["model"], storage_writer=TieredWriter(
        c.dcp_store, 2), checkpoint_id="latest"), ArgumentError, "checkpoint_id", "'latest'"),
    case("TieredReader-step-bool", lambda c: TieredReader(c.dcp_store, True), ArgumentError, "step", "True"),
    case("TieredReader-tiers-str", lambda c: TieredReader(c.dcp_store, tiers="ram"), ArgumentError, "tiers"),
    case("TieredReader-tiers-unknown", lambda c: TieredReader(c.dcp_store, tiers=["s3"]), ArgumentError, "'s3'"),
    case("TieredReader-collective-str", lambda c: TieredReader(c.dcp_store, collective="no"), ArgumentError,
         "collective"),
    case("dcp.load-checkpoint-id", lambda c: dcp.load(model_state()["model"], storage_reader=TieredReader(
        c.dcp_store), checkpoint_id="step_x"), ArgumentError, "checkpoint_id"),
    case("TieredReader.check_target-shape", lambda c: TieredReader(c.dcp_store).check_target(other_shape()["model"]),
         StateMismatchError, "'0.weight'", "(3, 5)", "(3, 4)"),
    case("TieredReader.check_target-missing", lambda c: TieredReader(c.dcp_store).check_target(
        model_state()["model"] | {"9.bias": torch.zeros(1)}), StateMismatchError, "'9.bias'"),
    case("export_dcp-step", lambda c: export_dcp(c.dcp_store, c.tmp / "out", step="1"), ArgumentError, "step"),
    case("export_dcp-into-a-file", lambda c: export_dcp(c.dcp_store, c.a_file, step=1), ArgumentError, "is a file"),
    # -- the tiered:: filesystem: options, its RAM directory, paths -----------------------------------
    *[case(f"tiered-option-{k}-{v}", lambda c, k=k, v=v: TieredFileSystem(str(c.shm / "f"), fo=f"file://{c.tmp}/t",
                                                                      skip_instance_cache=True, **{k: v}),
           ArgumentError, k, repr(v))
      for k, v in [("budget", "abc"), ("budget", -1), ("drain", "sometimes"), ("when_full", "drop"),
                   ("drain_concurrency", "x"), ("retries", 0), ("timeout", "x"), ("drain_bandwidth", -5)]],
    case("tiered-no-target", lambda c: TieredFileSystem(str(c.shm / "f"), skip_instance_cache=True), ArgumentError,
         "needs a target"),
    *[case(f"tiered-system-dir-{d}", lambda c, d=d: TieredFileSystem(d, fo=f"file://{c.tmp}/t",
                                                                     skip_instance_cache=True),
           ArgumentError, repr(d), "system directory") for d in ["/etc", "/proc", "/dev/shm", "/"]],
    case("tiered-path-is-a-file", lambda c: TieredFileSystem(str(c.a_file), fo=f"file://{c.tmp}/t",
                                                             skip_instance_cache=True), TierUnavailableError,
         "is a file"),
    case("tiered.pipe-int-path", lambda c: c.fs.pipe(5, b"x"), ArgumentError, "pipe", "5"),
    case("tiered.pipe-str-data", lambda c: c.fs.pipe(f"{c.root}/a.bin", "text"), ArgumentError, "bytes", "'text'"),
    case("tiered.pipe-unsafe-path", lambda c: c.fs.pipe(f"{c.root}/../a.bin", b"x"), ArgumentError, "unsafe path"),
    case("tiered.open-int-path", lambda c: c.fs.open(7, "rb"), ArgumentError, "7"),
    case("tiered.open-mode", lambda c: c.fs.open(f"{c.root}/a.bin", "r+b"), ArgumentError, "'r+b'"),
    case("tiered.cat-int-path", lambda c: c.fs.cat(3), ArgumentError, "cat", "3"),
    case("tiered.put-int-path", lambda c: c.fs.put(str(c.a_file), 7), ArgumentError, "put", "7"),
]


@pytest.mark.parametrize("fn, cls, needles", CASES)
def test_bad_input_is_one_clear_tierfs_error(ctx, fn, cls, needles):
    with pytest.raises(Exception) as info:
        fn(ctx)
    assert_clear(info.value, cls, *needles)


def test_a_bad_state_replaces_nothing(shm_dir):
    """The arguments are checked before anything happens: overwrite=True with a bad leaf keeps the old copy."""
    with TieredStore([MemoryTier(shm_dir)]) as store:
        store.save(1, small_state())
        with pytest.raises(ArgumentError):
            store.save(1, {"w": np.arange(4.0), "bad": {1, 2}}, overwrite=True)
        assert store.steps() == {1: ["ram"]}
        assert store.restore(1)[1].step == 1


def test_a_target_missing_entries_restores_the_rest(shm_dir):
    """Entries of the checkpoint the target lacks are not an error: they are listed in ``info.unused``."""
    with TieredStore([MemoryTier(shm_dir)]) as store:
        store.save(1, small_state())
        target = {"w": np.zeros(4)}
        info = store.restore_into(target)
        assert np.array_equal(target["w"], np.arange(4.0)) and info.unused == ["layer/b", "lr"]


def test_a_torch_target_takes_a_numpy_checkpoint_of_the_same_dtype(shm_dir):
    with TieredStore([MemoryTier(shm_dir)]) as store:
        store.save(1, small_state())
        target = {"w": torch.zeros(4, dtype=torch.float64)}
        store.restore_into(target)
        assert target["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_the_manager_loads_another_dtype_as_dcp_does(ctx):
    """On the DCP path a tensor of another dtype is converted (as dcp.load does), not an error."""
    target = model_state()
    target["model"]["0.weight"] = torch.zeros(3, 4, dtype=torch.float64)
    assert ctx.manager.restore(target) == 1
    assert torch.equal(target["model"]["0.weight"], model_state()["model"]["0.weight"].double())


def test_checksum_errors_name_the_users_key(ctx, capsys):
    store = ctx.dcp_store
    flip_first_byte_of(ctx.shm / "dcp", 1)
    with pytest.raises(ChecksumError) as info:
        store.verify(1, "ram")
    msg = assert_clear(info.value, ChecksumError, "'0.weight' (the chunk at 0,0)", "checksum mismatch")
    assert "0,0|" not in msg
    store.close()
    code = main(["verify", str(ctx.shm / "dcp")])
    out, err = capsys.readouterr()
    assert code == 1
    line = next(ln for ln in out.splitlines() if "FAILED" in ln)
    assert "'0.weight' (the chunk at 0,0)" in line and "|" not in line


def test_manager_restore_of_a_damaged_step_names_the_key(ctx):
    ctx.manager.close()
    flip_first_byte_of(ctx.shm / "mgr", 1)
    with CheckpointManager([MemoryTier(ctx.shm / "mgr")]) as mgr:
        with pytest.raises(RestoreError) as info:
            mgr.restore(model_state())
    assert_clear(info.value, RestoreError, "checksum mismatch")



@pytest.mark.parametrize("name, dcp_step, shown", [
    ("0,0|model.0.weight", True, "'model.0.weight' (the chunk at 0,0)"),
    ("128|layer.bias", True, "'layer.bias' (the chunk at 128)"),
    ("|optim.state.0.step", True, "'optim.state.0.step'"),
    ("b|extra_state", True, "'extra_state'"),
    ("x|index", True, "'index' (a value saved beside the DCP tensors)"),
    ("b|not-dcp", False, "'b|not-dcp'"),  # a store's own entry is the user's key, whatever it holds
    ("layer/w", False, "'layer/w'"),
])
def test_user_key_of_an_entry(name, dcp_step, shown):
    from tierfs.format import dcp_entry_name, user_key

    assert user_key(name, dcp_step) == shown
    if dcp_step and not name.startswith(("b|", "x|")):
        offsets, fqn = name.split("|", 1)
        assert dcp_entry_name(fqn, [int(o) for o in offsets.split(",")] if offsets else None, False) == name


@pytest.mark.parametrize("name, state, shown", BAD_KEYS, ids=[k[0] for k in BAD_KEYS])
def test_a_key_no_reader_takes_back_never_costs_the_good_steps(shm_dir, name, state, shown):
    """A key a reader would refuse (or read back as another structure) is refused at save, before anything is
    written: with a keep policy of one step, the good step is still there and restores, also after reopening."""
    good = small_state()
    with TieredStore([MemoryTier(shm_dir, keep=LatestN(1))]) as store:
        assert store.save(1, good)
        for step in (2, 3):  # a second try too: nothing of the first is left to trip on
            with pytest.raises(ArgumentError) as info:
                store.save(step, state())
            msg = assert_clear(info.value, ArgumentError, *shown)
            assert len(msg) < 400, msg
        assert store.steps() == {1: ["ram"]}
    with TieredStore([MemoryTier(shm_dir, keep=LatestN(1))]) as store:
        restored, info = store.restore()
        assert info.step == 1
        assert np.array_equal(restored["w"], good["w"]) and np.array_equal(restored["layer"]["b"], good["layer"]["b"])


def test_nested_keys_come_back_as_they_were_saved(shm_dir):
    """Keys are kept exactly: nesting round-trips, and names that look like paths are plain keys."""
    state = {"a": {"b": np.arange(3.0), "..": np.ones(2)}, "~": {"x": 1}, ".": "dot", "a.b": np.zeros(1)}
    with TieredStore([MemoryTier(shm_dir)]) as store:
        assert store.save(1, state)
        restored, _ = store.restore()
    assert restored.keys() == state.keys() and restored["a"].keys() == state["a"].keys()
    assert np.array_equal(restored["a"]["b"], state["a"]["b"]) and np.array_equal(restored["a"][".."], np.ones(2))
    assert restored["~"] == {"x": 1} and restored["."] == "dot" and np.array_equal(restored["a.b"], np.zeros(1))


def test_a_memory_tier_path_under_home_is_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert MemoryTier("~/ckpt").path == tmp_path / "ckpt"
    with TieredStore([MemoryTier("~/ckpt")]) as store:
        assert store.save(1, small_state())
    assert (tmp_path / "ckpt").is_dir() and not Path("~").exists()


def test_the_managers_keys_are_kept_exactly_on_dcps_path(shm_dir):
    """Through DCP (the manager's torch states) a key may hold '/': DCP's names keep the structure, in the
    first save of a structure and in the saves that reuse its plan."""
    with CheckpointManager([MemoryTier(shm_dir)]) as mgr:
        for step in (1, 2, 3):
            assert mgr.save(step, {"a/b": torch.full((2,), float(step)), "c": {"d/e": step}})
        target = {"a/b": torch.zeros(2), "c": {"d/e": 0}}
        assert mgr.restore(target) == 3
    assert torch.equal(target["a/b"], torch.full((2,), 3.0)) and target["c"] == {"d/e": 3}
