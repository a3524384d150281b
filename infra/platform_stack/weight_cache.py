"""Where the weight cache lives on a GPU node, and how much room it has there.

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

This module is the facts, and imports nothing of pdstack's: the spec checks the fit against them
(infra/spec/ weight_cache_problems), the cloud layer and the offline mocks read the table.
"""

from __future__ import annotations

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
