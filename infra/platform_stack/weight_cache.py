"""Where the weight cache lives on a GPU node, and whether the weights fit there.

`instance-store`: Karpenter's `instanceStorePolicy: RAID0` (karpenter-provider-aws v1.14.1,
pkg/apis/v1/ec2nodeclass.go InstanceStorePolicyRAID0; pkg/providers/amifamily/bootstrap/nodeadm.go
sets nodeadm's `instance.localStorage.strategy: RAID0`) makes one RAID-0 array of the NVMe
instance stores. On the EKS AL2023 AMI nodeadm runs `setup-local-disks raid0`
(github.com/awslabs/amazon-eks-ami/nodeadm internal/system/local_disk.go), which mounts the array
at /mnt/k8s-disks/0 and bind-mounts /var/lib/kubelet, /var/lib/containerd and /var/log/pods onto
it (awslabs/amazon-eks-ami templates/shared/runtime/bin/setup-local-disks, maybe_raid0:
array_mount_point="${MNT_DIR}/0", MNT_DIR default /mnt/k8s-disks). A hostPath anywhere else is the
root EBS volume. So the cache path must be under the array, and the array holds the weights
(this revision's and the next one's), container images and pod logs.

`host-path`: a disk the operator mounted at the path (on-prem), of the size the spec states;
the preflight checks its free space on every host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infra.spec import StackSpec

RAID0_MOUNT = "/mnt/k8s-disks/0"
# What the array holds besides weights: container images (an engine image is 20-40 GiB, two
# revisions' side by side) and pod logs. An estimate, not measured here.
ARRAY_RESERVE_GIB = 200

# Instance-store size of the GPU instance types pdstack's specs name, in GB (10^9 bytes), as
# EC2 DescribeInstanceTypes reports InstanceStorageInfo.TotalSizeInGB (what Karpenter turns into
# the node's ephemeral-storage with RAID0: pkg/providers/instancetype/types.go ephemeralStorage).
# NOT from a pinned package: no package this project reaches carries it for these types
# (karpenter-provider-aws v1.14.1's pkg/fake/zz_generated.describe_instance_types.go lists
# c6g..trn1 only; botocore carries no instance-type data). Origin: the EC2 User Guide's
# instance-store volume table (docs.aws.amazon.com/ec2/latest/instancetypes/gp.html#gp_instance-store,
# accelerated computing section), read for this table. The cloud layer checks the same figure
# against DescribeInstanceTypes at `pulumi up` (infra/platform_stack/cloud/aws.py).
INSTANCE_STORE_GB = {
    "p4d.24xlarge": 8000,      # 8 x 1000 GB NVMe
    "p5.48xlarge": 30720,      # 8 x 3840 GB NVMe
    "p5e.48xlarge": 30720,     # 8 x 3840 GB NVMe
    "p5en.48xlarge": 30720,    # 8 x 3840 GB NVMe
    "p6-b200.48xlarge": 30720,  # 8 x 3840 GB NVMe
    "p6e-gb200.36xlarge": 22500,  # 3 x 7500 GB NVMe
}
INSTANCE_STORE_ORIGIN = "EC2 User Guide, instance store volumes (accelerated computing); not a pinned package"


def gib_of_gb(gb: float) -> float:
    return gb * 1e9 / 2**30


def needed_gib(spec: StackSpec) -> float | None:
    w = spec.model.weights
    if w.size_gib is None:
        return None
    return w.size_gib * w.cache.copies


def weight_cache_problems(spec: StackSpec) -> list[str]:
    w = spec.model.weights
    cache, path = w.cache, w.node_cache_path.rstrip("/")
    need = needed_gib(spec)
    problems = []
    if cache.medium == "instance-store":
        if not (path + "/").startswith(RAID0_MOUNT + "/"):
            problems.append(
                f"model.weights.node_cache_path: {w.node_cache_path} is not on the instance-store array (RAID0 mounts "
                f"it at {RAID0_MOUNT}; anywhere else is the root volume). Fix: {RAID0_MOUNT}/pdstack-weights")
        # (a spec without size_gib is refused by infra/spec.py: the startup probes need it too)
        for itype in spec.hardware.instance_types:
            gb = INSTANCE_STORE_GB.get(itype)
            if gb is None:
                problems.append(
                    f"hardware.instance_types: {itype}'s instance-store size is not known to pdstack "
                    f"(infra/platform_stack/weight_cache.py INSTANCE_STORE_GB). Fix: add it from DescribeInstanceTypes "
                    "(InstanceStorageInfo.TotalSizeInGB), or model.weights.cache.medium: host-path")
            elif need is not None and need + ARRAY_RESERVE_GIB > gib_of_gb(gb):
                problems.append(
                    f"model.weights.size_gib: {w.size_gib} GiB x {cache.copies} copies + {ARRAY_RESERVE_GIB} GiB for "
                    f"images and logs does not fit {itype}'s instance store ({gib_of_gb(gb):.0f} GiB). Fix: fewer "
                    "cache.copies, or a type with more instance store")
    else:
        # Without capacity_gib the preflight's free-disk check (the inventory's min_free_disk_gib) is the only one.
        if cache.capacity_gib is not None and need is not None and need > cache.capacity_gib:
            problems.append(
                f"model.weights.size_gib: {w.size_gib} GiB x {cache.copies} copies does not fit the "
                f"{cache.capacity_gib} GiB disk at {w.node_cache_path}. Fix: a bigger disk, or fewer cache.copies")
    return problems
