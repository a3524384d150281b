"""`pdctl diff`: six changes a reviewer meets, each classified by how the controllers act on it,
and the PR comment each one produces (golden files: tests/golden/diff/, rewritten with
PDSTACK_UPDATE_GOLDEN=1 after an intended change, then reviewed as a diff).

Controller behaviour the classification rests on:
- LeaderWorkerSet rolls every group when its template hash changes; the hash covers only
  leaderTemplate, workerTemplate and the subdomain policy (kubernetes-sigs/lws
  pkg/utils/utils.go LeaderWorkerTemplateHash), so spec.replicas scales without a restart.
- Karpenter replaces the nodes of a NodePool whose spec.template changed (drift); weight,
  limits and disruption are behavioural and not drift (karpenter.sh/docs/concepts/disruption/#drift).
- A Deployment rolls its pods when spec.template changes (kubernetes.io/docs/concepts/workloads/
  controllers/deployment/#updating-a-deployment); a mounted ConfigMap changing restarts nothing,
  hence the config-hash annotation on the pod templates that read one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from infra.cli import main
from infra.images import image_reference, platform_key
from infra.spec import REPO_ROOT
from tests.conftest import stack_data

GOLDEN = Path(__file__).parent / "golden" / "diff"
UPDATE = os.environ.get("PDSTACK_UPDATE_GOLDEN") == "1"
PROD = str(REPO_ROOT / "stacks/prod.yaml")
DEV = str(REPO_ROOT / "stacks/dev.yaml")


def _engine_image(d):  # the image built and pinned: its digest, with the platforms its manifest names
    engine = d["images"]["engines"][d["engine"]["kind"]]
    ref = image_reference(engine["image"])
    platforms = d["images"]["platforms"][platform_key(ref)]
    engine["image"] = ref.partition("@")[0] + "@sha256:" + "5e1f" * 16
    d["images"]["platforms"]["sha256:" + "5e1f" * 16] = platforms


def _bigger_decode(d):  # prod autoscales: more decode means a higher floor for the scaler
    d["deployment"]["decode"]["instances"] = 2
    d["deployment"]["decode"]["scaling"]["min_instances"] = 2
    d["deployment"]["pd_ratio"] = "1:2"


CHANGES = {  # name -> (stack, change, impact classes expected, classes that must not occur)
    "more-decode-instances": ("prod", _bigger_decode, {"scale"}, {"restart", "track", "node-replacement"}),
    "new-engine-image": ("prod", _engine_image, {"restart", "track"}, {"node-replacement", "scale"}),
    "router-weight": ("prod", lambda d: d["deployment"]["load_balancer"]["weights"].update(cache_threshold=0.6),
                      {"roll"}, {"restart", "track", "node-replacement"}),
    "node-instance-type": ("dev", lambda d: d["hardware"].update(instance_types=["p5en.48xlarge"]),
                           {"node-replacement"}, {"restart", "track"}),
    # the router's whole-request timeout is the gateway's: its pods roll, no engine restarts
    "gateway-timeout": ("prod", lambda d: d["timeouts"]["gateway_to_router"].update(timeout_seconds=1200),
                        {"config", "roll"}, {"restart", "track", "node-replacement"}),
    "policy-regression": ("prod", lambda d: d["model"]["weights"].update(prefix="deepseek-v3-AKIAABCDEFGHIJKLMNOP/"),
                          {"policy"}, set()),
}


def _diff(tmp_path, capsys, stack, change, output="json", extra=()):
    data = stack_data(stack)
    change(data)
    after = tmp_path / f"{stack}.yaml"
    after.write_text(yaml.safe_dump(data, sort_keys=False))
    capsys.readouterr()
    code = main(["diff", "--spec", str(after), "--against", PROD if stack == "prod" else DEV, "--output", output,
                 *extra])
    return code, capsys.readouterr()


@pytest.mark.parametrize("name", list(CHANGES))
def test_each_change_is_classified_by_what_its_controller_does(name, tmp_path, capsys):
    stack, change, expected, excluded = CHANGES[name]
    code, out = _diff(tmp_path, capsys, stack, change)
    doc = json.loads(out.out)
    classes = set(doc["impact_classes"])
    assert code == 0 and doc["kind"] == "pdstack/diff"
    assert expected <= classes, doc["impacts"]
    assert not excluded & classes, doc["impacts"]
    _, md = _diff(tmp_path, capsys, stack, change, output="markdown")
    path = GOLDEN / f"{name}.md"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(md.out)
    assert md.out == path.read_text()


def test_the_details_behind_the_classes(tmp_path, capsys):
    doc = json.loads(_diff(tmp_path, capsys, "prod", _engine_image)[1].out)
    restarts = [i for i in doc["impacts"] if i["class"] == "restart"]
    assert {i["resource"] for i in restarts} == {"LeaderWorkerSet/engine-prefill", "LeaderWorkerSet/engine-decode"}
    # 642 GiB at 4 GiB/s (2.7 min) plus 10 min to start (prod's start_minutes), per instance: 8 x 8 + 1 x 64 GPUs
    assert doc["gpu_minutes"] == pytest.approx(2 * 64 * (642 / 4 / 60 + 10), rel=0.01)
    assert doc["images"][0]["path"] == "engine"
    doc = json.loads(_diff(tmp_path, capsys, "prod", _bigger_decode)[1].out)
    assert any(i["resource"].startswith("ScaledObject/") and "minReplicaCount 1 -> 2" in i["detail"]
               for i in doc["impacts"]), doc["impacts"]
    # The LWS's replica count is the scaler's after the first apply (ignoreChanges): said, not counted
    assert any("LeaderWorkerSet/engine-decode spec.replicas: 1 -> 2 is not applied by pulumi up" in n
               for n in doc["not_applied"])
    assert not any(c["kind"] == "LeaderWorkerSet" for c in doc["changes"])
    data = stack_data("dev")  # without an autoscaler the count itself is the new capacity
    data["deployment"].setdefault("autoscaling", {})["enabled"] = False
    before = tmp_path / "fixed.yaml"
    before.write_text(yaml.safe_dump(data))
    data["deployment"]["decode"]["instances"] = 2
    data["deployment"]["pd_ratio"] = "1:2"
    after = tmp_path / "fixed-more.yaml"
    after.write_text(yaml.safe_dump(data))
    capsys.readouterr()
    assert main(["diff", "--spec", str(after), "--against", str(before), "--output", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert any("decode instances 1 -> 2 (no restart; new capacity)" in i["detail"] for i in doc["impacts"])
    doc = json.loads(_diff(tmp_path, capsys, "prod",
                           lambda d: d["timeouts"]["router_to_prefill"].update(timeout_seconds=250))[1].out)
    assert {"restart", "track"} <= set(doc["impact_classes"])  # SGLang's PD hop timeouts are engine settings
    assert {(f["role"], f["flag"]) for f in doc["engine_flags"]} == {
        ("prefill", "env SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"), ("decode", "env SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"),
        ("prefill", "env SGLANG_DISAGGREGATION_WAITING_TIMEOUT"), ("decode", "env SGLANG_DISAGGREGATION_WAITING_TIMEOUT")}
    for output in ("json", "markdown", "text"):  # the regression is named; the pasted key is never repeated
        out = _diff(tmp_path, capsys, "prod", CHANGES["policy-regression"][1], output=output)[1].out
        assert "AKIAABCDEFGHIJKLMNOP" not in out and "<AWS access key id redacted>" in out
    doc = json.loads(_diff(tmp_path, capsys, "prod", CHANGES["policy-regression"][1])[1].out)
    assert any("AWS access key id" in p for p in doc["policy"]["new"])


def test_an_engine_flag_change_restarts_the_groups_that_read_it(tmp_path, capsys):
    """The flags live in a launch script the pods read at start; without the digest on the pod
    template a flag change would update the ConfigMap and leave every group on the old flags."""
    doc = json.loads(_diff(tmp_path, capsys, "prod", lambda d: d["engine"].update(mem_fraction_static=0.8))[1].out)
    assert {("prefill", "--mem-fraction-static"), ("decode", "--mem-fraction-static")} <= \
        {(f["role"], f["flag"]) for f in doc["engine_flags"]}
    assert {"restart", "track"} <= set(doc["impact_classes"])
    changed = {f["path"] for c in doc["changes"] if c["kind"] == "LeaderWorkerSet" for f in c["fields"]}
    assert any(p.endswith("annotations.pdstack.io/config-hash") for p in changed)


def test_prod_against_itself_says_no_changes_and_exits_0(capsys):
    assert main(["diff", "--stack", "prod", "--against", PROD]) == 0
    assert "prod: no changes" in capsys.readouterr().out


def test_fail_on_names_the_classes_that_fail_the_check(tmp_path, capsys):
    code, out = _diff(tmp_path, capsys, "prod", _engine_image, output="text", extra=["--fail-on", "restart"])
    assert code == 1 and "--fail-on: restart in this change" in out.err
    code, _ = _diff(tmp_path, capsys, "prod", _bigger_decode, output="text", extra=["--fail-on", "restart"])
    assert code == 0
    code, out = _diff(tmp_path, capsys, "prod", _bigger_decode, output="text", extra=["--fail-on", "reboot"])
    assert code == 2 and "reboot is not an impact class" in out.err


def test_against_a_git_ref_reads_the_spec_at_that_commit(capsys):
    assert main(["diff", "--stack", "dev", "--against", "HEAD", "--output", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["against"].startswith("stacks/dev.yaml at ")
    assert main(["diff", "--stack", "dev", "--against", "no-such-ref"]) == 2
    assert "git show no-such-ref:stacks/dev.yaml" in capsys.readouterr().err


def test_secrets_never_appear_in_a_diff(tmp_path, capsys):
    """A new API key changes the Secret of generated keys: the diff says it changed, never its values."""
    from infra.offline import run_spec
    from infra.render.manifests import unwrap
    from infra.spec_checks import parse_spec

    def add_key(d):
        d["access"]["api_keys"].append({"name": "new-team", "requests_per_minute": 60})

    data = stack_data("prod")
    add_key(data)
    (secret,) = run_spec(parse_spec(data)).by_kind("Secret")
    keys = list(unwrap(secret["stringData"]).values())
    for output in ("markdown", "json", "text"):
        _, out = _diff(tmp_path, capsys, "prod", add_key, output=output)
        assert "Secret/api-keys" in out.out and "<secret>" in out.out  # changed, and said so
        assert not [k for k in keys if k in out.out]
