"""The serving stacks read their platform stack's real outputs, never a stand-in's.

The platform program is run under Pulumi's mocks and its `pulumi.export`s are taken as the SDK
serializes them for the engine (pulumi/runtime/rpc.py `serialize_properties` at the pinned
pulumi 3.272.0 drops an output whose value is None, as the engine's stored outputs do); the
serving program then runs with exactly those values behind its StackReference. The offline
preview's placeholders (infra/platform_stack/program.py `expected_outputs`) are checked
against the same exports, so they cannot name an output the platform does not make.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from infra.offline import run_offline, run_spec
from infra.platform_stack.program import expected_outputs
from infra.platform_stack.spec import OnPremSpec, load_platform_spec
from infra.program import build_stack
from infra.spec import REPO_ROOT, stack_spec_path
from infra.spec_checks import load_spec
from tests.conftest import shipped_run


def serving_on(platform_exports: dict, serving):
    return run_offline(lambda: build_stack(serving), stack=serving.environment.name,
                       stack_outputs={serving.platform.stack: platform_exports})


@pytest.mark.parametrize("env", ["dev", "prod"])
def test_each_serving_stack_runs_on_what_its_aws_platform_really_exports(env):
    serving = load_spec(stack_spec_path(env))
    platform = load_platform_spec(REPO_ROOT / serving.platform.spec)
    exports = shipped_run(Path(serving.platform.spec).stem).exports
    placeholders = expected_outputs(platform)
    assert set(placeholders) <= set(exports), f"the offline preview reads outputs the platform never makes: " \
                                              f"{sorted(set(placeholders) - set(exports))}"
    run = serving_on(exports, serving)
    links = run.of_type("aws:eks/podIdentityAssociation:PodIdentityAssociation")
    if platform.cloud.weights_access == "pod-identity" and serving.model.weights.access_mode() == "pod-identity":
        assert links, "no Pod Identity association for the engines"


def test_a_serving_stack_runs_on_what_an_onprem_platform_really_exports(tmp_path):
    """An existing cluster's platform makes no kubeconfig, and so exports none (a None export is
    dropped by the SDK): the serving stack reaches the cluster through its own
    `kubernetes:context`, as pdctl's kubectl does. It used to `require_output("kubeconfig")`
    and fail with KeyError on every serving stack naming an on-prem platform."""
    dev = load_spec(stack_spec_path("dev"))
    aws_platform = load_platform_spec(REPO_ROOT / dev.platform.spec)
    onprem = aws_platform.model_copy(update={"name": "platform-onprem", "cloud": OnPremSpec()})
    spec_file = tmp_path / "platform-onprem.yaml"
    spec_file.write_text(yaml.safe_dump(onprem.model_dump(mode="json", exclude_none=True)))
    assert load_platform_spec(spec_file) == onprem  # the file says what the model does
    exports = run_spec(onprem).exports
    assert "kubeconfig" not in exports
    serving = dev.model_copy(update={"platform": dev.platform.model_copy(
        update={"stack": "platform-onprem", "spec": str(spec_file)})})
    run = serving_on(exports, serving)
    providers = [r for r in run.resources if r.type == "pulumi:providers:kubernetes"]
    assert providers and all("kubeconfig" not in p.inputs or p.inputs["kubeconfig"] in (None, "")
                             for p in providers), [p.inputs for p in providers]


def test_irsa_puts_the_role_on_the_engine_service_account_from_its_first_version():
    """EKS's pod identity webhook injects IRSA's token when a pod is admitted, from the
    annotation its service account has then (docs.aws.amazon.com/eks/latest/userguide/
    iam-roles-for-service-accounts.html): the role is written with the account itself, in every
    namespace the engines run in, not patched onto it by a resource that waits for the engines."""
    from infra.components.engines import ENGINE_SERVICE_ACCOUNT
    from infra.components.platform_links import IRSA_ROLE_ANNOTATION
    from infra.tracks import plan_tracks
    from tests.conftest import stack_data

    data = stack_data("prod")
    data["model"]["weights"]["access"] = "irsa"
    tracks = plan_tracks([(1, 90, data), (2, 10, data)])
    run = run_spec(tracks[-1].spec, tracks=tracks)
    accounts = [m for m in run.by_kind("ServiceAccount") if m["metadata"]["name"] == ENGINE_SERVICE_ACCOUNT]
    assert sorted(a["metadata"]["namespace"] for a in accounts) == sorted(t.namespace for t in tracks)
    assert all(IRSA_ROLE_ANNOTATION in a["metadata"].get("annotations", {}) for a in accounts), accounts
    assert not run.of_type("kubernetes:core/v1:ServiceAccountPatch")


@pytest.mark.parametrize("name, ok", [("prod", True), (".hidden-ok", True), ("dash-ok_1.x", True), ("a" * 100, True),
                                      ("--help", False), ("-x", False),
                                      ("a" * 101, False), ("has space", False), ("semi;colon", False), ("", False)])
def test_one_stack_name_rule_everywhere_a_stack_is_named(name, ok):
    """A Pulumi stack name is what the pinned CLI's ParseStackName takes (pulumi v3.274.1
    sdk/go/common/tokens/stack_name.go: [A-Za-z0-9_.-], 1 to 100; not starting with '-', which a
    command line would take for an option), in the serving spec's
    platform reference, the platform spec's hosted environments and `--pulumi-stack` alike."""
    from pydantic import ValidationError

    from infra.inputs import InputError
    from infra.platform_stack.spec import HostedEnvironment
    from infra.rollout.pulumi_cluster import kube_target
    from infra.spec import PlatformRef

    def accepted(make) -> bool:
        try:
            make()
        except (ValidationError, ValueError):
            return False
        return True

    assert accepted(lambda: PlatformRef(stack=name, spec="stacks/platform-dev.yaml")) == ok
    assert accepted(lambda: PlatformRef(stack=f"example/pdstack/{name}", spec="stacks/platform-dev.yaml")) == ok
    assert accepted(lambda: HostedEnvironment(spec="stacks/dev.yaml", stack=name)) == ok
    try:
        kube_target(name, REPO_ROOT)
        refused_for_name = False
    except InputError as exc:
        refused_for_name = "not a stack name" in str(exc)
    assert refused_for_name == (not ok)
