"""Which controllers the running twin has for real and which it stands in for, as the fleet
tests' one line per stack says it (tests/twin/placement.py assert_every_pod_bound): read from the
twin's state (the supervisor's components whose processes are alive) and from the API (objects a
stand-in published, labelled STAND_IN_LABEL), never from a list of what should be there.

Every component the supervisor starts (twin/cluster.py, twin/dataplane.py) is its upstream
program at its pin, apart from the API itself (etcd, kube-apiserver: not controllers) and those
in STAND_INS. A stand-in made of objects rather than a process (twin/dra.py: what NVIDIA's DRA
driver would publish) is seen by its label.
"""

from __future__ import annotations

import json
from pathlib import Path

from twin import dra
from twin.api import kubectl
from twin.paths import KUBECONFIG
from twin.process import identity

THE_API = ("etcd", "kube-apiserver")
# kwok: each node's kubelet and container runtime (pod phases); kubelet: the kubelet's start checks
# and probes (twin/kubelet.py); pod-network: the CNI (twin/pods.py's hub: the bridge the pods'
# namespaces hang on)
STAND_INS = ("kwok", "kubelet", "pod-network")
[STAND_IN_LABEL] = dra.STAND_IN_LABEL  # the key, on the objects a stand-in publishes
STAND_IN_KINDS = "deviceclasses,resourceclaimtemplates,resourceslices"  # the kinds twin/dra.py publishes


def controllers(components: dict[str, bool], labelled: list[dict]) -> tuple[list[str], list[str]]:
    """(running for real, stand-ins) from the supervisor's components (name -> its process alive)
    and the objects carrying STAND_IN_LABEL. Pure. A component whose process is gone is in neither."""
    alive = [name for name, up in components.items() if up and name not in THE_API]
    real = sorted(name for name in alive if name not in STAND_INS)
    published = {o["metadata"].get("labels", {}).get(STAND_IN_LABEL) for o in labelled}
    stand_ins = sorted([name for name in alive if name in STAND_INS]
                       + [f"{name} (its objects)" for name in published if name])
    return real, stand_ins


def running_controllers(state: dict, kubeconfig: Path = KUBECONFIG) -> tuple[list[str], list[str]]:
    """controllers() of the running twin (`state`: twin/cluster.py running())."""
    components = {name: identity(pid) is not None for name, pid in state.get("components", {}).items()}
    listed = kubectl("get", STAND_IN_KINDS, "-A", "-l", STAND_IN_LABEL, "-o", "json", kubeconfig_path=kubeconfig)
    return controllers(components, json.loads(listed.stdout)["items"])


def summary(real: list[str], stand_ins: list[str]) -> str:
    """The figure's words: "controllers running for real 7 (a, b, ...), stand-in 2 (c, d)"."""
    return (f"controllers running for real {len(real)} ({', '.join(real)}), "
            f"stand-in {len(stand_ins)} ({', '.join(stand_ins)})")
