"""Scaling on live load on the twin: the rendered ScaledObjects read the fleet's own Prometheus
(twin/monitoring.py fleet_prometheus), the real KEDA operator answers the HPA's External metrics
through its metrics API server (twin/dataplane.py, reached by the API server through twin/egress.py),
and the HPA controller scales the LeaderWorkerSet through its scale subresource.

What the twin changes in the render, and why: each trigger's `serverAddress`. The rendered one is the
platform Prometheus's in-cluster Service (`prometheus-operated.<namespace>.svc`), a name the twin has
no DNS for, and KEDA's operator runs on the machine's loopback (twin/dataplane.py), where the fleet's
Prometheus is forwarded (pods.forward): so the trigger names that loopback URL.
"""

from __future__ import annotations

import copy
import json
import threading
from collections import Counter
from pathlib import Path

from twin import pods
from twin.clients import ThreadClient

CHAT = {"messages": [{"role": "user", "content": "Scale me out, twin."}], "max_tokens": 24, "stream": False}


def reading(scaled_objects: list[dict], prometheus_url: str) -> list[dict]:
    """Copies of the ScaledObjects whose Prometheus triggers query `prometheus_url` (see the module's
    docstring); nothing else changed."""
    out = copy.deepcopy(scaled_objects)
    for obj in out:
        for trigger in obj["spec"]["triggers"]:
            if trigger["type"] == "prometheus":
                trigger["metadata"]["serverAddress"] = prometheus_url
    return out


class Load(ThreadClient):
    """`workers` clients, each sending one chat request after another to the router at ip:port in the
    pod network (through its hub's client socket) until stopped; what they got is counted."""

    def __init__(self, client_socket: Path, ip: str, port: int, model: str, workers: int = 4):
        super().__init__([self._send] * workers, join_seconds=120)
        self.client_socket, self.ip, self.port = client_socket, ip, port
        self.body = {**CHAT, "model": model}
        self.counts: Counter[str] = Counter()  # sent, answered, failed
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def _send(self) -> None:
        while not self.stopping.is_set():
            try:
                status, said = pods.request(self.client_socket, self.ip, self.port, "/v1/chat/completions",
                                            self.body, timeout=60)
                ok = status == 200 and json.loads(said).get("choices")
                why = None if ok else f"{status}: {said[:200]}"
            except (OSError, ValueError) as exc:
                why = str(exc)
            with self.lock:
                self.counts["sent"] += 1
                self.counts["failed" if why else "answered"] += 1
                if why and len(self.errors) < 20:
                    self.errors.append(why)
