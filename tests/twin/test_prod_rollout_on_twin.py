"""prod rolled out on the cluster twin by `pdctl rollout --pulumi-stack prod`, step by step, by the
real Pulumi engine and the real Kubernetes provider, with SGLang and with vLLM.

Why: the rollout's first step once carried prod's weights Pod Identity associations while they
depended on the whole engines layer, and the real engine refused the targeted `up` ("untargeted
create"); the twin's tests rolled out dev only, which makes no association. Here the association
is made by the engine in the step that initialises each namespace, and EKS's rule is checked:
the Pod Identity webhook gives credentials to a pod when it is admitted (EKS user guide, "Pod
Identity": pods created before the association must be restarted), so no engine pod may exist in a
namespace when its association is created.

What stands in: pulumi-aws's provider (its module is not served: engine/provider-standins/aws_standin.py,
which records each association and the engine pods already in its namespace); kwok runs the pods;
twin/standins.py writes the status Envoy Gateway, Karpenter's AWS provider and NVIDIA's DRA
driver would; Prometheus is tests/servers.py's healthy stand-in; the platform stack is
tests/engine.py's stand-in stack.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from infra.components.engines import ENGINE_SERVICE_ACCOUNT
from infra.rollout.releases import ReleaseStore
from infra.spec import REPO_ROOT, stack_spec_path
from infra.spec_checks import load_spec, switch_engine
from infra.tracks import track_namespace
from tests.engine import engine_project, program_stack, serving_program
from tests.servers import healthy_prometheus
from tests.twin.conftest import FIGURES
from tests.twin.placement import delete_namespaces, pods_in
from tests.twin.test_tracks_on_twin import pods_on
from twin import fleet
from twin.build import program
from twin.api import kubectl
from twin.nodes import TWIN_LABEL, stack_nodes
from twin.paths import KUBECONFIG
from twin.standins import controllers_status


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_prod_rolls_out_step_by_step_on_the_twin(twin, engine, tmp_path, monkeypatch):
    spec = switch_engine(load_spec(stack_spec_path("prod")), engine)[0]
    env_ns = spec.environment.namespace
    namespaces = [env_ns, *[track_namespace(env_ns, r) for r in range(1, 4)]]
    delete_namespaces(namespaces)
    nodes = stack_nodes(spec)
    left = fleet.wait_for("no other render on prod's nodes", lambda: not pods_on(nodes), timeout=300) or pods_on(nodes)
    assert left is True, f"pods of another render still hold prod's nodes: {left[:5]}"
    assert fleet.apply_each_pass(nodes).rejected == {}
    project = engine_project(tmp_path, monkeypatch, stack="prod", twin=KUBECONFIG, engine=engine)
    program_stack(project, serving_program(tmp_path, "prod"))  # `pulumi stack init prod`: the rollout selects it
    monkeypatch.setenv("PATH", str(program("kubectl").parent) + os.pathsep + os.environ["PATH"])
    record = tmp_path / "aws-associations.jsonl"
    monkeypatch.setenv("PDSTACK_AWS_STANDIN_RECORD", str(record))
    releases = tmp_path / "releases"
    target = ["--spec", str(project.spec_file), "--pulumi-stack", "prod", "--pulumi-project", str(project.work_dir),
              "--releases", str(releases)]
    try:
        with healthy_prometheus() as prometheus, controllers_status(env_ns, spec.environment.name):
            done = subprocess.run([sys.executable, "-m", "infra.cli", "rollout", *target, "--prometheus", prometheus,
                                   "--bake", "0", "--stages", "100"], cwd=REPO_ROOT, capture_output=True, text=True,
                                  timeout=3600)
        assert done.returncode == 0, done.stderr[-3000:]
        store = ReleaseStore("prod", releases)
        assert store.traffic() == {1: 100} and store.status(1) == "good", store.state()

        engine_pods = [p for p in pods_in(set(namespaces)) if p["spec"].get("serviceAccountName") == ENGINE_SERVICE_ACCOUNT]
        unbound = [p["metadata"]["name"] for p in engine_pods if not p["spec"].get("nodeName")]
        assert engine_pods and unbound == [], f"engine pods not bound: {unbound[:5]}"
        created = [json.loads(line) for line in record.read_text().splitlines() if '"create"' in line]
        serving_namespaces = {p["metadata"]["namespace"] for p in engine_pods}
        assert serving_namespaces <= {c["namespace"] for c in created}, (serving_namespaces, created)
        late = [c for c in created if c["podsAlreadyThere"] != 0]
        assert late == [], f"associations made after engine pods were admitted (those run without credentials): {late}"
        FIGURES.append(f"prod-{engine} rollout (pdctl rollout --pulumi-stack prod, real engine): revision 1 at 100%; "
                       f"engine pods bound {len(engine_pods)}; Pod Identity associations {len(created)}, "
                       f"each before its namespace's engine pods")
    finally:
        delete_namespaces(namespaces)
        kubectl("delete", "nodepools.karpenter.sh", "-l", f"pdstack.io/environment={spec.environment.name}",
                "--ignore-not-found", "--wait=false")
        kubectl("delete", "nodes", "-l", f"{TWIN_LABEL}={spec.environment.name}", "--wait=false")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-s"]))
