"""The order the Pulumi engine creates and deletes each stack's resources in, read from the
dependency URNs every registration carries (RegisterResourceRequest `dependencies`,
`propertyDependencies`, `provider`, `deletedWith`; infra/recording.py keeps them), the graph
the engine orders by:

- pulumi/pulumi pkg/v3 v3.274.1 resource/graph/dependency_graph.go `DependenciesOf`: a
  resource's dependencies, property dependencies, deleted-with and provider, its parent, and,
  where a dependency is a component, every descendant of that component (a remote component's
  children are known only to the engine);
- resource/deploy/step_generator.go `ScheduleDeletes`: a resource is deleted only once nothing
  that depends on it remains.

So: nothing is created before what it names, nothing is deleted after what it needs, and a
`pulumi destroy` leaves no cloud resource behind (what a retained resource needs is retained
with it).
"""

from __future__ import annotations

import functools

import pytest

from infra.offline import run_spec
from infra.platform_stack.spec import load_platform_spec, parse_platform_spec
from infra.recording import OfflineRun, RegisteredResource
from infra.render.manifests import unwrap
from infra.spec_checks import load_spec
from tests.conftest import shipped_run

PLATFORMS = ["platform-prod", "platform-dev"]
# The input whose value a cloud resource is known by (`name` where not listed): a resource naming
# it by that value (a cluster or a role by name, a bucket, an access entry by its principal)
# needs it. A bucket's settings carry `bucket` too, as a reference: only the Bucket is known by it.
IDENTIFYING_INPUT = {"aws:s3/bucket:Bucket": "bucket", "aws:eks/accessEntry:AccessEntry": "principalArn"}


def graph(run: OfflineRun) -> dict[str, set[str]]:
    """URN -> the URNs the engine treats as its direct dependencies (DependenciesOf)."""
    by_urn = {r.urn: r for r in run.resources}
    descendants: dict[str, set[str]] = {}
    for r in run.resources:
        parent = r.parent_urn
        while parent in by_urn:
            descendants.setdefault(parent, set()).add(r.urn)
            parent = by_urn[parent].parent_urn
    edges = {}
    for r in run.resources:
        direct = {u for u in r.depends_on_urns if u in by_urn}
        for urn in list(direct):
            if not by_urn[urn].custom:  # a component stands for everything under it
                direct |= descendants.get(urn, set())
        if r.parent_urn in by_urn:
            direct.add(r.parent_urn)
        edges[r.urn] = direct - {r.urn}
    return edges


def closure(edges: dict[str, set[str]], urn: str) -> set[str]:
    """Everything `urn` is created after and deleted before."""
    seen, todo = set(), [urn]
    while todo:
        for dep in edges.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def leaves(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from leaves(v)
    elif isinstance(value, str):
        yield value


def is_cloud(r: RegisteredResource) -> bool:
    return (r.custom or r.remote) and not r.type.startswith(("kubernetes:", "pulumi:", "random:"))


def named_by(run: OfflineRun) -> list[tuple[RegisteredResource, RegisteredResource, str]]:
    """(resource, what it names, the value): a cloud resource's identifying input (name, bucket,
    principal) as the value of another resource's input, or a namespace the stack makes as the
    namespace of an object or chart."""
    known: dict[str, list[RegisteredResource]] = {}
    for r in run.resources:
        inputs = unwrap(r.inputs)
        key = IDENTIFYING_INPUT.get(r.type, "name")
        if is_cloud(r) and isinstance(inputs.get(key), str):
            known.setdefault(inputs[key], []).append(r)
    namespaces = {unwrap(r.inputs)["metadata"]["name"]: r for r in run.resources
                  if r.type == "kubernetes:core/v1:Namespace"}
    found = []
    for r in run.resources:
        if not (r.custom or r.remote):
            continue
        inputs = unwrap(r.inputs)
        for value in set(leaves(inputs)):
            found += [(r, other, value) for other in known.get(value, []) if other.urn != r.urn]
        namespace = (inputs.get("metadata") or {}).get("namespace") if r.type.startswith("kubernetes:") else None
        namespace = namespace or (inputs.get("namespace") if r.type == "kubernetes:helm.sh/v4:Chart" else None)
        if namespace in namespaces and namespaces[namespace].urn != r.urn:
            found.append((r, namespaces[namespace], namespace))
    return found


@functools.cache
def irsa_node_groups_variant() -> OfflineRun:
    """platform-prod with IRSA and managed node groups: the other branches of the cloud layer."""
    data = load_platform_spec("stacks/platform-prod.yaml").model_dump(mode="json", exclude_none=True)
    data["cloud"]["weights_access"] = "irsa"
    data["nodes"] = {"mode": "node-groups", "node_groups": [
        {"role": role, "environment": "prod", "node_class": "gb200", "capacity_block": True}
        for role in ("prefill", "decode")]}
    return run_spec(parse_platform_spec(data))


def runs() -> dict[str, OfflineRun]:
    return {**{name: shipped_run(name) for name in PLATFORMS}, "platform-prod irsa node-groups": irsa_node_groups_variant(),
            "prod": shipped_run("prod"), "dev": shipped_run("dev")}


def test_nothing_is_created_before_what_it_names():
    """An access entry or a Pod Identity association names its cluster by name, an access policy
    association its access entry by principal, a node class its role by name: none of these is an
    Output, so without an explicit edge the engine made them at once, before the cluster existed
    (EKS: ResourceNotFoundException), the association before its entry. And the same edges run the
    other way at `pulumi destroy`: the cluster went while its entries were still being deleted."""
    missing = []
    for stack, run in runs().items():
        edges = graph(run)
        for resource, named, value in named_by(run):
            if named.urn not in closure(edges, resource.urn):
                missing.append(f"{stack}: {resource.type} {resource.name} names {named.type} {named.name} ({value!r}) "
                               "but does not depend on it")
    assert missing == []


def test_the_check_sees_a_name_without_an_edge():
    """The bite: a node class naming the node role by name, with its edges to the role taken
    away, is reported."""
    run = shipped_run("platform-prod")
    (node_class,) = [r for r in run.of_type("kubernetes:karpenter.k8s.aws/v1:EC2NodeClass")
                     if unwrap(r.inputs)["metadata"]["name"] == "gb200-decode"]
    (role,) = [r for r in run.of_type("aws:iam/role:Role") if r.name == "karpenter-node"]
    edges = graph(run)
    assert role.urn in closure(edges, node_class.urn)
    assert (node_class, role, unwrap(role.inputs)["name"]) in named_by(run)
    cut = {urn: deps - {role.urn} for urn, deps in edges.items()}
    cut = {urn: (deps if urn != node_class.urn else set()) for urn, deps in cut.items()}
    assert role.urn not in closure(cut, node_class.urn)


def one(run: OfflineRun, type_: str, name: str) -> RegisteredResource:
    (found,) = [r for r in run.of_type(type_) if r.name == name]
    return found


def test_karpenter_finalizes_its_nodes_before_it_or_its_iam_goes():
    """An EC2NodeClass carries Karpenter's termination finalizer: Karpenter removes it only once
    no NodeClaim uses the class, after deleting the instance profiles and launch templates it made
    (karpenter-provider-aws v1.14.1 pkg/controllers/nodeclass/controller.go `finalize`); a
    NodeClaim is finalized by terminating its instance (sigs.k8s.io/karpenter v1.14.1, the
    `karpenter.sh/termination` finalizer), and a NodePool is deleted in the foreground (the
    pinned pulumi-kubernetes provider's default, pkg/await/await.go `Deletion`) while its
    NodeClaims block it (ownerReferences with blockOwnerDeletion,
    pkg/controllers/provisioning/scheduling/nodeclaimtemplate.go). So every node class goes
    before the controller, and the controller before everything it needs to do that: its role,
    policy and Pod Identity association, the agent that hands it credentials, the node role
    (RemoveRoleFromInstanceProfile), the nodes it runs on and the cluster. Before, the node
    classes waited for the CRDs only: the chart went at once with them, and the instances,
    launch templates, instance profiles and volumes were stranded."""
    run = shipped_run("platform-prod")
    edges = graph(run)
    (chart,) = [r for r in run.of_type("kubernetes:helm.sh/v4:Chart") if r.name == "karpenter"]
    node_classes = run.of_type("kubernetes:karpenter.k8s.aws/v1:EC2NodeClass")
    assert node_classes
    for node_class in node_classes:
        assert chart.urn in closure(edges, node_class.urn), node_class.name
    needs = [one(run, "aws:iam/role:Role", "karpenter-controller"),
             one(run, "aws:iam/rolePolicy:RolePolicy", "karpenter-controller"),
             one(run, "aws:eks/podIdentityAssociation:PodIdentityAssociation", "karpenter"),
             one(run, "aws:eks/addon:Addon", "eks-pod-identity-agent"),
             one(run, "aws:iam/role:Role", "karpenter-node"),
             one(run, "aws:eks/accessEntry:AccessEntry", "karpenter-node"),
             one(run, "aws:eks/nodeGroup:NodeGroup", "system"),
             *run.of_type("eks:index:Cluster")]
    after = closure(edges, chart.urn)
    assert [f"{r.type} {r.name}" for r in needs if r.urn not in after] == []


def test_every_controller_waits_for_the_nodes_and_agent_it_runs_with():
    """A new cluster has no node until the system node group is up; a chart's Deployments wait
    for readiness, so each controller comes after the nodes (and the Pod Identity agent), and
    at `pulumi destroy` goes before them, while its pods can still be drained."""
    run = shipped_run("platform-prod")
    edges = graph(run)
    system = one(run, "aws:eks/nodeGroup:NodeGroup", "system")
    agent = one(run, "aws:eks/addon:Addon", "eks-pod-identity-agent")
    charts = run.of_type("kubernetes:helm.sh/v4:Chart")
    assert charts
    assert [c.name for c in charts if not {system.urn, agent.urn} <= closure(edges, c.urn)] == []


@pytest.mark.parametrize("name", PLATFORMS)
def test_what_a_retained_resource_needs_is_retained(name):
    """The buckets keep the weights and the release history past a `pulumi destroy` (both are
    the user's: README, "Objects that stay the user's"), so the key that encrypts them and the
    settings that keep them private, versioned and encrypted stay too. Before, the buckets
    outlived a destroy while their KMS key was scheduled for deletion: 30 days later every
    object in them was unreadable (AWS KMS Developer Guide, "Deleting AWS KMS keys")."""
    run = shipped_run(name)
    edges = graph(run)
    by_urn = {r.urn: r for r in run.resources}
    buckets = run.of_type("aws:s3/bucket:Bucket")
    assert buckets and all(b.retain_on_delete for b in buckets)
    names = {unwrap(b.inputs)["bucket"] for b in buckets}
    settings = [r for r in run.resources if is_cloud(r) and unwrap(r.inputs).get("bucket") in names]
    assert settings and [r.name for r in settings if not r.retain_on_delete] == []
    lost = []
    for kept in [r for r in run.resources if r.retain_on_delete and is_cloud(r)]:
        lost += [f"{kept.type} {kept.name} needs {by_urn[u].type} {by_urn[u].name}"
                 for u in closure(edges, kept.urn) if is_cloud(by_urn[u]) and not by_urn[u].retain_on_delete]
    assert lost == []
    assert all(k.retain_on_delete for k in run.of_type("aws:kms/key:Key"))


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_every_rollout_step_finds_what_it_depends_on_deployed_or_targeted(tmp_path, stack):
    """`pdctl rollout` applies a serving stack one step at a time (`pulumi up --target`); the
    engine refuses a targeted resource whose dependency is neither in the state nor targeted.
    So each resource's dependencies are in its own step or an earlier one, with two release
    tracks as with none (infra/rollout/steps.py plan_steps and step_of; a component is there
    once a step targets something under it, infra/rollout/pulumi_cluster.py step_targets)."""
    from tests.conftest import stack_data

    from infra.render.manifests import manifest_of
    from infra.rollout.steps import plan_steps, step_of
    from infra.tracks import plan_tracks

    spec = load_spec(f"stacks/{stack}.yaml")
    order = [s.name for s in plan_steps(spec, run_spec(spec).resources)]
    for run in (run_spec(spec), run_spec(spec, tracks=plan_tracks([(1, 90, stack_data(stack)),
                                                                    (2, 10, stack_data(stack))]))):
        by_urn = {r.urn: r for r in run.resources}
        step = {r.urn: order.index(step_of(r, manifest_of(r))) for r in run.custom()
                if not r.type.startswith("pulumi:providers:")}
        for r in run.resources:  # a component is there with the first step under it
            parent = r.parent_urn
            while r.urn in step and parent in by_urn and not by_urn[parent].custom:
                step[parent] = min(step.get(parent, len(order)), step[r.urn])
                parent = by_urn[parent].parent_urn
        late = [f"{r.name} ({order[step[r.urn]]}) depends on {by_urn[u].name} ({order[step[u]]})"
                for r in run.custom() if r.urn in step
                for u in r.depends_on_urns if u in step and step[u] > step[r.urn]]
        assert late == []


@pytest.mark.parametrize("name", PLATFORMS)
def test_the_load_balancer_controller_is_up_before_the_gateways_service(name):
    """The gateway's Service is made by Envoy Gateway for each Gateway of the platform's class and
    annotated for the AWS Load Balancer Controller, which makes its NLB (and at `pulumi destroy`
    deletes it, removing the Service's finalizer). So the class and its EnvoyProxy come after the
    controller's chart (its Deployment and webhooks ready), and go before it; the chart comes after
    what its pods need: its role, policy and Pod Identity association, and cert-manager, whose
    Certificate is its webhook's serving certificate (the chart's templates/cert-manager.yaml,
    sigs.k8s.io/aws-load-balancer-controller at the pinned version). Before, no controller was
    installed: EKS's legacy in-tree controller made the NLB, as it does for any Service of type
    LoadBalancer no other controller is named for."""
    run = shipped_run(name)
    edges = graph(run)
    chart = one(run, "kubernetes:helm.sh/v4:Chart", "aws-load-balancer-controller")
    needs = [one(run, "aws:iam/role:Role", "aws-load-balancer-controller"),
             one(run, "aws:iam/rolePolicy:RolePolicy", "aws-load-balancer-controller"),
             one(run, "aws:eks/podIdentityAssociation:PodIdentityAssociation", "aws-load-balancer-controller"),
             one(run, "kubernetes:helm.sh/v4:Chart", "cert-manager")]
    after = closure(edges, chart.urn)
    assert [f"{r.type} {r.name}" for r in needs if r.urn not in after] == []
    gateway = [r for r in run.custom() if r.type in ("kubernetes:gateway.networking.k8s.io/v1:GatewayClass",
                                                      "kubernetes:gateway.envoyproxy.io/v1alpha1:EnvoyProxy")]
    assert len(gateway) == 2
    assert [r.name for r in gateway if chart.urn not in closure(edges, r.urn)] == []
