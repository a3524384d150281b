"""Cost and hygiene: GPU-hours per role, idle share, instances that sat idle, and stale
node-local cache folders.

GPU utilisation comes from NVIDIA's dcgm-exporter (`DCGM_FI_DEV_GPU_UTIL`, 0-100, one
series per GPU, with the `namespace` and `pod` labels of its Kubernetes pod mapping). An
engine pod is named by its LeaderWorkerSet: `engine-<role>-<group>` for a group's leader,
`engine-<role>-<group>-<worker>` for the others, so the role and the instance (group) are
read from the pod name. Every number is one PromQL query over a subquery at 1-minute
resolution; `cost_queries` is pure, `cost_report` runs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from infra.prometheus import PrometheusAPI
from infra.render.engine_args import JIT_CACHE_FOLDER
from infra.tracks import namespaces_matcher

RESOLUTION = "1m"
MINUTES_PER_HOUR = 60


def gpu_series(namespace: str) -> str:
    """One series per engine GPU, with `role` and `group` (instance) labels added."""
    raw = f'DCGM_FI_DEV_GPU_UTIL{{{namespaces_matcher(namespace)},pod=~"engine-.+"}}'
    with_role = f'label_replace({raw}, "role", "$1", "pod", "engine-([a-z]+)-.*")'
    return f'label_replace({with_role}, "group", "$1", "pod", "(engine-[a-z]+-[0-9]+).*")'


def cost_queries(namespace: str, window: str, idle_below: float) -> dict[str, str]:
    gpus = gpu_series(namespace)
    # An instance is idle in a minute when every one of its GPUs is below the threshold.
    # Release tracks reuse pod names in their own namespaces: the namespace is part of an instance.
    instances = f"max by (namespace, role, group) ({gpus})"
    r = f"[{window}:{RESOLUTION}]"
    return {
        "gpu_hours": f"sum by (role) (count_over_time(({gpus}){r})) / {MINUTES_PER_HOUR}",
        "idle_gpu_hours": f"sum by (role) (count_over_time(({gpus} < {idle_below:g}){r})) / {MINUTES_PER_HOUR}",
        "avg_instances": f"avg_over_time((count by (role) ({instances})){r})",
        "max_instances": f"max_over_time((count by (role) ({instances})){r})",
        "instance_minutes": f"count_over_time(({instances}){r})",
        "idle_instance_minutes": f"count_over_time(({instances} < {idle_below:g}){r})",
    }


@dataclass(frozen=True)
class RoleCost:
    role: str
    gpu_hours: float
    idle_gpu_hours: float
    avg_instances: float
    max_instances: float

    @property
    def idle_share(self) -> float:
        return self.idle_gpu_hours / self.gpu_hours if self.gpu_hours else 0.0


@dataclass(frozen=True)
class IdleInstance:
    namespace: str
    role: str
    group: str
    idle_share: float
    hours: float


@dataclass(frozen=True)
class CostReport:
    window: str
    roles: list[RoleCost]
    idle_instances: list[IdleInstance]


def _by(rows: Iterable[tuple[dict, float]], *keys: str) -> dict[tuple, float]:
    return {tuple(labels.get(k, "") for k in keys): value for labels, value in rows}


def cost_report(api: PrometheusAPI, namespace: str, window: str = "24h", at: float | None = None,
                idle_below: float = 5.0, idle_instance_share: float = 0.5) -> CostReport:
    q = cost_queries(namespace, window, idle_below)
    by_role = {name: _by(api.vector(q[name], at), "role") for name in ("gpu_hours", "idle_gpu_hours", "avg_instances", "max_instances")}
    roles = [RoleCost(role, by_role["gpu_hours"][(role,)], by_role["idle_gpu_hours"].get((role,), 0.0),
                      by_role["avg_instances"].get((role,), math.nan), by_role["max_instances"].get((role,), math.nan))
             for (role,) in sorted(by_role["gpu_hours"])]
    lived = _by(api.vector(q["instance_minutes"], at), "namespace", "role", "group")
    idle = _by(api.vector(q["idle_instance_minutes"], at), "namespace", "role", "group")
    flagged = [IdleInstance(*key, idle[key] / minutes, minutes / MINUTES_PER_HOUR)
               for key, minutes in sorted(lived.items())
               if minutes > 0 and idle.get(key, 0) / minutes > idle_instance_share]  # 0: a series with no samples
    return CostReport(window, roles, flagged)


# --- hygiene: node-local cache folders older than their retention --------------------------------


@dataclass(frozen=True)
class CacheEntry:
    host: str
    path: str
    modified: float  # unix seconds


@dataclass(frozen=True)
class StaleEntry:
    host: str
    path: str
    age_hours: float
    retention_hours: float
    what: str


def parse_listing(host: str, text: str) -> list[CacheEntry]:
    """`find <dir> -mindepth 1 -maxdepth 1 -printf '%T@ %p\\n'` -> entries."""
    entries = []
    for line in text.splitlines():
        stamp, _, path = line.strip().partition(" ")
        try:
            entries.append(CacheEntry(host, path, float(stamp)))
        except ValueError:
            continue
    return entries


def stale_entries(entries: list[CacheEntry], now: float, retention_hours: float, what: str,
                  keep: tuple[str, ...] = ()) -> list[StaleEntry]:
    """Entries untouched for longer than the retention, except those in use (`keep`)."""
    stale = []
    for e in entries:
        age = (now - e.modified) / 3600
        if age > retention_hours and not any(e.path.rstrip("/").endswith(k.strip("/")) for k in keep if k.strip("/")):
            stale.append(StaleEntry(e.host, e.path, age, retention_hours, what))
    return sorted(stale, key=lambda s: (s.host, s.path))


def listing_command(folder: str) -> str:
    return f"find {folder} -mindepth 1 -maxdepth 1 -printf '%T@ %p\\n' 2>/dev/null || true"


def cache_folders(spec) -> list[tuple[str, float, str, tuple[str, ...]]]:
    """(folder, retention hours, what, entries in use) that pdstack writes on engine nodes."""
    w = spec.model.weights
    # the engines' compiled-kernel cache lives in the weights cache folder (infra/components/storage.py)
    folders = [(w.node_cache_path, w.node_cache_retention_hours, "weights cache", (w.prefix, JIT_CACHE_FOLDER))]
    if spec.deployment.cache.disk_path:
        folders.append((spec.deployment.cache.disk_path, spec.deployment.cache.retention_hours, "prefix cache", ()))
    return folders


def scan_caches(inventory, spec, now: float) -> tuple[list[StaleEntry], list[str]]:
    """Stale entries on every inventory host, and the hosts that could not be read."""
    from concurrent.futures import ThreadPoolExecutor

    from infra.rollout.preflight import connect, connect_error, run_command

    def one(host) -> tuple[list[StaleEntry], str | None]:
        try:
            client = connect(inventory, host)
        except Exception as exc:  # noqa: BLE001  reported by host, the others still scan
            return [], f"{host.name}: {connect_error(exc)}"
        try:
            stale = []
            for folder, retention, what, keep in cache_folders(spec):
                _, out = run_command(client, listing_command(folder), inventory.timeout_seconds)
                stale += stale_entries(parse_listing(host.name, out), now, retention, what, keep)
            return stale, None
        except Exception as exc:  # noqa: BLE001
            return [], f"{host.name}: {type(exc).__name__}: {exc}"
        finally:
            client.close()

    with ThreadPoolExecutor(max_workers=min(16, len(inventory.hosts))) as pool:
        results = list(pool.map(one, inventory.hosts))
    return [s for stale, _ in results for s in stale], [err for _, err in results if err]
