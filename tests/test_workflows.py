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


def deployed_environments() -> list[tuple[dict, dict, object]]:
    """deploy.yml's jobs, each with its call's inputs and the platform spec of the stack it deploys
    (the serving spec's `platform.spec`)."""
    from infra.platform_stack.spec import load_platform_spec
    from infra.spec_checks import load_spec

    jobs = load("deploy.yml")["jobs"]
    assert set(jobs) == {"dev", "prod"}
    return [(job, job["with"], load_platform_spec(REPO_ROOT / load_spec(STACKS_DIR / f"{job['with']['stack']}.yaml")
                                                  .platform.spec)) for job in jobs.values()]


def test_each_deploy_job_assumes_the_ci_role_its_platform_trusts_for_that_environment():
    """The CI role's trust admits GitHub's OIDC token whose sub is `repo:<repo>:environment:<env>`
    for the platform spec's cloud.ci.environments (infra/platform_stack/cloud/aws.py ci_identities):
    the job must request that token (`permissions: id-token: write`, on the caller too: a called
    workflow gets no more than its caller grants, GitHub docs "Reusing workflows"), run in that
    environment, and exchange it for exactly that role in the platform's region (GitHub docs
    "Configuring OpenID Connect in Amazon Web Services": audience sts.amazonaws.com, STS
    AssumeRoleWithWebIdentity). No stored AWS key: the only secrets are Pulumi's and the kubeconfig."""
    from infra.platform_stack.cloud.aws import ci_role_name

    up = load("pulumi-up.yml")
    job = up["jobs"]["up"]
    assert job["environment"] == "${{ inputs.stack }}"
    assert job["permissions"] == {"contents": "read", "id-token": "write"}
    assert set(up["on"]["workflow_call"]["secrets"]) == {"PULUMI_ACCESS_TOKEN", "KUBECONFIG"}
    names = [s.get("name") for s in job["steps"]]
    assume = job["steps"][names.index("AWS credentials of the platform's CI role")]
    assert names.index(assume["name"]) < names.index("pulumi up with the policy pack")
    assert assume["env"]["AWS_REGION"] == "${{ inputs.region }}" and assume["env"]["CI_ROLE"] == "${{ inputs.ci-role }}"
    assert "audience=sts.amazonaws.com" in assume["run"]
    assert 'aws sts assume-role-with-web-identity' in assume["run"]
    assert '--role-arn "arn:aws:iam::$AWS_ACCOUNT_ID:role/$CI_ROLE"' in assume["run"]
    assert '--web-identity-token "file://' in assume["run"]  # the token never in argv
    assert "AWS_REGION=$AWS_REGION" in assume["run"]
    for caller, inputs, platform in deployed_environments():
        assert caller["permissions"] == {"contents": "read", "id-token": "write"}, inputs["stack"]
        assert inputs["stack"] in platform.cloud.ci.environments, inputs["stack"]
        assert inputs["ci-role"] == ci_role_name(platform.cloud.cluster.name)
        assert inputs["region"] == platform.cloud.region


def test_each_deploy_job_runs_where_its_cluster_api_endpoint_is_reached():
    """A GitHub-hosted runner reaches only a public API endpoint: the job of an environment whose
    platform makes a private-only one (EKS endpoint_public_access false, pulumi-eks) runs on the
    self-hosted runner its platform spec names (cloud.ci.runs_on), inside the VPC."""
    import json

    assert load("pulumi-up.yml")["jobs"]["up"]["runs-on"] == "${{ fromJSON(inputs.runs-on) }}"
    runners = {}
    for _, inputs, platform in deployed_environments():
        runners[inputs["stack"]] = json.loads(inputs["runs-on"])
        assert runners[inputs["stack"]] == platform.cloud.ci.runs_on
        cluster = platform.cloud.cluster
        if cluster.mode == "create" and not cluster.endpoint_public_access:
            assert "self-hosted" in runners[inputs["stack"]], inputs["stack"]
    assert runners == {"dev": ["ubuntu-24.04"], "prod": ["self-hosted", "pdstack-prod"]}


def test_a_private_cluster_whose_ci_runs_on_a_github_hosted_runner_is_refused(tmp_path, capsys):
    """platform-prod without cloud.ci.runs_on (so GitHub-hosted) and its private-only endpoint:
    preview refuses it naming the field and the fix, no traceback."""
    from infra.cli import main

    data = yaml.safe_load((STACKS_DIR / "platform-prod.yaml").read_text())
    del data["cloud"]["ci"]["runs_on"]
    path = tmp_path / "platform-prod.yaml"
    path.write_text(yaml.safe_dump(data))
    capsys.readouterr()
    assert main(["preview", "--offline", "--spec", str(path)]) == 2
    err = capsys.readouterr().err
    assert "cloud.ci.runs_on: ['ubuntu-24.04'] is a GitHub-hosted runner" in err and "Traceback" not in err, err
    assert "Fix: name a self-hosted runner inside the VPC" in err


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


FAKE_GH = """#!{python}
# gh as scripts/pr_comment uses it, over a pull request's comments kept in a file: `api user`
# answers as GitHub does for the token (a user's login, or HTTP 403 for an installation token such
# as GITHUB_TOKEN, whose comments are github-actions[bot]'s); --jq runs the script's own filter
# through jq; a PATCH edits any comment, as a token that may write pull requests can on GitHub.
import json, subprocess, sys
args, state = sys.argv[1:], {state!r}
data = json.load(open(state))
comments, token = data["comments"], data["token"]
author = token.get("login") or "github-actions[bot]"
method = args[args.index("--method") + 1] if "--method" in args else "GET"
if args[1] == "user":
    if "error" in token:
        sys.exit(print(token["error"], file=sys.stderr) or 1)
    if "login" not in token:
        sys.exit(print("gh: Resource not accessible by integration (HTTP 403)", file=sys.stderr) or 1)
    print(token["login"])
elif method == "GET":
    sys.stdout.write(subprocess.run([{jq!r}, "-r", args[args.index("--jq") + 1]], input=json.dumps(comments),
                                    capture_output=True, text=True, check=True).stdout)
else:
    body = open(args[args.index("-F") + 1].split("=@", 1)[1]).read()
    if method == "PATCH":
        cid = int(args[args.index("--method") + 2].rsplit("/", 1)[1])
        next(c for c in comments if c["id"] == cid)["body"] = body
    else:
        comments.append({{"id": 100 + len(comments), "user": {{"login": author}}, "body": body}})
    json.dump(data, open(state, "w"))
"""


def pr_comment_pushes(tmp_path: Path, comments: list[dict], token: dict, pushes: int = 2) -> tuple[list, list]:
    """scripts/pr_comment run once per push against the fake `gh`: (each run, the comments after)."""
    import json
    import os

    from tests.servers import require_binary

    state = tmp_path / "pr.json"
    state.write_text(json.dumps({"comments": comments, "token": token}))
    fake = tmp_path / "bin" / "gh"
    fake.parent.mkdir()
    fake.write_text(FAKE_GH.format(python=sys.executable, state=str(state), jq=require_binary("jq")))
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    runs = []
    for push in range(1, pushes + 1):
        (tmp_path / "diff.md").write_text(f"<!-- pdstack-diff -->\npush {push}\n")
        runs.append(subprocess.run([str(REPO_ROOT / "scripts/pr_comment"), "o/r", "5", str(tmp_path / "diff.md")],
                                   env=env, capture_output=True, text=True, timeout=60))
    return runs, json.loads(state.read_text())["comments"]


def test_pr_comment_edits_its_own_comment_and_creates_one_only_once(tmp_path):
    runs, comments = pr_comment_pushes(tmp_path, [{"id": 7, "user": {"login": "reviewer"},
                                                   "body": "a reviewer's comment"}], token={})
    assert [r.returncode for r in runs] == [0, 0], [r.stderr for r in runs]
    assert [(c["user"]["login"], c["body"]) for c in comments] == [
        ("reviewer", "a reviewer's comment"), ("github-actions[bot]", "<!-- pdstack-diff -->\npush 2\n")]


def test_pr_comment_never_edits_a_comment_somebody_else_wrote_with_the_marker(tmp_path):
    """Anyone may start a comment with the marker; the script edited the first such comment,
    whoever wrote it, so the first to comment owned the fleet diff (and a token that may write
    pull requests may edit anyone's comment: GitHub REST "Update an issue comment"). Ours is the
    comment the token's own identity wrote: GITHUB_TOKEN's github-actions[bot] (GET /user answers
    403 "Resource not accessible by integration" for it: docs.github.com REST "Get the
    authenticated user"), or a user token's login."""
    marker = "<!-- pdstack-diff -->\n"
    for token, ours, theirs in (({}, "github-actions[bot]", "mallory"),
                                ({"login": "pdstack-bot"}, "pdstack-bot", "github-actions[bot]")):
        folder = tmp_path / ours
        folder.mkdir()
        planted = [{"id": 3, "user": {"login": theirs}, "body": marker + "fleet unchanged, merge it"},
                   {"id": 4, "user": {"login": "reviewer"}, "body": "looks fine"}]
        runs, comments = pr_comment_pushes(folder, planted, token)
        assert [r.returncode for r in runs] == [0, 0], [r.stderr for r in runs]
        assert [r.stdout.strip() for r in runs] == ["created the comment", "updated comment 102"]
        assert comments == [*planted, {"id": 102, "user": {"login": ours}, "body": marker + "push 2\n"}]


def test_pr_comment_with_a_token_it_cannot_place_posts_nothing(tmp_path):
    runs, comments = pr_comment_pushes(tmp_path, [], {"error": "gh: Bad credentials (HTTP 401)"}, pushes=1)
    assert runs[0].returncode == 1 and comments == []
    assert "cannot tell whose GH_TOKEN this is (gh api user: gh: Bad credentials (HTTP 401)" in runs[0].stderr
    assert "Nothing was posted" in runs[0].stderr


def test_fleet_diff_lists_changed_stacks_and_names_the_unchanged_ones():
    done = subprocess.run([str(REPO_ROOT / "scripts/fleet_diff"), "HEAD"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("<!-- pdstack-diff -->\n## What this change does to the fleet")
    assert done.stdout.count("<!-- pdstack-diff -->") == 1
