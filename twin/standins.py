"""Status that controllers the twin does not run would write, so a rollout's waits can be met.

- Envoy Gateway programs a Gateway and accepts its HTTPRoutes: `Programmed` on the Gateway and
  `Accepted` on each route's parent (Gateway API v1 status, what `kubectl wait` reads in
  infra/rollout/steps.py);
- Karpenter with its AWS provider marks a NodePool `Ready` once its EC2NodeClass resolves; the
  kwok provider the twin runs never does for a pool naming an EC2NodeClass;
- NVIDIA's DRA driver publishes, for each ComputeDomain a rollout makes, the ResourceClaimTemplate
  its engine pods claim, and its node plugin a ResourceSlice per GPU node (twin/dra.py, the same
  stand-in the rendered fleets use).

Written through the status subresource, as the controllers write it, every second while the
context is open. Nothing else is touched: the objects, their spec and the route's weights stay
what pdstack applied.
"""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from datetime import datetime, timezone

from twin import dra
from twin.api import kubectl
from twin.fleet import apply_each_pass, get
from twin.nodes import TWIN_LABEL

CONTROLLER = "gateway.envoyproxy.io/gatewayclass-controller"  # Envoy Gateway's controllerName


def _condition(kind: str, generation: int) -> dict:
    """A True condition for the object's current generation: `kubectl wait --for=condition=...`
    does not count a condition observed at an older generation (kubectl's wait.go)."""
    return {"type": kind, "status": "True", "reason": kind, "message": "the twin's stand-in (twin/standins.py)",
            "lastTransitionTime": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "observedGeneration": generation}


def _patch_status(kind: str, name: str, namespace: str | None, status: dict) -> None:
    where = ["-n", namespace] if namespace else []
    kubectl("patch", kind, name, *where, "--subresource=status", "--type=merge", "-p", json.dumps({"status": status}),
            check=False)  # an object deleted in between is no failure of the stand-in


def _true(obj: dict, kind: str, generation: int) -> bool:
    return any(c.get("type") == kind and c.get("status") == "True" and c.get("observedGeneration") == generation
               for c in obj.get("conditions", []))


def _generation(obj: dict) -> int:
    return obj["metadata"].get("generation", 1)


def publish_once(namespace: str, environment: str) -> None:
    for gateway in get("gateways.gateway.networking.k8s.io", "-n", namespace):
        gen = _generation(gateway)
        if not _true(gateway.get("status", {}), "Programmed", gen):
            _patch_status("gateways.gateway.networking.k8s.io", gateway["metadata"]["name"], namespace,
                          {"conditions": [_condition("Accepted", gen), _condition("Programmed", gen)]})
    for route in get("httproutes.gateway.networking.k8s.io", "-n", namespace):
        gen = _generation(route)
        parents = route.get("status", {}).get("parents", [])
        if not parents or not _true(parents[0], "Accepted", gen):
            _patch_status("httproutes.gateway.networking.k8s.io", route["metadata"]["name"], namespace, {"parents": [
                {"parentRef": ref, "controllerName": CONTROLLER,
                 "conditions": [_condition("Accepted", gen), _condition("ResolvedRefs", gen)]}
                for ref in route["spec"].get("parentRefs", [])]})
    domains = get("computedomains.resource.nvidia.com", "--all-namespaces")
    known = {(t["metadata"]["namespace"], t["metadata"]["name"]) for t in get("resourceclaimtemplates", "--all-namespaces")}
    missing = [t for t in dra.channel_templates(domains)
               if (t["metadata"]["namespace"], t["metadata"]["name"]) not in known]
    if missing:
        apply_each_pass(dra.stand_in(domains, get("nodes", "-l", f"{TWIN_LABEL}={environment}")))
    for pool in get("nodepools.karpenter.sh", "-l", f"pdstack.io/environment={environment}"):
        gen = _generation(pool)
        if not _true(pool.get("status", {}), "Ready", gen):
            _patch_status("nodepools.karpenter.sh", pool["metadata"]["name"], None,
                          {"conditions": [_condition("Ready", gen)]})


@contextmanager
def controllers_status(namespace: str, environment: str):
    """Publish the stand-in status every second until the block ends."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(1.0):
            try:
                publish_once(namespace, environment)
            except Exception:  # noqa: BLE001 - the API server restarting or a CRD not yet served: next second
                pass

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=30)
