"""What capacity each engine pool reserves, how Karpenter provides it, and how a pool updates
inside it. Pure: spec in, plan and problems out.

The rules come from how the controllers behave:

- Placement by NVLink domain. A multi-node decode (or colocated) group gets an NVLink domain
  to itself; a multi-node group whose all-to-all can only run over NVLink (DeepEP on EFA)
  stays inside one domain but shares it. Both place pods by the domain label the GPU
  operator publishes on each node after it boots (`nvidia.com/gpu.clique`).
- Karpenter cannot launch nodes for those pods: it only knows label values that a NodePool's
  requirements or labels name, and a clique id is known only once the node runs. Pods with
  DRA claims (the IMEX channel of a ComputeDomain) are refused outright while Karpenter runs
  with its default `--ignore-dra-requests=true` (kubernetes-sigs/karpenter v1.14.1,
  pkg/operator/options/options.go; pkg/controllers/provisioning/scheduling/scheduler.go). So a
  pool placed by domain is a static NodePool (`spec.replicas`, Karpenter's StaticCapacity
  feature gate): the nodes exist and kube-scheduler, which knows both the label and DRA,
  places the pods. NVL72 capacity comes in whole racks (EC2 UltraServer Capacity Blocks), so
  a static pool holds whole domains.
- A LeaderWorkerSet's rolling update starts `maxSurge` new groups before it stops old ones
  (kubernetes-sigs/lws v0.10.0, pkg/controllers/leaderworkerset_controller.go,
  rollingUpdateParameters). If the pool is already at its maximum and the capacity holds no
  more, the surge group stays Pending and the update stalls. So each pool reserves room for
  `rollout_surge_instances` more groups than its maximum (GPU limit, and NVLink domains where
  it is placed by domain); with a surge of 0 the update replaces one group at a time in place
  (maxUnavailable 1), and the pool serves one instance fewer meanwhile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from infra.spec import StackSpec, all_to_all_needs_nvlink_domain

DomainPlacement = Literal["none", "exclusive", "shared"]


def domain_placement(spec: StackSpec, role: str) -> DomainPlacement:
    """How a pool's groups use NVLink domains: not at all, one group per domain, or inside one."""
    hw = spec.hardware
    phase = spec.deployment.pools()[role]
    if hw.supernode is None or phase.nodes_per_instance(hw.gpus_per_node) <= 1:
        return "none"
    if role in ("decode", "colocated"):
        return "exclusive"
    return "shared" if all_to_all_needs_nvlink_domain(spec, phase) else "none"


def claims_whole_domain(spec: StackSpec, role: str) -> bool:
    return domain_placement(spec, role) == "exclusive"


@dataclass(frozen=True)
class PoolCapacity:
    role: str
    placement: DomainPlacement
    max_instances: int
    surge_instances: int
    gpus_per_instance: int
    domains: int  # NVLink domains the pool holds (0 unless placed by domain)
    static_nodes: int | None  # nodes of a static NodePool, or None: Karpenter provisions on demand
    gpus: int  # what the pool may hold: its Karpenter GPU limit, or a static pool's GPUs

    @property
    def static(self) -> bool:
        return self.static_nodes is not None

    def rollout(self) -> dict[str, int]:
        """LeaderWorkerSet rollingUpdateConfiguration that fits inside this capacity."""
        if self.surge_instances:
            return {"maxSurge": self.surge_instances, "maxUnavailable": 0}
        return {"maxSurge": 0, "maxUnavailable": 1}


def nodes_per_domain(spec: StackSpec) -> int:
    hw = spec.hardware
    return hw.supernode.gpus // hw.gpus_per_node if hw.supernode else 0


def pool_capacity(spec: StackSpec, role: str) -> PoolCapacity:
    hw = spec.hardware
    phase = spec.deployment.pools()[role]
    most, surge = phase.bounds()[1], phase.rollout_surge_instances
    groups = most + surge
    placement = domain_placement(spec, role)
    domains, static_nodes = 0, None
    if placement == "exclusive":
        domains = groups
    elif placement == "shared":
        per_domain = nodes_per_domain(spec) // phase.nodes_per_instance(hw.gpus_per_node)
        domains = math.ceil(groups / per_domain) if per_domain else groups
    if placement != "none":
        static_nodes = domains * nodes_per_domain(spec)
    gpus = static_nodes * hw.gpus_per_node if static_nodes is not None else groups * phase.gpus_per_instance()
    return PoolCapacity(role, placement, most, surge, phase.gpus_per_instance(), domains, static_nodes, gpus)


def capacity_plan(spec: StackSpec) -> dict[str, PoolCapacity]:
    return {role: pool_capacity(spec, role) for role in spec.deployment.pools()}


def capacity_problems(spec: StackSpec) -> list[str]:
    """Quota, NVLink domains and node sizes against what the pools reserve, surge included."""
    hw = spec.hardware
    plan = capacity_plan(spec)
    problems = []
    if hw.max_gpus is not None:
        want = sum(c.gpus for c in plan.values())
        if want > hw.max_gpus:
            parts = ", ".join(
                f"{c.role} {c.static_nodes} nodes in {c.domains} NVLink domains" if c.static else
                f"{c.role} ({c.max_instances}+{c.surge_instances} surge)x{c.gpus_per_instance}"
                for c in plan.values())
            problems.append(
                f"hardware.max_gpus: the pools reserve {want} GPUs ({parts}) but the quota is {hw.max_gpus}. "
                "Fix: lower deployment.<role>.scaling.max_instances or rollout_surge_instances, or raise "
                "hardware.max_gpus")
    if hw.supernode is not None:
        need = sum(c.domains for c in plan.values())
        if need > hw.supernode.count:
            parts = ", ".join(f"{c.role} {c.domains}" for c in plan.values() if c.domains)
            problems.append(
                f"hardware.supernode.count: the pools need {need} NVLink domains ({parts}; a wide group takes one "
                f"to itself, and a rolling update's surge group needs its own) but {hw.supernode.count} are "
                "reserved. Fix: lower scaling.max_instances or rollout_surge_instances, or reserve more domains")
    for role, c in plan.items():
        phase = spec.deployment.pools()[role]
        if c.placement == "shared" and phase.nodes_per_instance(hw.gpus_per_node) > nodes_per_domain(spec):
            problems.append(
                f"deployment.{role}.expert_parallel: one {role} group ({phase.expert_parallel} GPUs) must stay in "
                f"one NVLink domain of {hw.supernode.gpus} GPUs and does not fit. Fix: at most {hw.supernode.gpus}")
        if not c.static and c.gpus < hw.gpus_per_node:
            problems.append(
                f"deployment.{role}.scaling.max_instances: the {role} node pool may hold {c.gpus} GPUs but its "
                f"nodes ({', '.join(hw.instance_types)}) have {hw.gpus_per_node} each, so Karpenter can never "
                f"launch one. Fix: let the pool reach at least {hw.gpus_per_node} GPUs (more instances, a rollout "
                "surge, or wider expert_parallel)")
    return problems
