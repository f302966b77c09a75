"""Metrics on a dashboard: a 2-rank job with ``TIERFS_METRICS_PORT`` set, each rank scraped over HTTP and
read with prometheus-client's own parser between the job's phases. Saves move the counters and
histograms; an upload refused with a 500 shows in the fault counter; the object tier's lag rises while the
store throttles every upload (503 SlowDown) and falls to 0 once the upload lands."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

from _ports import free_ports
import gloo_job
from _faultproxy import FaultProxy

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "children", "metrics_child.py")


def scrape(port: int) -> list:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60).read().decode()
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def value(samples: list, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels``."""
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_a_2_rank_job_s_metrics_move_with_saves_faults_and_the_lag(s3_url, shm_dir, tmp_path):
    url, opts = s3_url
    fifos = tmp_path / "fifos"
    fifos.mkdir()
    for r in range(2):
        os.mkfifo(fifos / f"go{r}")
    base = free_ports(2, consecutive=True)[0]  # rank r serves on base + r
    with FaultProxy(opts["endpoint_url"]) as proxy:
        env = {"TIERFS_METRICS_PORT": str(base), "TIERFS_TEST_STORAGE_OPTIONS": json.dumps(
            {**opts, "endpoint_url": proxy.url, "skip_instance_cache": True,
             "config_kwargs": {"retries": {"max_attempts": 0}}})}
        procs = gloo_job.start_job(2, CHILD, shm_dir, url, str(fifos), same_node=True, env=env)
        try:
            # read-write: opening never waits for the rank to open its end
            go = [os.fdopen(os.open(fifos / f"go{r}", os.O_RDWR), "w") for r in range(2)]

            def phase(expected: str) -> list[list]:
                for p in procs:
                    line = p.stdout.readline().strip()
                    assert line == expected, (line, p.stderr.read() if line == "" else "")
                return [scrape(base + r) for r in range(2)]

            def on() -> None:
                for f in go:
                    f.write("go\n")
                    f.flush()

            got = phase("SAVED 2")
            for r, m in enumerate(got):
                labels = {"rank": str(r)}
                assert value(m, "tierfs_save_stall_seconds_count", **labels) == 2
                ram = value(m, "tierfs_saved_bytes_total", tier="ram", **labels)
                assert ram > 0 and value(m, "tierfs_saved_bytes_total", tier="s3", **labels) == ram
                assert value(m, "tierfs_durable_seconds_count", tier="s3", **labels) == 2
                assert value(m, "tierfs_tier_lag_steps", tier="s3", **labels) == 0
                assert value(m, "tierfs_tier_used_bytes", tier="ram", **labels) > 0

            def step3(r) -> bool:
                return r.method == "PUT" and "step_000000000003" in r.path
            proxy.fail_next(2, "internal", match=step3)  # two uploads refused with a 500: retried
            proxy.set_faults(1.0, ["slowdown"], match=step3)  # then every upload throttled until cleared
            on()
            got = phase("SAVED 3")
            for r, m in enumerate(got):  # the upload of step 3 cannot land: the lag shows it
                assert value(m, "tierfs_tier_lag_steps", tier="s3", rank=str(r)) == 1
                assert value(m, "tierfs_tier_backlog_bytes", tier="s3", rank=str(r)) > 0
            for r in range(2):  # s3fs's own 5 tries and one of tierfs's: tierfs counted the throttling
                proxy.wait_for(lambda q, r=r: step3(q) and f"/rank_0000{r}." in q.path and q.fault == "slowdown"
                               and len([x for x in proxy.log if x.fault == "slowdown" and x.path == q.path]) >= 6)
            proxy.clear()
            on()
            got = phase("DURABLE 3")
            for r, m in enumerate(got):
                labels = {"rank": str(r)}
                assert value(m, "tierfs_tier_lag_steps", tier="s3", **labels) == 0
                assert value(m, "tierfs_tier_backlog_bytes", tier="s3", **labels) == 0
                assert value(m, "tierfs_durable_seconds_count", tier="s3", **labels) == 3
                assert value(m, "tierfs_save_stall_seconds_count", **labels) == 3
                assert value(m, "tierfs_request_faults_total", tier="s3", kind="throttled", **labels) >= 1
            assert sum(value(m, "tierfs_request_faults_total", tier="s3", kind="transient") for m in got) == 2
            on()
            got = phase("RESTORED")
            for r, m in enumerate(got):
                assert value(m, "tierfs_restore_seconds_count", tier="s3", rank=str(r)) == 1
                assert value(m, "tierfs_restored_bytes_total", tier="s3", rank=str(r)) > 0
            on()
            for p in procs:
                out, err = p.communicate(timeout=120)
                assert p.returncode == 0, err[-3000:]
                assert json.loads(out.strip().splitlines()[-1])["restored_from"] == "s3"
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for f in locals().get("go", []):
                f.close()


def test_lightning_logs_tierfs_figures_next_to_the_loss(shm_dir, tmp_path):
    """A real Lightning fit with TieredCheckpointIO and TieredMetricsCallback: the CSV logger's file has
    the save stall and the RAM tier's use in the rows of the steps after a save."""
    pytest.importorskip("lightning")
    import csv

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from tierfs import metrics
    from tierfs.adapters.lightning import TieredCheckpointIO, TieredMetricsCallback
    from tierfs.tiers import MemoryTier

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            loss = self.net(batch[0]).pow(2).mean()
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 8)), batch_size=8)
    metrics.serve(None)  # kept for the logger, not served
    try:
        io = TieredCheckpointIO([MemoryTier(shm_dir)], blocking=True)  # committed (its figures noted) on return
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, plugins=[io], logger=CSVLogger(tmp_path),
                             log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2,
                                                        save_top_k=-1), TieredMetricsCallback()])
        trainer.fit(Model(), data)
        io.teardown()
    finally:
        metrics.off()
    (path,) = list(tmp_path.glob("lightning_logs/version_*/metrics.csv"))
    rows = list(csv.DictReader(path.open()))
    logged = [r for r in rows if r.get("tierfs/save_stall_seconds")]
    assert logged and all(float(r["tierfs/save_stall_seconds"]) > 0 for r in logged), rows
    assert any(float(r.get("tierfs/used_bytes/ram") or 0) > 0 for r in rows) and any(r.get("loss") for r in logged)


def test_the_hf_trainer_s_reporters_get_tierfs_figures(shm_dir, tmp_path):
    """A real Trainer: TieredMetricsCallback, installed first, adds the figures to the logs every callback
    after it gets (the reporting integrations, and here a recording one)."""
    pytest.importorskip("transformers")
    import numpy as np
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from tierfs import TieredStore, metrics
    from tierfs.adapters.transformers import TieredMetricsCallback
    from tierfs.tiers import MemoryTier

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x, labels=None):
            out = self.lin(x).squeeze(-1)
            return {"loss": (out - labels).pow(2).mean(), "logits": out}

    seen: list[dict] = []

    class Reporter(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs))

    data = [{"x": torch.randn(4), "labels": torch.randn(())} for _ in range(32)]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=3, logging_steps=1, report_to=[],
                             save_strategy="no", per_device_train_batch_size=8, use_cpu=True, disable_tqdm=True)
    metrics.serve(None)
    try:
        with TieredStore([MemoryTier(shm_dir)]) as store:
            store.save(1, {"w": np.ones(4, dtype=np.float32)})
            trainer = Trainer(model=Net(), args=args, train_dataset=data, callbacks=[Reporter()])
            cb = TieredMetricsCallback.install(trainer)
            trainer.train()
    finally:
        metrics.off()
    assert trainer.callback_handler.callbacks[0] is cb
    steps = [logs for logs in seen if "loss" in logs]
    assert len(steps) == 3 and all(logs["tierfs/save_stall_seconds"] > 0 for logs in steps), seen
    assert all(logs["tierfs/used_bytes/ram"] > 0 for logs in steps)
