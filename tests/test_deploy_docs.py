"""docs/deploy.md, checked where this machine can: the Slurm script's bash syntax, the Kubernetes manifest's
structure (the RAM volume, the doctor before training, node identity, credentials, metrics), the tiers
config, every ``tierfs`` command line against the command's own parser, and ``tierfs doctor`` run with the
page's config against local servers."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import yaml

from tierfs import config
from tierfs.cli import build_parser, main

PAGE = (Path(__file__).resolve().parent.parent / "docs" / "deploy.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", PAGE, re.S)


def tierfs_commands() -> list[list[str]]:
    """Every ``tierfs ...`` command line on the page (in scripts, manifests and prose), as argv."""
    found = []
    for script in blocks("bash"):
        for m in re.finditer(r"tierfs (doctor|status) [^'\n]*", script):
            found.append(shlex.split(m.group(0).replace("$((SLURM_NNODES * 8))", "256"))[1:])
    for doc in blocks("yaml"):
        for m in re.finditer(r'command: (\["tierfs".*?\])', doc):
            found.append(json.loads(m.group(1))[1:])
    for m in re.finditer(r"`tierfs ((?:doctor|status|plan) [^`]*)`", PAGE):
        if not re.search(r"\b[A-Z]{3,}\b", m.group(1)):  # not a synopsis with placeholders (CONFIG, SIZE)
            found.append(shlex.split(m.group(1)))
    return found


def test_the_slurm_script_is_valid_bash_and_checks_each_node_before_training():
    (script,) = blocks("bash")
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    doctor, train = script.index("tierfs doctor"), script.index("torchrun")
    assert doctor < train and "set -euo pipefail" in script  # a ✘ (exit 1) stops the job before training
    assert "TIERFS_NODE_RANK=$SLURM_NODEID" in script and "TIERFS_METRICS_PORT=" in script


def test_the_kubernetes_manifest_sizes_shm_runs_doctor_first_and_names_each_node():
    (doc,) = [d for d in blocks("yaml")]
    job = yaml.safe_load(doc)
    assert job["kind"] == "PyTorchJob"
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    shm = {v["name"]: v for v in pod["volumes"]}["shm"]
    assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]
    (doctor,) = pod["initContainers"]
    (train,) = pod["containers"]
    assert doctor["command"][:2] == ["tierfs", "doctor"] and train["command"][0] == "torchrun"
    for c in (doctor, train):
        assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        assert c["envFrom"] == [{"secretRef": {"name": "object-store-credentials"}}]
        env = {e["name"]: e for e in c["env"]}
        assert "replica-index" in env["TIERFS_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert {e["name"]: e.get("value") for e in train["env"]}["TIERFS_METRICS_PORT"] == "9400"


def test_the_config_reads_and_every_command_line_parses(tmp_path):
    (cfg,) = blocks("json")
    path = tmp_path / "tiers.json"
    path.write_text(cfg)
    specs = config.read_config(path)
    assert [s.kind for s in specs] == ["memory", "peer", "object"]
    commands = tierfs_commands()
    assert {c[0] for c in commands} >= {"doctor", "status", "plan"}
    parser = build_parser()
    for argv in commands:
        parser.parse_args(argv)  # a bad option is a UsageError


def test_doctor_with_the_page_s_config_on_this_machine(launch_ready_node, s3_url, shm_dir, tmp_path, capsys):
    """The page's config with its paths and bucket pointed at this machine's: every check passes (the
    state size scaled down to what /dev/shm has here)."""
    url, opts = s3_url
    (cfg,) = blocks("json")
    tiers = json.loads(cfg)["tiers"]
    tiers[0]["path"] = f"{shm_dir}/job-42"
    tiers[2]["url"], tiers[2]["storage_options"] = url, opts
    path = tmp_path / "tiers.json"
    path.write_text(json.dumps({"tiers": tiers}))
    code = main(["doctor", str(path), "--state-size", "10MB", "--world-size", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert [ln[0] for ln in out.splitlines()] == ["✔"] * 6, out
