"""Node provisioning, NVLink-domain placement and rolling updates, as the controllers behave.

Each test names the controller source it encodes. Rendered objects come from the mocked
Pulumi program (tests/conftest.py); the capacity plan is infra/planning/capacity.py.
"""

from __future__ import annotations

import pytest

from infra import naming
from infra.offline import run_offline
from infra.planning.capacity import capacity_plan
from infra.program import build_stack
from infra.spec_checks import parse_spec
from tests.conftest import problems_of, shipped_run, stack_data
from tests.test_tracks import prod_tracks


def pools(run) -> dict[str, dict]:
    return {p["metadata"]["labels"][naming.ROLE_LABEL]: p for p in run.by_kind("NodePool")}


def groups(run, namespace: str | None = None) -> dict[str, dict]:
    return {g["metadata"]["name"]: g for g in run.by_kind("LeaderWorkerSet")
            if namespace is None or g["metadata"]["namespace"] == namespace}


def pod_specs(group: dict) -> list[dict]:
    lwt = group["spec"]["leaderWorkerTemplate"]
    return [lwt[k]["spec"] for k in ("leaderTemplate", "workerTemplate") if k in lwt]


def text(data) -> str:
    return "\n".join(problems_of(data))


def test_pools_placed_by_nvlink_domain_are_static_pools_of_whole_domains():
    """Karpenter launches nodes only for pods it can tell a new node would satisfy. A clique id
    (`nvidia.com/gpu.clique`) exists only once a node runs, and pods with DRA claims get a
    DRAError while `--ignore-dra-requests` keeps its default true (kubernetes-sigs/karpenter
    v1.14.1, pkg/operator/options/options.go IgnoreDRARequests;
    pkg/controllers/provisioning/scheduling/scheduler.go). So prod's GB200 pools are static
    NodePools (`spec.replicas`) of whole NVL72 racks; a static pool takes only `limits.nodes`
    and no consolidation policy (the NodePool CRD's x-kubernetes-validations, aws/karpenter-
    provider-aws v1.14.1 pkg/apis/crds/karpenter.sh_nodepools.yaml)."""
    prod = pools(shipped_run("prod"))
    assert prod["decode"]["spec"]["replicas"] == 3 * 18  # 2 groups + 1 surge, a rack each
    assert prod["prefill"]["spec"]["replicas"] == 18  # 8 + 1 groups of 2 nodes share one rack
    for pool in prod.values():
        spec = pool["spec"]
        assert spec["limits"] == {"nodes": str(int(spec["replicas"]))}  # (the mocks carry numbers as floats)
        assert "weight" not in spec and "consolidationPolicy" not in spec["disruption"]
        requirements = {r["key"]: r["values"] for r in spec["template"]["spec"]["requirements"]}
        assert requirements["karpenter.sh/capacity-type"] == ["reserved"]  # Capacity Blocks
        assert requirements["kubernetes.io/arch"] == ["arm64"]
    dev = pools(shipped_run("dev"))
    for pool in dev.values():
        assert "replicas" not in pool["spec"]  # dynamic: Karpenter launches p5 nodes on demand
        assert pool["spec"]["limits"] == {"nvidia.com/gpu": "16"}  # max 2 instances of 8: a canary beside, surge 0


def test_a_gpu_limit_below_one_node_is_rejected():
    """Karpenter only offers instance types whose capacity fits what remains of the pool's
    limits (kubernetes-sigs/karpenter v1.14.1, pkg/controllers/provisioning/scheduling/
    scheduler.go, remainingResources), so a limit below one node launches nothing."""
    data = stack_data("dev")
    for role in ("prefill", "decode"):
        data["deployment"][role]["expert_parallel"] = 4
        data["deployment"][role]["scaling"] = {"min_instances": 1, "max_instances": 1}
    assert "deployment.prefill.scaling.max_instances: the prefill node pool may hold 4 GPUs but its nodes " \
           "(p5.48xlarge) have 8 each" in text(data)


def test_rolling_updates_surge_inside_the_reserved_capacity():
    """A LeaderWorkerSet's rolling update runs spec.replicas + maxSurge groups at once, and
    maxUnavailable may not be 0 when maxSurge is 0 (kubernetes-sigs/lws v0.10.0,
    pkg/controllers/leaderworkerset_controller.go rollingUpdateParameters;
    api/leaderworkerset/v1/leaderworkerset_types.go RollingUpdateConfiguration). The surge
    group needs room: prod reserves a third rack for decode's, dev restarts in place."""
    prod, dev = groups(shipped_run("prod")), groups(shipped_run("dev"))
    for group in prod.values():
        assert group["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"] == {"maxSurge": 1, "maxUnavailable": 0}
    for group in dev.values():
        assert group["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"] == {"maxSurge": 0, "maxUnavailable": 1}
    plan = capacity_plan(parse_spec(stack_data("prod")))
    assert plan["decode"].domains == plan["decode"].max_instances + plan["decode"].surge_instances


def test_a_surge_the_reservation_cannot_hold_is_rejected():
    """Without a spare NVLink domain, decode's surge group stays Pending and the update stalls
    (the LWS rule above, and one decode group per domain, infra/components/placement.py)."""
    data = stack_data("prod")
    data["hardware"]["supernode"]["count"] = 3
    assert "hardware.supernode.count: the pools need 4 NVLink domains (prefill 1, decode 3; a wide group " \
           "takes one to itself, and a rolling update's surge group needs its own) but 3 are reserved" in text(data)
    data["deployment"]["decode"]["rollout_surge_instances"] = 0  # in place: then it fits
    parse_spec(data)
    data = stack_data("prod")
    data["hardware"]["max_gpus"] = 256
    assert "hardware.max_gpus: the pools reserve 288 GPUs (prefill 18 nodes in 1 NVLink domains, decode 54 " \
           "nodes in 3 NVLink domains) but the quota is 256" in text(data)
    data = stack_data("dev")
    data["deployment"]["decode"]["rollout_surge_instances"] = 1
    assert "hardware.max_gpus: the pools reserve 40 GPUs (prefill (2+0 surge)x8, decode (2+1 surge)x8) but " \
           "the quota is 32" in text(data)


def test_one_decode_group_per_nvlink_domain_across_release_tracks():
    """LWS's exclusive-topology annotation matches every LWS pod of its own namespace by the
    group-key label (kubernetes-sigs/lws v0.10.0, pkg/webhooks/pod_webhook.go
    SetExclusiveAffinities): it would keep prefill out of decode racks and let another track's
    decode group in. pdstack renders the rule it means instead: pod affinity to its own group
    (matchLabelKeys on the group key) and anti-affinity to decode pods of other groups
    (mismatchLabelKeys) in every namespace of the environment (namespaceSelector), the track
    namespaces included (Kubernetes 1.33 MatchLabelKeysInPodAffinity, GA)."""
    spec = parse_spec(stack_data("prod"))
    run = run_offline(lambda: build_stack(spec, release="8", tracks=prod_tracks()), stack="prod")
    env_label = {"pdstack.io/environment": "prod"}
    namespaces = {n["metadata"]["name"]: n["metadata"]["labels"] for n in run.by_kind("Namespace")}
    for name in ("pdstack-prod-r7", "pdstack-prod-r8"):
        assert env_label.items() <= namespaces[name].items()
        decode = groups(run, name)["engine-decode"]
        assert "annotations" not in decode["metadata"] or not decode["metadata"]["annotations"]
        for pod in pod_specs(decode):
            (together,) = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            assert together["matchLabelKeys"] == ["leaderworkerset.sigs.k8s.io/group-key"]
            assert together["topologyKey"] == "nvidia.com/gpu.clique"
            (apart,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            assert apart["labelSelector"] == {"matchLabels": {naming.ROLE_LABEL: "decode"}}
            assert apart["mismatchLabelKeys"] == ["leaderworkerset.sigs.k8s.io/group-key"]
            assert apart["namespaceSelector"] == {"matchLabels": env_label}
        for pod in pod_specs(groups(run, name)["engine-prefill"]):
            assert "podAntiAffinity" not in pod["affinity"]  # prefill groups share racks
            assert pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0][
                "topologyKey"] == "nvidia.com/gpu.clique"  # EFA has no IBGDA: stay on NVLink


def test_groups_spanning_nvl72_nodes_claim_an_imex_channel():
    """Cross-node NVLink memory inside an NVL72 rack needs an IMEX channel in each pod: a
    ComputeDomain (NVIDIA/k8s-dra-driver-gpu v25.12.0, api/nvidia.com/resource/v1beta1/
    computedomain.go) whose controller creates the ResourceClaimTemplate its
    channel.resourceClaimTemplate.name names; pods claim from it (pod.spec.resourceClaims
    and the container's resources.claims, resource.k8s.io/v1, Kubernetes 1.34)."""
    run = shipped_run("prod")
    domains = {d["metadata"]["name"]: d for d in run.by_kind("ComputeDomain")}
    assert set(domains) == {"engine-decode-nvlink", "engine-prefill-nvlink"}
    for role in ("decode", "prefill"):
        template = domains[f"engine-{role}-nvlink"]["spec"]["channel"]["resourceClaimTemplate"]["name"]
        assert domains[f"engine-{role}-nvlink"]["spec"]["numNodes"] == 0  # immutable: no fixed count
        for pod in pod_specs(groups(run)[f"engine-{role}"]):
            assert pod["resourceClaims"] == [{"name": "imex-channel", "resourceClaimTemplateName": template}]
            assert pod["containers"][0]["resources"]["claims"] == [{"name": "imex-channel"}]
    assert not shipped_run("dev").by_kind("ComputeDomain")


@pytest.mark.parametrize("change, expected", [
    (lambda d: d["environment"].update(kubernetes_version="1.33"),
     "environment.kubernetes_version: groups spanning nodes of an NVLink domain claim an IMEX channel"),
    (lambda d: d["hardware"].update(gpu_type="H100", cpu_architecture="amd64"),
     "hardware.supernode: H100 nodes share no NVLink domain across nodes"),
])
def test_nvlink_domains_need_gb200_and_dra(change, expected):
    """DRA's resource.k8s.io/v1 is served by default from Kubernetes 1.34 (KEP-4381, GA in
    1.34; kubernetes.io docs, "Dynamic Resource Allocation"); multi-node NVLink domains are
    GB200 NVL72's (NVIDIA/k8s-dra-driver-gpu README: ComputeDomains for MNNVL systems)."""
    data = stack_data("prod")
    change(data)
    assert expected in text(data)
