"""Spec to what the network fabric and GPU generation mean for engine pods. Pure.

One place decides, from `hardware.fabric` and `hardware.gpu_type`:
- the device-plugin resource each engine pod requests (EFA or RDMA devices, shared out by
  the pod's share of the node's GPUs);
- the transfer backends' transport: Mooncake's protocol (`efa` through libfabric where the
  image has Mooncake's EFA build, x86_64 only; `rdma` through verbs; `tcp` otherwise), NIXL's
  backend plugin (LIBFABRIC on EFA, UCX on InfiniBand/RoCE); what the image contains is
  `images.engines.<kind>`, checked against the fabric in infra/spec/ (transfer_problems);
- the environment the communication libraries read (libfabric, NCCL, NVSHMEM, UCX).

Sources: Mooncake's protocols and SGLang's EFA allocator rule are in sglang 0.5.23
(sglang/srt/distributed/device_communicators/mooncake_transfer_engine.py,
sglang/srt/disaggregation/mooncake/utils.py); vLLM 0.33.0's NIXL backends list in
vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py ("backends", default UCX).
The NCCL / NVSHMEM settings follow the AWS EFA and NVIDIA GB200 NVL72 recipes and aws-ofi-nccl's
own rule for NCCL_PROTO; they are not checked by any engine code here (see README, "What was
checked").
"""

from __future__ import annotations

import math

from infra.spec import StackSpec


def mooncake_efa(spec: StackSpec) -> bool:
    """Mooncake's efa transport exists in the image's build: x86_64 builds with EFA only, of Mooncake
    0.3.10 or later (infra/spec/ mooncake_efa_problems refuses the claim for an older Mooncake, whose
    Python binding ignores the protocol and would move KV over TCP or verbs)."""
    return spec.hardware.cpu_architecture == "amd64" and spec.engine_image().mooncake_efa


def mooncake_protocol(spec: StackSpec) -> str:
    """The transport of Mooncake's transfer engine, for the P->D hop and the store alike.

    On EFA without Mooncake's efa transport (any arm64 node, or an image built without it) only
    the store can use Mooncake, over TCP (a cache tier, off the latency path); the spec check
    refuses Mooncake for the P->D hop there (infra/spec/, transfer_problems).
    """
    fab = spec.hardware.fabric
    if fab is None:
        return "tcp"
    if fab.kind == "efa":
        return "efa" if mooncake_efa(spec) else "tcp"
    return "rdma"


def nixl_backends(spec: StackSpec) -> list[str]:
    fab = spec.hardware.fabric
    return ["LIBFABRIC"] if fab is not None and fab.kind == "efa" else ["UCX"]


def device_names(spec: StackSpec) -> list[str]:
    fab = spec.hardware.fabric
    return list(fab.devices) if fab else []


def fabric_resources(spec: StackSpec, gpus_per_pod: int) -> dict[str, str]:
    """Fabric devices one engine pod requests: its share of the node's, at least one."""
    fab = spec.hardware.fabric
    if fab is None:
        return {}
    share = math.ceil(fab.per_node * gpus_per_pod / spec.hardware.gpus_per_node)
    return {fab.resource: str(max(1, share))}


def fabric_env(spec: StackSpec) -> dict[str, str]:
    """Environment for NCCL, NVSHMEM, libfabric and UCX on this hardware."""
    fab, hw = spec.hardware.fabric, spec.hardware
    env: dict[str, str] = {}
    if fab is not None and fab.kind == "efa":
        # libfabric's EFA provider with GPUDirect RDMA; NCCL reaches it through aws-ofi-nccl.
        env.update({"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"})
        if hw.supernode is None:
            # NCCL's LL/LL128 protocols need 128-byte in-order stores, which an EFA endpoint may not
            # give; aws-ofi-nccl then sets NCCL_PROTO=simple itself (aws/aws-ofi-nccl
            # src/platform-aws.c, configure_nccl_proto). Set here where collectives cross EFA. Not
            # inside an NVLink domain: the variable is process-wide, and there every collective runs
            # over multi-node NVLink, where LL128 is NCCL's fast protocol.
            env["NCCL_PROTO"] = "simple"
    elif fab is not None:
        devices = ",".join(fab.devices)
        env.update({
            "NCCL_IB_HCA": devices,
            "UCX_NET_DEVICES": ",".join(f"{d}:1" for d in fab.devices),
            # DeepEP's internode kernels issue RDMA from the GPU (IBGDA).
            "NVSHMEM_IB_ENABLE_IBGDA": "1",
            "NVSHMEM_HCA_LIST": devices,
        })
    if hw.gpu_type == "GB200" and hw.supernode is not None:
        # Multi-node NVLink inside the NVL72 rack: NCCL's MNNVL transport needs cuMem buffers.
        env.update({"NCCL_MNNVL_ENABLE": "1", "NCCL_CUMEM_ENABLE": "1"})
    return env
