"""The KV cache: the prefix cache, its store and its tiers."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from infra.inputs import Strict
from infra.naming import is_host_path
from infra.spec._base import PositiveInt, _checked


class CacheSpec(Strict):
    prefix_cache: bool = True
    store: Literal["mooncake", "lmcache"] = "mooncake"
    eviction_policy: Literal["lru", "lfu", "fifo"] = "lru"
    capacity_gib: PositiveInt = 512
    disk_path: str | None = Field(
        None, description="Node-local folder for a disk tier of the prefix cache (LMCache local_disk).")
    _disk_path = field_validator("disk_path")(_checked(is_host_path, (
        "is not an absolute node path of letters, digits, '.', '_' and '-' parts (no '..'). Fix: e.g. /mnt/kvcache")))
    disk_gib: PositiveInt = Field(500, description="Disk tier size per engine node.")
    retention_hours: PositiveInt = Field(
        24, description="`pdctl cost` flags disk-tier prefix-cache entries untouched for longer than this.")

    @model_validator(mode="before")
    @classmethod
    def _no_bandwidth_quota(cls, data):
        if isinstance(data, dict) and "transfer_bandwidth_limit" in data:
            raise ValueError("transfer_bandwidth_limit: removed; no quota can be enforced: EFA/RDMA traffic "
                             "bypasses the CNI's egress-bandwidth shaper and the pinned transfer libraries have no "
                             "rate limit. Fix: delete it")
        return data
