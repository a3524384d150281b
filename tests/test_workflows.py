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


def test_every_pull_request_gets_the_fleet_diff_without_credentials_and_one_updated_comment():
    wf = load("pull-request.yml")
    job = wf["jobs"]["fleet-diff"]
    assert "secrets." not in yaml.safe_dump(job)  # runs for forks: nothing it needs is secret
    assert job["permissions"] == {"contents": "read", "pull-requests": "write"}
    steps = {s.get("name"): s for s in job["steps"]}
    assert "scripts/fleet_diff" in steps["pdctl diff of every stack against the base"]["run"]
    assert "GITHUB_STEP_SUMMARY" in steps["pdctl diff of every stack against the base"]["run"]
    comment = steps["One comment on the pull request, updated on each push"]
    assert comment["if"] == "github.event.pull_request.head.repo.full_name == github.repository"
    preview = wf["jobs"]["preview"]
    assert preview["if"] == comment["if"]  # cluster credentials only where GitHub gives them
    (pulumi,) = [s for s in preview["steps"] if s.get("uses", "").startswith("pulumi/actions@")]
    assert pulumi["with"]["comment-on-pr"] is True and pulumi["with"]["edit-pr-comment"] is True


def test_pr_comment_edits_its_own_comment_and_creates_one_only_once(tmp_path):
    """scripts/pr_comment against a fake `gh` that keeps the PR's comments in a file."""
    import json
    import os

    state = tmp_path / "comments.json"
    state.write_text(json.dumps([{"id": 7, "body": "a reviewer's comment"}]))
    fake = tmp_path / "bin" / "gh"
    fake.parent.mkdir()
    fake.write_text(f"""#!{sys.executable}
import json, sys
args, state = sys.argv[1:], {str(state)!r}
comments = json.load(open(state))
method = args[args.index("--method") + 1] if "--method" in args else "GET"
if method == "GET":
    for c in comments:
        if c["body"].startswith("<!-- pdstack-diff -->"):
            print(c["id"])
else:
    body = open(args[args.index("-F") + 1].split("=@", 1)[1]).read()
    if method == "PATCH":
        cid = int(args[args.index("--method") + 2].rsplit("/", 1)[1])
        next(c for c in comments if c["id"] == cid)["body"] = body
    else:
        comments.append({{"id": 100 + len(comments), "body": body}})
    json.dump(comments, open(state, "w"))
""")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    for push in ("first push", "second push"):
        (tmp_path / "diff.md").write_text(f"<!-- pdstack-diff -->\n{push}\n")
        done = subprocess.run([str(REPO_ROOT / "scripts/pr_comment"), "o/r", "5", str(tmp_path / "diff.md")],
                              env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    comments = json.loads(state.read_text())
    assert [c["body"] for c in comments] == ["a reviewer's comment", "<!-- pdstack-diff -->\nsecond push\n"]


def test_fleet_diff_lists_changed_stacks_and_names_the_unchanged_ones():
    done = subprocess.run([str(REPO_ROOT / "scripts/fleet_diff"), "HEAD"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("<!-- pdstack-diff -->\n## What this change does to the fleet")
    assert done.stdout.count("<!-- pdstack-diff -->") == 1
