"""The ordered rollout steps, each with the resources it applies, a readiness check and a timeout.

Order (the design's): initialise the environment, split the pools, deploy prefill, deploy
decode, deploy the KV cache layer and the balancers, open access, verify. Two placements
differ from a plain reading of that list, on purpose:
- NetworkPolicies (default-deny and its allowlist) go in with the namespace, so nothing
  runs in an open namespace while the engines come up; the gateway, auth and rate limits
  still wait for "open access".
- The KV cache *config* (a ConfigMap the engine pods mount) goes in with the environment,
  so engine pods can start; the cache store itself comes in its own step.

`plan_steps` is pure: spec + the program's registered resources -> steps. Which cluster the
steps are applied to (the in-memory one in tests, Pulumi's Automation API for real) is the
`Cluster` protocol in infra/rollout/cluster.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infra import naming
from infra.recording import RegisteredResource
from infra.render.manifests import manifest_of
from infra.spec import StackSpec


ROUTER_STEP = "deploy kv cache and balancers"  # the last step of a revision's own track


@dataclass(frozen=True)
class Step:
    name: str
    resources: tuple[str, ...]  # logical names of the resources this step applies
    # what must be ready: "Kind/name condition", as `kubectl wait` reads it, read in the
    # revision's namespace, or "Kind/name condition in <namespace>" for the environment's objects
    waits_for: tuple[str, ...]
    timeout_seconds: float
    shared: bool = False  # environment-wide (one copy for every revision), not per revision

    def __str__(self) -> str:
        return self.name


@dataclass
class _Bucket:
    names: list[str] = field(default_factory=list)
    waits: list[str] = field(default_factory=list)


# What becomes ready on its own vs what is worth waiting for (kubectl wait conditions).
ROUTE_RESOURCE = "httproute-gateway"  # the environment's route (infra/components/access.py), as Pulumi names it
_READY_CONDITION = {
    "LeaderWorkerSet": "condition=Available",
    "Deployment": "condition=Available",
    "Gateway": "condition=Programmed",
    "HTTPRoute": "jsonpath={.status.parents[0].conditions[?(@.type=='Accepted')].status}=True",
    "NodePool": "condition=Ready",
    "Namespace": "jsonpath={.status.phase}=Active",
}


def step_of(resource: RegisteredResource, manifest: dict | None) -> str:
    """The step a custom resource belongs to, by its layer and kind (a track's copy as the
    environment's own: its name and namespace do not matter)."""
    kind = manifest["kind"] if manifest else ""
    role = (manifest or {}).get("metadata", {}).get("labels", {}).get(naming.ROLE_LABEL)
    layer = resource.layer
    if layer in ("foundation", "storage", "monitoring") or kind == "NetworkPolicy":
        return "initialise environment"
    if layer == "kvcache" and kind == "ConfigMap":
        return "initialise environment"
    if layer == "nodepools":
        return "split pools"
    if layer == "engines":
        return "deploy decode" if role == "decode" else "deploy prefill"  # shared engine SA goes first
    if layer in ("kvcache", "balancers", "autoscaling"):  # scalers only once their engines serve
        return "deploy kv cache and balancers"
    if layer == "access":
        return "open access"
    return "initialise environment"


def plan_steps(spec: StackSpec, resources: list[RegisteredResource]) -> list[Step]:
    """The steps for this spec, in order. Colocated mode has one engine step."""
    engine_steps = ["deploy prefill", "deploy decode"]
    if spec.deployment.mode == "colocated":
        engine_steps = ["deploy prefill"]  # the one pool serves both phases; it comes up first
    order = ["initialise environment", "split pools", *engine_steps, "deploy kv cache and balancers", "open access"]
    buckets = {name: _Bucket() for name in order}
    for resource in resources:
        if not resource.custom or resource.type.startswith("pulumi:providers:"):
            continue
        manifest = manifest_of(resource)
        bucket = buckets[step_of(resource, manifest)]
        bucket.names.append(resource.name)
        # The environment's route is not waited for with "open access": traffic owns it (one
        # fenced patch, infra/rollout/pulumi_cluster.py), and on an environment's first rollout
        # it is created only when traffic first moves, after every step (the cluster twin's
        # first `rollout --pulumi-stack` waited 300 s for a route no step creates).
        if manifest and manifest["kind"] in _READY_CONDITION and resource.name != ROUTE_RESOURCE:
            wait = f"{manifest['kind']}/{manifest['metadata']['name']} {_READY_CONDITION[manifest['kind']]}"
            # The entry point stays in the environment's namespace while each revision serves
            # from its own (infra/program.py build_stack): its waits name that namespace, the
            # others are read in the revision's (the twin's rollout waited for its gateway in
            # the revision's namespace, where there is none).
            if resource.layer == "access" and manifest["metadata"].get("namespace"):
                wait += f" in {manifest['metadata']['namespace']}"
            bucket.waits.append(wait)
    # Model loading dominates engine steps: weights are fetched and verified, then loaded
    # onto every GPU. Wide-EP decode groups also wait for every node of the group.
    timeouts = {"initialise environment": 120, "split pools": 900, "deploy prefill": 1800,
                "deploy decode": 2400, "deploy kv cache and balancers": 300, "open access": 300}
    shared = {"initialise environment", "split pools"}
    steps = [Step(name, tuple(buckets[name].names), tuple(buckets[name].waits), timeouts[name], name in shared)
             for name in order]
    verify = Step("verify", (), ("endpoint /health 200", "canary gates pass"), 600)
    return [*steps, verify]
