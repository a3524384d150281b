"""Static node mode (an existing on-prem cluster) on the cluster twin: the platform stack's
NodePatches, sent by the real pulumi-kubernetes provider to the real API server, make plain GPU
nodes into dev's pools, and dev's pods then land on them.

What stands in: the nodes are kwok's (twin/nodes.py), given GPU capacity as a device plugin
would publish it, and stripped of everything pdstack's pools would put on them (role and
environment labels, the clique label, the taints), as an operator's kubeadm nodes come.
"""

from __future__ import annotations

import copy

from infra import naming
from infra.platform_stack.program import Hosted, build_platform
from infra.rollout.pulumi_cluster import PROJECT
from infra.rollout.preflight import HostEntry, Inventory
from infra.spec import stack_spec_path
from infra.spec_checks import load_spec
from tests.engine import engine_project
from tests.twin.placement import assert_every_pod_bound, remove_render
from tests.twin.test_platform_on_twin import twin_platform_spec
from twin import dra, fleet
from twin.cluster import kubectl
from twin.nodes import TWIN_LABEL, stack_nodes
from twin.paths import KUBECONFIG

STACK = "platform-twin-static"
POOL_FIELDS = (naming.ROLE_LABEL, "pdstack.io/environment", "karpenter.sh/nodepool")


def as_the_operator_has_them(spec, nodes: list[dict]) -> tuple[list[dict], list[HostEntry]]:
    """dev's twin nodes without what its pools put on them, and the inventory naming each GPU node's
    role and NVLink domain (what the operator writes in stacks/inventory/<env>.yaml)."""
    clique_label = spec.hardware.supernode.topology_label if spec.hardware.supernode else "nvidia.com/gpu.clique"
    bare, hosts = [], []
    for node in nodes:
        node = copy.deepcopy(node)
        labels = node["metadata"]["labels"]
        role = labels.get(naming.ROLE_LABEL)
        if role:
            hosts.append(HostEntry(name=node["metadata"]["name"], address="127.0.0.1", role=role,
                                   clique=labels.get(clique_label)))
        for key in (*POOL_FIELDS, clique_label):
            labels.pop(key, None)
        node["spec"]["taints"] = []
        bare.append(node)
    return bare, hosts


def test_static_mode_makes_an_operators_nodes_into_the_pools_and_the_pods_land_there(twin, tmp_path, monkeypatch):
    """`pulumi up` of a platform in static mode patches each node the inventory names (role label,
    the role's taints, the clique label), only those fields; dev, rendered as the serving stack
    is under a static platform (no NodePool: nothing else could make a node), is accepted whole
    and every pod bound to a patched node of its own pool; `pulumi destroy` takes the fields back."""
    from pulumi import automation as auto

    spec = load_spec(stack_spec_path("dev"))
    bare, hosts = as_the_operator_has_them(spec, stack_nodes(spec))
    assert hosts and fleet.apply_each_pass(bare).rejected == {}
    platform = twin_platform_spec()  # the platform test's: the charts from the pinned modules
    platform = platform.model_copy(update={"name": STACK, "nodes": platform.nodes.model_copy(update={"mode": "static"})})
    inventory = Inventory(key_file="unused", known_hosts="unused", hosts=hosts)
    project = engine_project(tmp_path, monkeypatch, twin=KUBECONFIG, platform_stand_in_stack=False)
    stack = auto.create_or_select_stack(stack_name=STACK, project_name=PROJECT,
                                        program=lambda: build_platform(platform, [Hosted(spec, "dev", inventory)]),
                                        opts=auto.LocalWorkspaceOptions(work_dir=str(project.work_dir)))
    stack.set_config("pdstack:specFile", auto.ConfigValue("stacks/platform-dev.yaml"))  # Pulumi.yaml asks for it
    # As the platform test does: one state write at the end (its CRDs' schemas are megabytes).
    monkeypatch.setenv("PULUMI_SKIP_CHECKPOINTS", "true")
    log: list[str] = []
    serving: list[dict] = []
    try:
        result = stack.up(on_output=log.append, color="never")
        assert result.summary.result == "succeeded", "\n".join(log[-40:])
        patched = {n["metadata"]["name"]: n for n in fleet.get("nodes", "-l", f"{TWIN_LABEL}={spec.environment.name}")}
        for host in hosts:
            node = patched[host.name]
            assert node["metadata"]["labels"][naming.ROLE_LABEL] == host.role
            assert {t["key"] for t in node["spec"].get("taints") or []}, f"{host.name} has no taint"
        serving = [o for o in fleet.render("dev", tmp_path / "dev-render")
                   if o["kind"] not in ("NodePool", "EC2NodeClass")]  # a static platform's serving stack makes none
        applied = fleet.apply_each_pass(serving)
        assert applied.rejected == {}, "\n".join(f"{k}: {v}" for k, v in applied.rejected.items())
        assert fleet.apply_each_pass(dra.stand_in(serving, list(patched.values()))).rejected == {}
        assert_every_pod_bound(spec, serving, applied, f"dev on static nodes ({STACK})")
        gpu_pods = [p for p in fleet.get("pods", "-n", spec.environment.namespace)
                    if p["spec"].get("nodeName") and any("nvidia.com/gpu" in (c.get("resources") or {}).get("limits", {})
                                                         for c in p["spec"]["containers"])]
        assert gpu_pods and {p["spec"]["nodeName"] for p in gpu_pods} <= {h.name for h in hosts}
    finally:
        try:
            if serving:
                remove_render(spec, serving, nodes=False)
            stack.destroy(on_output=log.append, color="never")
            # the NodePatches' fields go with the stack; the nodes, the operator's, stay
            left = {n["metadata"]["name"]: n for n in fleet.get("nodes", "-l", f"{TWIN_LABEL}={spec.environment.name}")}
            assert set(left) == {n["metadata"]["name"] for n in bare}
            kept = [name for name, n in left.items() if naming.ROLE_LABEL in n["metadata"]["labels"]
                    or n["spec"].get("taints")]
            assert kept == [], f"destroy left a role label or taint on {kept}"
        finally:
            kubectl("delete", "nodes", "-l", f"{TWIN_LABEL}={spec.environment.name}", "--wait=false")
