"""The engine PodMonitor, run through a real Prometheus: every engine pod that serves /metrics is a
target and none that serves nothing is (issue #37 item 8).

What serves is read from the pinned engines' own source (their wheels, scripts/pinned_wheels.py):
- vllm 0.33.0, vllm/entrypoints/cli/serve.py: `--headless` sets api_server_count to 0 and runs
  `run_headless`, which starts engine cores and no HTTP server. Any other `vllm serve` starts API
  servers, which serve /metrics.
- sglang 0.5.23, sglang/srt/entrypoints/engine.py: node_rank >= 1 runs
  `launch_dummy_health_check_server(host, port, enable_metrics)` (sglang/srt/utils/common.py),
  which mounts /metrics when --enable-metrics is on; node_rank 0 serves the full HTTP server.

Each pod's argv is the one its launch script execs as the pod's LWS worker index
(infra/render/engine_check launch_argv, /bin/sh with LWS's environment). Its labels are the rendered
template's plus those LWS puts on every pod (kubernetes-sigs/lws v0.10.0,
api/leaderworkerset/v1/leaderworkerset_types.go: name, group-index, worker-index). The PodMonitor
becomes the scrape config prometheus-operator v0.93.0 generates for it (pkg/prometheus/promcfg.go,
generatePodMonitorConfig: a keep per selector expression on __meta_kubernetes_pod_label_<l> and
..._labelpresent_<l>, a keep on the container port name, the target labels, then the endpoint's
own relabelings), with file-based discovery carrying the same __meta_kubernetes_pod_* labels
Kubernetes discovery would. Real Prometheus (the one on PATH) applies the relabelings; a pod that
serves answers /metrics on 127.0.0.1, one that does not leaves its port closed, so a kept headless
worker would show as a target that is down.
"""

from __future__ import annotations

import http.server
import json
import re
import time
import urllib.request
import zipfile

import pytest

from infra import naming
from infra.offline import run_spec
from infra.render.engine_args import all_launches
from infra.render.engine_check import launch_argv, variant_spec
from infra.render.metrics import catalogue, series_label
from tests.conftest import script_modules
from tests.servers import free_port, prometheus_server, serving

LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"


def wheel_source(engine: str, module: str) -> str:
    (pinned_wheels,) = script_modules("pinned_wheels")
    pinned = catalogue(engine)
    with zipfile.ZipFile(pinned_wheels.pinned_wheel(engine, pinned["version"])) as z:
        return z.read(module.replace(".", "/") + ".py").decode()


def test_what_serves_is_what_the_pinned_engines_say():
    """The two rules `serves_metrics` encodes, found in the wheels' source (see the module docstring)."""
    serve = wheel_source("vllm", "vllm.entrypoints.cli.serve")
    cmd = serve[serve.index("    def cmd("):serve.index("    def validate(")]
    assert re.search(r"if args\.headless:.*?args\.api_server_count = 0", cmd, re.S)
    assert re.search(r"elif args\.api_server_count < 1:\s*run_headless\(args\)", cmd)
    headless = serve[serve.index("def run_headless("):]
    headless = headless[:headless.index("\ndef ")]
    assert not re.search(r"serve_http|uvicorn|build_app|run_server", headless), "vLLM's headless mode serves HTTP now"
    engine = wheel_source("sglang", "sglang.srt.entrypoints.engine")
    follower = engine[engine.index("if get_parallel().node_rank >= 1:"):]
    assert re.search(r"launch_dummy_health_check_server\(\s*get_serving\(\)\.host,\s*get_serving\(\)\.port,\s*"
                     r"get_observability\(\)\.enable_metrics", follower)


def serves_metrics(engine: str, argv: list[str], worker_index: int) -> bool:
    if engine == "vllm":
        return "--headless" not in argv
    return worker_index == 0 or "--enable-metrics" in argv


def rendered_pods(run) -> list[dict]:
    """One group of every engine LeaderWorkerSet, each pod as Kubernetes discovery describes it."""
    pods = []
    for lws in run.by_kind("LeaderWorkerSet"):
        name, namespace = lws["metadata"]["name"], lws["metadata"]["namespace"]
        group = lws["spec"]["leaderWorkerTemplate"]
        for index in range(group["size"]):
            template = group.get("leaderTemplate", group["workerTemplate"]) if index == 0 else group["workerTemplate"]
            labels = {**template["metadata"]["labels"], LWS_NAME_LABEL: name,
                      naming.LWS_GROUP_INDEX_LABEL: "0", naming.LWS_WORKER_INDEX_LABEL: str(index)}
            (container,) = [c for c in template["spec"]["containers"] if c["name"] == "engine"]
            pods.append({"name": f"{name}-0" + (f"-{index}" if index else ""), "namespace": namespace,
                         "labels": labels, "container": container, "index": index})
    return pods


def discovered(pod: dict, address: str) -> list[dict]:
    """A file_sd target group per container port, with Kubernetes pod discovery's meta labels."""
    meta = {"__meta_kubernetes_namespace": pod["namespace"], "__meta_kubernetes_pod_name": pod["name"],
            "__meta_kubernetes_pod_phase": "Running", "__meta_kubernetes_pod_container_name": pod["container"]["name"]}
    for key, value in pod["labels"].items():
        meta[f"__meta_kubernetes_pod_label_{series_label(key)}"] = value
        meta[f"__meta_kubernetes_pod_labelpresent_{series_label(key)}"] = "true"
    return [{"targets": [address], "labels": {**meta, "__meta_kubernetes_pod_container_port_name": port["name"],
                                               "__meta_kubernetes_pod_container_port_number": str(port["containerPort"])}}
            for port in pod["container"]["ports"]]


def snake(key: str) -> str:
    return re.sub(r"[A-Z]", lambda m: "_" + m.group().lower(), key)


def operator_scrape_config(monitor: dict, targets_file: str) -> dict:
    """The scrape config prometheus-operator v0.93.0 makes of a PodMonitor's first endpoint (see the
    module docstring), over file discovery instead of the Kubernetes API."""
    spec, meta = monitor["spec"], monitor["metadata"]
    (endpoint,) = spec["podMetricsEndpoints"]
    label = lambda k: f"__meta_kubernetes_pod_label_{series_label(k)}"  # noqa: E731
    present = lambda k: f"__meta_kubernetes_pod_labelpresent_{series_label(k)}"  # noqa: E731
    relabel = []
    for k, v in spec["selector"].get("matchLabels", {}).items():
        relabel.append({"action": "keep", "source_labels": [label(k), present(k)], "regex": f"({v});true"})
    for e in spec["selector"].get("matchExpressions", []):
        assert e["operator"] == "In", f"this stand-in implements In only, not {e['operator']}"
        relabel.append({"action": "keep", "source_labels": [label(e["key"]), present(e["key"])],
                        "regex": f"({'|'.join(e['values'])});true"})
    relabel += [
        {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": endpoint["port"]},
        {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        *({"source_labels": [label(k)], "target_label": series_label(k), "regex": "(.+)", "replacement": "${1}"}
          for k in spec.get("podTargetLabels", [])),
        {"target_label": "job", "replacement": f"{meta['namespace']}/{meta['name']}"},
        {"target_label": "endpoint", "replacement": endpoint["port"]},
        *({snake(k): v for k, v in r.items()} for r in endpoint.get("relabelings", [])),
    ]
    return {"job_name": f"podMonitor/{meta['namespace']}/{meta['name']}/0", "metrics_path": endpoint["path"],
            "file_sd_configs": [{"files": [targets_file]}], "relabel_configs": relabel}


class MetricsHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"pdstack_scrape_probe 1\n"
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def targets(url: str, expected: int) -> dict:
    """Prometheus's targets once every discovered one is dropped or scraped at least once."""
    deadline = time.monotonic() + 120
    while True:
        data = json.load(urllib.request.urlopen(f"{url}/api/v1/targets?state=any", timeout=10))["data"]
        seen = len(data["activeTargets"]) + len(data["droppedTargets"])
        if seen == expected and all(t["health"] != "unknown" for t in data["activeTargets"]):
            return data
        assert time.monotonic() < deadline, f"Prometheus saw {seen} of {expected} targets"
        time.sleep(0.5)


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_every_engine_pod_that_serves_metrics_is_an_up_target_and_no_other(tmp_path, stack):
    runs = {engine: run_spec(variant_spec(stack, engine)) for engine in ("sglang", "vllm")}
    closed = f"127.0.0.1:{free_port()}"  # nothing listens: where a pod that serves nothing is
    expected, jobs = {}, []
    with serving(MetricsHandler) as metrics_url:
        open_address = metrics_url.removeprefix("http://")
        for engine, run in runs.items():
            launches = all_launches(variant_spec(stack, engine))
            groups = []
            for pod in rendered_pods(run):
                role = pod["labels"][naming.ROLE_LABEL]
                serves = serves_metrics(engine, launch_argv(launches[role], pod["index"]), pod["index"])
                expected[(engine, pod["name"])] = serves
                groups += discovered(pod, open_address if serves else closed)
            (tmp_path / f"{engine}.json").write_text(json.dumps(groups))
            (monitor,) = run.by_kind("PodMonitor")
            job = operator_scrape_config(monitor, str(tmp_path / f"{engine}.json"))
            jobs.append({**job, "job_name": f"{engine}/{job['job_name']}"})
        assert any(not s for s in expected.values()) or stack == "dev", "prod has multi-node groups"
        with prometheus_server(tmp_path / "prom", jobs) as url:
            data = targets(url, sum(len(json.loads((tmp_path / f"{e}.json").read_text())) for e in runs))
    scraped = {(t["scrapePool"].split("/")[0], t["labels"]["pod"]): t["health"] for t in data["activeTargets"]}
    assert {key for key, serves in expected.items() if serves} == set(scraped), \
        "the scrape targets are not the pods that serve /metrics"
    assert set(scraped.values()) == {"up"}, {k: h for k, h in scraped.items() if h != "up"}
    assert len(scraped) == len(data["activeTargets"])  # one target per pod: the engine port only
