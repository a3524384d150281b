"""Spec to what the network fabric and GPU generation mean for engine pods. Pure.

One place decides, from `hardware.fabric` and `hardware.gpu_type`:
- the device-plugin resource each engine pod requests (EFA or RDMA devices, shared out by
  the pod's share of the node's GPUs);
- the transfer backends' transport: Mooncake's protocol (`efa` through libfabric, `rdma`
  through verbs, `tcp` without a fabric), NIXL's backend plugin (LIBFABRIC on EFA, UCX on
  InfiniBand/RoCE);
- the environment the communication libraries read (libfabric, NCCL, NVSHMEM, UCX).

Sources: Mooncake's protocols and SGLang's EFA allocator rule are in sglang 0.5.23
(sglang/srt/distributed/device_communicators/mooncake_transfer_engine.py,
sglang/srt/disaggregation/mooncake/utils.py); vLLM 0.33.0's NIXL backends list in
vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py ("backends", default UCX).
The NCCL / NVSHMEM settings follow the AWS EFA and NVIDIA GB200 NVL72 recipes; they are not
checked by any engine code here (see README, "What was checked").
"""

from __future__ import annotations

import math

from infra.spec import StackSpec


def mooncake_protocol(spec: StackSpec) -> str:
    fab = spec.hardware.fabric
    if fab is None:
        return "tcp"
    return "efa" if fab.kind == "efa" else "rdma"


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
        env.update({"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "NCCL_PROTO": "simple"})
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
