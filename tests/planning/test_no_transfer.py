"""A profile measured without the KV transfer (``splitserve profile --no-transfer``) has none: no stand-in
figure in the file, and its parts say which were measured. ``simulate`` refuses a disaggregated deployment on
it, naming the part, and runs a colocated one (which hands no KV over), saying so; ``plan`` refuses unless
asked for colocated deployments only (``--mode colocated``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from splitserve.deploy.profile import MissingPart, Profile

CLI = [sys.executable, "-m", "splitserve.cli"]
WORKLOAD = ["--dataset", "chat", "--num-prompts", "10"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def no_transfer(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("no-transfer") / "profile.json"
    done = run(
        "profile", "--model", str(tiny_model_dir), "--quick", "--threads", "1", "--no-transfer", "--out", str(out)
    )
    assert done.returncode == 0, done.stderr
    assert "KV transfer: not measured; the profile has none" in done.stdout
    return out


def test_the_profile_holds_no_transfer_and_says_so(no_transfer):
    data = json.loads(no_transfer.read_text())
    assert data["transfer"] is None and data["transfers"] == []
    assert data["parts"] == {"steps": "measured", "transfer": "not measured", "serving": "not measured"}
    assert not {"transfer_latency_s", "transfer_bytes_per_s"} & set(data), "no figure stands in for it"
    profile = Profile.load(no_transfer)
    assert profile.transfer is None and not profile.measured("transfer") and profile.measured("steps")
    with pytest.raises(MissingPart, match=r"^transfer: the profile of model has no KV transfer \(not measured\)"):
        profile.transfer_s(1024)


def test_simulate_refuses_a_disaggregated_deployment_naming_the_transfer(no_transfer):
    done = run("simulate", "--profile", str(no_transfer), *WORKLOAD, "--request-rate", "5", "--json")
    assert done.returncode == 2, done.stdout
    assert "splitserve simulate: error: transfer: the profile of model has no KV transfer (not measured)" in done.stderr
    assert "a disaggregated deployment hands each request's KV" in done.stderr


def test_simulate_runs_a_colocated_deployment_and_says_the_transfer_was_not_needed(no_transfer):
    done = run("simulate", "--profile", str(no_transfer), "--mode", "colocated", *WORKLOAD, "--request-rate", "5")
    assert done.returncode == 0, done.stderr
    assert "colocated profile (model): transfer not measured; not needed: a colocated deployment" in done.stderr
    done = run("simulate", "--profile", str(no_transfer), "--mode", "colocated", *WORKLOAD, "--json")
    result = json.loads(done.stdout)
    assert result["completed"] == 10
    assert result["profile_parts"] == {
        "colocated": {"steps": "measured", "transfer": "not measured", "serving": "not measured"}
    }


def test_plan_refuses_it_unless_asked_for_colocated_deployments_only(no_transfer):
    args = ["plan", "--profile", str(no_transfer), "--slo", "ttft:1000", "tpot:100", "--devices", "2"]
    args += [*WORKLOAD, "--min-duration", "1", "--json"]
    done = run(*args)
    assert done.returncode == 2, done.stdout
    assert "splitserve plan: error: transfer: the profile of model has no KV transfer" in done.stderr
    assert "--mode colocated" in done.stderr
    done = run(*args, "--mode", "colocated")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert rows and {row["mode"] for row in rows} == {"colocated"}
