"""The program, the policy pack and the rollout's Automation API path under the real Pulumi
engine: the `pulumi` CLI v3.274.1 and pulumi-kubernetes' provider built from the Go modules
engine/*/go.mod pin (`make engine`), a file backend in the test's folder, and the pinned
Python SDK (pulumi 3.272.0) serving the program to the CLI. tests/engine.py says what stands
in (pulumi-random's provider) and why.

Without the cluster twin the provider's kubeconfig points at a closed port: `preview` then
runs the provider offline, and `up` renders every object to YAML through the provider's
renderYamlToDirectory mode (pulumi-kubernetes provider/pkg/provider/provider.go, `yamlRenderMode`)
instead of applying it. On the cluster twin, tests/twin/test_pulumi_on_twin.py applies dev for real.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pulumi_kubernetes as k8s
import pytest
import yaml
from pulumi import automation as auto

from infra.components.access import API_KEYS_SECRET
from infra.offline import run_offline, run_spec
from infra.program import build_stack
from infra.recording import manifest_of
from infra.rollout.pulumi_cluster import POLICY_PACK, PROJECT, KubeTarget, PulumiCluster, step_targets
from infra.rollout.releases import ReleaseStore
from infra.rollout.steps import plan_steps
from infra.spec import stack_spec_path
from infra.spec_checks import load_spec
from infra.tracks import track_namespace
from tests.engine import engine_project, program_stack, serving_program


def offline_urns(stack: str) -> set[str]:
    """URNs of the custom resources the program registers under Pulumi's mocks (infra/offline.py)."""
    spec = load_spec(stack_spec_path(stack))
    run = run_offline(lambda: build_stack(spec, release="unreleased"), project=PROJECT, stack=stack)
    return {r.urn for r in run.custom()}


def urn_type(urn: str) -> str:
    """urn:pulumi:STACK::PROJECT::parent$type::name -> type."""
    return urn.split("::")[2].rsplit("$", 1)[-1]


class Events:
    """The engine's events: which step each resource took."""

    def __init__(self):
        self.steps: dict[str, str] = {}
        self.policy: list[tuple[str, str, str]] = []

    def __call__(self, event: auto.EngineEvent) -> None:
        if event.resource_pre_event:
            meta = event.resource_pre_event.metadata
            self.steps[meta.urn] = str(meta.op.value if hasattr(meta.op, "value") else meta.op)
        if event.policy_event:
            p = event.policy_event
            self.policy.append((p.policy_name, p.enforcement_level, p.message))


def rendered_objects(folder: Path) -> list[dict]:
    return [yaml.safe_load(f.read_text()) for f in sorted(folder.rglob("*.yaml"))]


def test_preview_of_dev_creates_what_the_mocks_record(tmp_path, monkeypatch):
    """`pulumi preview` of dev by the real engine: every custom resource the offline preview
    (Pulumi's mocks) records is planned for creation under the same URN, and nothing else."""
    project = engine_project(tmp_path, monkeypatch)
    events = Events()
    result = program_stack(project, serving_program(tmp_path)).preview(on_event=events, on_output=lambda line: None)
    created = {urn for urn, op in events.steps.items() if op == "create"}
    custom = {urn for urn in created if not urn_type(urn).startswith(("pdstack:", "pulumi:"))}
    assert custom == offline_urns("dev")
    default_providers = {urn for urn in created if urn_type(urn).startswith("pulumi:providers:")
                         and urn.rsplit("::", 1)[-1].startswith("default")}
    # The count leaves out the default providers; the explicit one (platform-cluster) is counted.
    assert result.change_summary.get(auto.OpType.CREATE) == len(created - default_providers)


def test_up_renders_every_object_through_the_real_provider(tmp_path, monkeypatch):
    """`pulumi up` of dev, for real, with the Kubernetes provider rendering each object to YAML
    (renderYamlToDirectory) instead of sending it: every manifest of the offline preview is
    rendered once, with the same kind, name and namespace; the generated API key reaches the
    Secret, and neither the update's output nor the stack's state holds it in plain text."""
    project = engine_project(tmp_path, monkeypatch)
    render = tmp_path / "rendered"
    project.render_yaml_to(render)
    output: list[str] = []
    result = program_stack(project, serving_program(tmp_path)).up(on_output=output.append, show_secrets=False)
    assert result.summary.result == "succeeded"

    objects = rendered_objects(render)
    spec = load_spec(stack_spec_path("dev"))
    expected = run_offline(lambda: build_stack(spec, release="unreleased"), project=PROJECT, stack="dev")
    # Cluster-scoped custom resources (NodePool) come out with namespace "default": in this
    # mode the provider has no API server to tell it their scope, so only namespaces the
    # program sets are compared.
    offline = {(m["kind"], m["metadata"]["name"]): m["metadata"].get("namespace")
               for m in map(manifest_of, expected.custom()) if m}
    rendered = {(o["kind"], o["metadata"]["name"]): o["metadata"].get("namespace") for o in objects}
    assert len(objects) == len(rendered) and rendered.keys() == offline.keys()
    assert all(rendered[k] == ns for k, ns in offline.items() if ns is not None)

    (keys,) = [o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == API_KEYS_SECRET]
    values = list((keys.get("stringData") or keys.get("data")).values())
    assert values and all(len(v) >= 48 for v in values)
    state = "".join(p.read_text() for p in (tmp_path / "state").rglob("*.json"))
    for value in values:
        assert value not in "".join(output) and value not in state


def test_policy_pack_runs_in_the_real_engine(tmp_path, monkeypatch):
    """`pulumi preview --policy-pack policy/run-pack`: the real engine starts the pack
    (pulumi-policy's analyzer, the pack's __main__.py) and dev passes every mandatory rule; a program that leaks a key into a
    ConfigMap is stopped by the mandatory no-plaintext-secrets rule."""
    project = engine_project(tmp_path, monkeypatch)
    events = Events()
    program_stack(project, serving_program(tmp_path)).preview(policy_packs=[POLICY_PACK], on_event=events,
                                                         on_output=lambda line: None)
    assert not [p for p in events.policy if p[1] == "mandatory"], events.policy

    def leaky() -> None:
        k8s.core.v1.ConfigMap("leaky", data={"key": "-----BEGIN RSA PRIVATE KEY-----\nMIIE\n"})

    (tmp_path / "leaky").mkdir()
    leaky_project = engine_project(tmp_path / "leaky", monkeypatch)
    events = Events()
    with pytest.raises(auto.CommandError, match="no-plaintext-secrets"):
        program_stack(leaky_project, leaky).preview(policy_packs=[POLICY_PACK], on_event=events,
                                                    on_output=lambda line: None)
    assert ("no-plaintext-secrets", "mandatory") in {p[:2] for p in events.policy}


def test_the_rollout_applies_its_steps_through_the_automation_api(tmp_path, monkeypatch):
    """PulumiCluster, as `pdctl rollout --pulumi-stack` uses it: a targeted `up` with the policy
    pack for each step of revision 1 in order, then the traffic, the program reading the tracks
    from the rollout's own store. The real engine resolves the URNs the adapter computed from
    the mocked run (it refuses a resource whose parent or dependency is neither in the state
    nor targeted); each step renders its own objects only, and after the traffic every object
    of the program is rendered once."""
    project = engine_project(tmp_path, monkeypatch)
    render = tmp_path / "rendered"
    project.render_yaml_to(render)
    store = ReleaseStore("dev", tmp_path / "releases")
    spec = load_spec(project.spec_file)  # its placeholder images pinned: the pack refuses placeholders
    revision = store.create(spec).revision
    program_stack(project, serving_program(tmp_path))  # `pulumi stack init dev`: the adapter selects an existing stack
    store.intend({revision: 100})
    output: list[str] = []

    def no_route_yet(cmd: list[str]) -> str:  # no cluster in render mode: the route never exists
        raise subprocess.CalledProcessError(1, cmd, "", 'Error from server (NotFound): httproutes "gateway" not found')
    # render_yaml_to dropped the stack's context (the provider takes none then): kubectl's is named here.
    cluster = PulumiCluster("dev", store, work_dir=project.work_dir, policy_pack=POLICY_PACK,
                            on_output=output.append, run_command=lambda cmd: 0, read_command=no_route_yet,
                            kube=KubeTarget("pdstack-dev"))
    run = cluster._program_run(store.tracks())
    rendered_so_far = 0
    for step in plan_steps(spec, run_spec(spec).resources):
        targets = step_targets(run, step, revision)  # the step's objects and the track's components above them
        cluster.apply(revision, step, fence=1)
        objects = rendered_objects(render)
        assert len(objects) - rendered_so_far == len([u for u in targets if "kubernetes:" in u.split("::")[2]]), step
        rendered_so_far = len(objects)
    prefill = [o for o in objects if o["metadata"].get("labels", {}).get("pdstack.io/role") == "prefill"
               and o["kind"] != "NodePool"]  # cluster-scoped (rendered with namespace "default" here)
    assert {o["metadata"]["namespace"] for o in prefill} == {track_namespace(spec.environment.namespace, revision)}

    cluster.set_traffic({revision: 100}, fence=1)  # no route yet: Pulumi creates it
    objects = rendered_objects(render)
    expected = [manifest_of(r) for r in run.custom() if r.type.startswith("kubernetes:")]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in objects) == sorted(
        (m["kind"], m["metadata"]["name"]) for m in expected)
