"""A stand-in for NVIDIA's DRA driver (k8s-dra-driver-gpu) on the twin: what its controller and
kubelet plugin publish, so that the real scheduler's DRA plugin allocates the IMEX channels the
prod engine pods claim. Pure: rendered ComputeDomains and kwok nodes in, API objects out.

The driver is not run (no Go module of it is served, and its plugin needs a GPU node). What
stands in, after what its v25.12 controller and plugin publish:
- per ComputeDomain, the ResourceClaimTemplate its `channel.resourceClaimTemplate.name` names,
  one request `channel` of the driver's channel DeviceClass;
- that DeviceClass, selecting the driver's devices;
- per GPU node, a ResourceSlice with one channel device (the plugin publishes channel 0 of the
  node's IMEX domain).
What is NOT simulated: IMEX daemons, the domain's readiness, the opaque channel config.
"""

from __future__ import annotations

DRIVER = "compute-domain.nvidia.com"
CHANNEL_CLASS = "compute-domain-default-channel.nvidia.com"
STAND_IN_LABEL = {"twin.pdstack.io/stands-in-for": "nvidia-dra-driver-gpu"}


def device_class() -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": CHANNEL_CLASS, "labels": dict(STAND_IN_LABEL)},
            "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}]}}


def channel_templates(objects: list[dict]) -> list[dict]:
    return [{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
             "metadata": {"name": cd["spec"]["channel"]["resourceClaimTemplate"]["name"],
                          "namespace": cd["metadata"]["namespace"], "labels": dict(STAND_IN_LABEL)},
             "spec": {"spec": {"devices": {"requests": [
                 {"name": "channel", "exactly": {"deviceClassName": CHANNEL_CLASS}}]}}}}
            for cd in objects if cd["kind"] == "ComputeDomain"]


def node_slices(nodes: list[dict]) -> list[dict]:
    return [{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
             "metadata": {"name": f"{n['metadata']['name']}-{DRIVER}", "labels": dict(STAND_IN_LABEL)},
             "spec": {"driver": DRIVER, "nodeName": n["metadata"]["name"],
                      "pool": {"name": n["metadata"]["name"], "generation": 1, "resourceSliceCount": 1},
                      "devices": [{"name": "channel-0", "attributes": {"type": {"string": "channel"},
                                                                       "id": {"int": 0}}}]}}
            for n in nodes if "nvidia.com/gpu" in n["status"]["capacity"]]


def stand_in(objects: list[dict], nodes: list[dict]) -> list[dict]:
    """Everything the driver would have published for this fleet on these nodes (nothing when
    the fleet has no ComputeDomain)."""
    templates = channel_templates(objects)
    return [device_class(), *templates, *node_slices(nodes)] if templates else []
