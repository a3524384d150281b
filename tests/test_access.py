"""The entry point as Envoy Gateway v1.9.0 and Envoy apply it, and images that can run where they land."""

from __future__ import annotations

import pytest
import yaml

from infra.images import image_reference, platform_key
from infra.offline import run_spec
from infra.spec_checks import parse_spec
from tests.conftest import problems_of, stack_data

ROOT_STACKS = ("dev", "prod")


@pytest.mark.parametrize("stack", ROOT_STACKS)
def test_openai_clients_authenticate_with_a_bearer_key(stack):
    """OpenAI clients send `Authorization: Bearer <key>`. Envoy Gateway v1.9.0's apiKeyAuth tries
    extractFrom's headers in order (api/v1alpha1/api_key_auth_types.go; key_sources in
    internal/xds/translator/api_key_auth.go), and Envoy's api_key_auth filter strips a leading
    "Bearer " from a header's value (source/extensions/filters/http/api_key_auth/api_key_auth.cc,
    KeySources::Source::getKey). sanitize removes the key before it reaches a backend."""
    (policy,) = run_spec(parse_spec(stack_data(stack))).by_kind("SecurityPolicy")
    auth = policy["spec"]["apiKeyAuth"]
    assert auth["extractFrom"] == [{"headers": ["x-api-key", "authorization"]}]
    assert auth["sanitize"] is True


@pytest.mark.parametrize("stack", ROOT_STACKS)
def test_the_allowlist_sees_the_clients_own_address(stack):
    """clientCIDRs match the address Envoy sees (authorization_types.go): the Service keeps the
    client's source (externalTrafficPolicy Local, shared_types.go; the AWS target group's
    preserve_client_ip) and the load balancer admits only the allowlist."""
    spec = parse_spec(stack_data(stack))
    run = run_spec(spec)
    (proxy,) = run.by_kind("EnvoyProxy")
    service = proxy["spec"]["provider"]["kubernetes"]["envoyService"]
    assert service["externalTrafficPolicy"] == "Local"
    assert service["loadBalancerSourceRanges"] == spec.access.allowlist_cidrs
    assert "preserve_client_ip.enabled=true" in service["annotations"][
        "service.beta.kubernetes.io/aws-load-balancer-target-group-attributes"]
    (policy,) = run.by_kind("SecurityPolicy")
    assert policy["spec"]["authorization"]["rules"][0]["principal"]["clientCIDRs"] == spec.access.allowlist_cidrs


def test_one_digest_has_one_set_of_platforms_across_stacks():
    """A digest names one manifest (a single-platform image or an index): it cannot run on amd64
    in dev and be arm64-only in prod. Every stack's images.platforms must agree."""
    from pathlib import Path

    seen: dict[str, tuple[str, list[str]]] = {}
    for path in sorted((Path(__file__).resolve().parent.parent / "stacks").glob("*.yaml")):
        for digest, platforms in (yaml.safe_load(path.read_text()).get("images", {}).get("platforms") or {}).items():
            if digest in seen:
                assert sorted(platforms) == sorted(seen[digest][1]), (digest, path.name, seen[digest][0])
            seen[digest] = (path.name, platforms)
    assert seen


def test_an_image_that_cannot_run_on_the_gpu_nodes_is_refused_with_field_and_fix():
    data = stack_data("prod")  # GB200: arm64 Grace CPUs
    engine_key = platform_key(image_reference(data["images"]["engines"]["sglang"]["image"]))
    data["images"]["platforms"][engine_key] = ["amd64"]
    assert any(p.startswith("images.engines.sglang.image: its digest runs on amd64, the GPU nodes are arm64")
               and "Fix:" in p
               for p in problems_of(data))
    data = stack_data("prod")
    del data["images"]["platforms"][platform_key(image_reference(data["images"]["weights_fetcher"]))]
    assert any(p.startswith("images.platforms: images.weights_fetcher") and "pdctl images" in p
               for p in problems_of(data))
    data = stack_data("dev")
    arm_build = stack_data("prod")["images"]["engines"]["sglang"]["image"]  # prod's arm64 build on amd64 nodes
    data["images"]["engines"]["sglang"]["image"] = arm_build
    data["images"]["platforms"][platform_key(image_reference(arm_build))] = ["arm64"]
    assert any(p.startswith("images.engines.sglang.image:") for p in problems_of(data))


def test_a_single_platform_router_image_is_kept_to_its_architecture():
    data = stack_data("dev")
    data["images"]["platforms"][platform_key(image_reference(data["images"]["router"]))] = ["arm64"]
    (deployment,) = [d for d in run_spec(parse_spec(data)).by_kind("Deployment") if d["metadata"]["name"] == "router"]
    assert deployment["spec"]["template"]["spec"]["nodeSelector"] == {"kubernetes.io/arch": "arm64"}
