"""What every part of the twin uses to reach its API server: kubectl (built from the same
k8s.io/kubernetes module as the API server), the error a refused call raises, and the twin's
address ranges.

Apart from twin/cluster.py (which starts the twin), so that the components cluster.py starts
(twin/dataplane.py, twin/identities.py, twin/kubelet.py, ...) can call the API server without
importing the module that imports them.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from twin import build
from twin.paths import KUBECONFIG

SERVICE_CIDR = "10.96.0.0/16"  # virtual service addresses inside the API server; nothing is routed
POD_CIDR = "10.244.0.1/16"  # the addresses kwok writes into pod status; nothing is routed


class TwinError(RuntimeError):
    pass


def kubectl(*args: str, kubeconfig_path: Path = KUBECONFIG, input: str | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
    """kubectl built from the same k8s.io/kubernetes module as the API server."""
    result = subprocess.run([str(build.program("kubectl")), f"--kubeconfig={kubeconfig_path}", *args],
                            input=input, capture_output=True, text=True)
    if check and result.returncode:
        raise TwinError(f"kubectl {' '.join(args)}: {result.stderr.strip() or result.stdout.strip()}")
    return result
