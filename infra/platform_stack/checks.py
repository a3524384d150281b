"""Rules that span a platform spec and the serving specs it hosts (each file's own rules are in
its model): names the serving stacks use exist on the platform, and the node layer holds what
the pools may grow to, rollout surge included."""

from __future__ import annotations

from collections import Counter

from infra.planning.capacity import pool_capacity
from infra.platform_stack.catalog import CATALOG, PlatformContext, controller, installed
from infra.platform_stack.efa import efa_layout_problems, efa_plugin_problems
from infra.platform_stack.spec import PlatformSpec
from infra.spec import StackSpec


def nodes_needed(spec: StackSpec, role: str) -> int:
    """Nodes a pool needs at its maximum plus the rollout surge (whole racks where placed by domain)."""
    cap = pool_capacity(spec, role)
    if cap.static:
        return cap.static_nodes
    phase = spec.deployment.pools()[role]
    return (cap.max_instances + cap.surge_instances) * phase.nodes_per_instance(spec.hardware.gpus_per_node)


def platform_problems(platform: PlatformSpec, hosted: list) -> list[str]:
    """`hosted`: infra/platform_stack/program.py Hosted (spec, stack, inventory) of each environment."""
    problems = efa_layout_problems(platform)
    families = {f.name for f in platform.cloud.node_classes} if platform.cloud.provider == "aws" else set()
    cloud = platform.cloud
    if cloud.provider == "aws" and cloud.ci and cloud.cluster.mode == "create" \
            and not cloud.cluster.endpoint_public_access and "self-hosted" not in cloud.ci.runs_on:
        problems.append(f"cloud.ci.runs_on: {cloud.ci.runs_on} is a GitHub-hosted runner, and the cluster's API "
                        "endpoint is private only (cluster.endpoint_public_access: false): CI's `pulumi up` could not "
                        "reach it. Fix: name a self-hosted runner inside the VPC, e.g. [self-hosted, pdstack-prod] "
                        "(.github/workflows/deploy.yml passes the same labels), or make the endpoint public")
    if platform.nodes.mode == "node-groups":
        if platform.cloud.provider != "aws":
            problems.append("nodes.mode: node-groups are EKS managed node groups (cloud.provider: aws). Fix: karpenter "
                            "or static")
        elif not platform.cloud.cluster.private_subnet_ids:
            problems.append("cloud.cluster.private_subnet_ids: node-groups mode places its groups in these subnets, and "
                            "none are listed (an existing cluster's too). Fix: list the nodes' private subnets")
        else:
            hosted_names = {h.spec.environment.name for h in hosted}
            for g in platform.nodes.node_groups:
                where = f"nodes.node_groups[{g.environment} {g.role}]"
                if g.node_class not in families:
                    problems.append(f"{where}: node_class {g.node_class!r} is no node class of the platform "
                                    f"({', '.join(sorted(families))}). Fix: name one, or add it to cloud.node_classes")
                if g.environment not in hosted_names:
                    problems.append(f"{where}: environment {g.environment!r} is not hosted here "
                                    f"({', '.join(sorted(hosted_names))}). Fix: name a hosted environment")
    for h in hosted:
        s: StackSpec = h.spec
        env = s.environment.name
        if s.access.gateway_class != platform.gateway_class:
            problems.append(f"{env}: access.gateway_class {s.access.gateway_class} is not the platform's GatewayClass "
                            f"({platform.gateway_class}). Fix: name {platform.gateway_class}")
        if platform.cloud.provider == "aws" and platform.nodes.mode == "karpenter" \
                and s.hardware.node_class.name not in families:
            problems.append(f"{env}: hardware.node_class.name {s.hardware.node_class.name} is no node class of the "
                            f"platform ({', '.join(sorted(families))}). Fix: name one, or add it to cloud.node_classes")
        if platform.nodes.mode == "static":
            if h.inventory is None:
                problems.append(f"environments[{env}].inventory: static nodes are named in an inventory. Fix: set it")
                continue
            have = Counter(host.role for host in h.inventory.hosts if host.role)
            for role in s.deployment.pools():
                need = nodes_needed(s, role)
                if have[role] < need:
                    problems.append(
                        f"{env}: the inventory names {have[role]} {role} nodes; the pool needs {need} (its maximum "
                        f"{pool_capacity(s, role).max_instances} instances plus a rollout surge of "
                        f"{pool_capacity(s, role).surge_instances}). Fix: name more nodes with role: {role}, or lower "
                        f"deployment.{role}.scaling.max_instances / rollout_surge_instances")
        if platform.nodes.mode == "node-groups":
            groups = {(g.environment, g.role) for g in platform.nodes.node_groups}
            for role in s.deployment.pools():
                if (env, role) not in groups:
                    problems.append(f"nodes.node_groups: no group for {env}'s {role} pool. Fix: add one")
            problems += capacity_block_problems(platform, s)
    return problems


def oidc_provider_problems(platform: PlatformSpec, others: dict[str, PlatformSpec]) -> list[str]:
    """IAM holds one OIDC provider per URL in an account (IAM API CreateOpenIDConnectProvider:
    EntityAlreadyExists), so of the platform specs committed beside this one (`others`, file ->
    spec) none in the same account may make GitHub's too: the second stack's first `pulumi up`
    would fail. Two specs are in one account unless both name theirs (cloud.account_id) and the
    accounts differ."""
    def makes_it(spec: PlatformSpec) -> bool:
        return spec.cloud.provider == "aws" and spec.cloud.ci is not None and spec.cloud.ci.oidc_provider == "create"

    if not makes_it(platform):
        return []
    account = platform.cloud.account_id
    where = f"account {account}" if account else "the same account, as far as the specs say"
    return [f"cloud.ci.oidc_provider: create, and {file} ({where}) creates it too: IAM holds one GitHub OIDC "
            "provider per account. Fix: set oidc_provider: existing in one of them, or name each one's "
            "different cloud.account_id"
            for file, other in sorted(others.items())
            if makes_it(other) and not (account and other.cloud.account_id and account != other.cloud.account_id)]


def capacity_block_problems(platform: PlatformSpec, s: StackSpec) -> list[str]:
    """A group on Capacity Blocks is one managed group per block of its role (a launch template
    targets one reservation): the role needs blocks, and its nodes must split evenly over them."""
    problems = []
    if platform.cloud.provider != "aws":  # node-groups off AWS is refused above; nothing to split
        return problems
    families = {f.name: f for f in platform.cloud.node_classes}
    for g in platform.nodes.node_groups:
        if g.environment != s.environment.name or not g.capacity_block or g.node_class not in families:
            continue
        blocks = families[g.node_class].capacity_reservations.by_role.get(g.role, [])
        need = nodes_needed(s, g.role)
        rack = s.hardware.supernode.gpus // s.hardware.gpus_per_node if s.hardware.supernode else 0
        if not blocks:
            problems.append(f"nodes.node_groups[{g.environment} {g.role}]: capacity_block, but node class {g.node_class} "
                            f"lists no capacity reservation for {g.role}. Fix: list the blocks' ids (cr-...) in its "
                            f"capacity_reservations.by_role.{g.role}")
        cluster, zones = platform.cloud.cluster, families[g.node_class].capacity_reservations.zones
        for block in blocks:
            if block not in zones:
                problems.append(f"nodes.node_groups[{g.environment} {g.role}]: Capacity Block {block} has no zone in "
                                f"node class {g.node_class}'s capacity_reservations.zones (its group is made in that "
                                "zone's subnets). Fix: add its AvailabilityZone (aws ec2 describe-capacity-reservations)")
            elif not cluster.subnets_in(zones[block]):
                problems.append(f"nodes.node_groups[{g.environment} {g.role}]: Capacity Block {block} is in "
                                f"{zones[block]}, and no subnet of cloud.cluster.private_subnet_ids is there "
                                f"(cluster.subnet_zones). Fix: list a private subnet of {zones[block]} and its zone")
        if blocks and (need % len(blocks) or rack and (need // len(blocks)) % rack):
            whole = f" in whole NVLink domains of {rack} nodes" if rack else ""
            problems.append(f"nodes.node_groups[{g.environment} {g.role}]: {need} nodes do not split evenly{whole} over "
                            f"{len(blocks)} Capacity Blocks (one group each). Fix: list blocks that hold them so")
    return problems


def controller_problems(ctx: PlatformContext) -> list[str]:
    """`controllers.user_installed` names catalog rows, and with `chart_source: pinned-modules`
    every row this platform installs has its chart in a pinned module."""
    controllers = ctx.spec.controllers
    names = [row.name for row in CATALOG]
    problems = [f"controllers.user_installed: {name!r} is no controller of the catalog. Fix: one of {', '.join(names)}"
                for name in controllers.user_installed if name not in names]
    if controllers.chart_source == "pinned-modules":
        problems += [f"controllers.chart_source: pinned-modules, but {row.name}'s chart is in no pinned module "
                     f"({row.unchecked}). Fix: install it yourself (e.g. from your own mirror) and list it in "
                     f"controllers.user_installed, or use chart_source: registry"
                     for row in installed(ctx) if row.chart and row.values_source is None]
    # Each chart's own verdict on the values the spec gives it (its values.yaml keys, its
    # values.schema.json), at every preview and `pulumi up`, not only in the tests: Helm would
    # drop an unknown key without a word.
    from infra.platform_stack.values import values_problems

    problems += [f"controllers: {p}" for row in installed(ctx) if row.chart and row.values_source
                 for p in values_problems(row.name, row.values(ctx))]
    efa = controller("aws-efa-k8s-device-plugin")
    if efa in installed(ctx):
        problems += efa_plugin_problems(ctx.spec, efa.chart.version)
    return problems
