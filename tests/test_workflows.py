"""The GitHub Actions workflows: linted by zizmor (offline audits), and shaped as the review
process needs: tests and a policy-checked preview of every stack on pull requests, `up` on
merge with prod after dev and behind its environment's approval."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from infra.spec import REPO_ROOT, STACKS_DIR

WORKFLOWS = REPO_ROOT / ".github" / "workflows"


def zizmor(path: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("zizmor", path=str(Path(sys.executable).parent)) or "zizmor"
    return subprocess.run([exe, "--offline", "--no-progress", str(path)], capture_output=True, text=True)


def test_workflows_pass_zizmor():
    result = zizmor(WORKFLOWS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_zizmor_catches_an_unpinned_action_and_template_injection(tmp_path):
    bad = tmp_path / ".github" / "workflows"
    bad.mkdir(parents=True)
    (bad / "bad.yml").write_text(yaml.safe_dump({
        "name": "bad", "on": {"pull_request_target": {}},
        "jobs": {"x": {"runs-on": "ubuntu-24.04", "steps": [
            {"uses": "actions/checkout@v4"},
            {"run": "echo ${{ github.event.pull_request.title }}"}]}}}))
    result = zizmor(bad)
    assert result.returncode != 0
    assert "unpinned-uses" in result.stdout and "template-injection" in result.stdout


def load(name: str) -> dict:
    data = yaml.safe_load((WORKFLOWS / name).read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as True
    return data


def test_pull_requests_run_the_tests_and_a_policy_checked_preview_of_every_stack():
    wf = load("pull-request.yml")
    assert "pull_request" in wf["on"]
    assert any(s.get("run") == "make test" for s in wf["jobs"]["test"]["steps"])
    preview = wf["jobs"]["preview"]
    stacks = sorted(p.stem for p in STACKS_DIR.glob("*.yaml"))
    assert sorted(preview["strategy"]["matrix"]["stack"]) == stacks
    (pulumi,) = [s for s in preview["steps"] if s.get("uses", "").startswith("pulumi/actions@")]
    assert pulumi["with"]["command"] == "preview" and pulumi["with"]["policyPacks"] == "policy"


def test_merges_deploy_dev_then_prod_behind_its_environment():
    wf = load("deploy.yml")
    assert wf["on"] == {"push": {"branches": ["main"]}}
    assert wf["jobs"]["prod"]["needs"] == "dev"
    assert [wf["jobs"][j]["with"]["stack"] for j in ("dev", "prod")] == ["dev", "prod"]
    up = load("pulumi-up.yml")["jobs"]["up"]
    assert up["environment"] == "${{ inputs.stack }}"  # prod's environment carries the approval rule
    (pulumi,) = [s for s in up["steps"] if s.get("uses", "").startswith("pulumi/actions@")]
    assert pulumi["with"]["command"] == "up" and pulumi["with"]["policyPacks"] == "policy"
