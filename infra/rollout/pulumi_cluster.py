"""The `Cluster` of a real environment: changes go through Pulumi's Automation API (targeted
`up`s with the policy pack of the program, which deploys the tracks the release store says:
`ReleaseStore.intend` writes them before each change), readiness is read with `kubectl wait`,
the same conditions the steps list, and what traffic the cluster serves is read from the
live HTTPRoute (what the gateway was given, not what was intended).

The program is handed to the Automation API inline: it runs in this process (the Python
SDK's own language runtime serves it to the CLI) and reads the tracks from this rollout's
release store, the one `intend` just wrote to, `pdctl --releases` included. That also needs no
`pulumi-language-python` plugin beside the CLI. tests/test_engine.py drives this adapter with
the real CLI and Kubernetes provider (`make engine`); readiness and the live route need a
cluster (kubectl).
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from infra.offline import OfflineRun, run_offline
from infra.rollout.releases import ReleaseError, ReleaseStore
from infra.rollout.steps import Step
from infra.spec import REPO_ROOT
from infra import naming
from infra.tracks import plan_tracks, track_namespace

PROJECT = "pdstack"  # Pulumi.yaml name
POLICY_PACK = str(REPO_ROOT / "policy")


# --- pure: targets, waits ----------------------------------------------------------------------


def step_targets(run: OfflineRun, step: Step, revision: int) -> list[str]:
    """URNs of a step's resources for one revision: its track's copies, and shared ones."""
    prefix = f"r{revision}-"
    urns = []
    for r in run.custom():
        if r.name.startswith(prefix) and r.name[len(prefix):] in step.resources:
            urns.append(r.urn)
        elif step.shared and r.name in step.resources and not r.name.startswith("r"):
            urns.append(r.urn)
    return urns


def traffic_from_route(route: dict, namespace: str) -> dict[int, int]:
    """The live HTTPRoute (`kubectl get httproute gateway -o json`) -> revision -> weight. A
    backend in the environment's own namespace is the stack deployed without tracks (0)."""
    weights: dict[int, int] = {}
    for rule in route.get("spec", {}).get("rules", []):
        for ref in rule.get("backendRefs", []):
            ns = ref.get("namespace", namespace)
            match = re.fullmatch(re.escape(namespace) + r"-r(\d+)", ns)
            revision = int(match.group(1)) if match else 0
            weights[revision] = weights.get(revision, 0) + int(ref.get("weight", 1))
    return {rev: w for rev, w in weights.items() if w}


def wait_command(wait: str, namespace: str, timeout: str = "1s", kubectl: str = "kubectl") -> list[str]:
    """`Kind/name condition=X` or `Kind/name jsonpath=...` (Step.waits_for) -> kubectl wait."""
    target, _, condition = wait.partition(" ")
    kind, _, name = target.partition("/")
    cmd = [kubectl, "wait", f"{kind.lower()}/{name}", f"--for={condition}", f"--timeout={timeout}"]
    if kind not in ("NodePool", "Namespace"):  # cluster-scoped kinds take no namespace
        cmd += ["-n", namespace]
    return cmd


# --- the adapter -----------------------------------------------------------------------------------


@dataclass
class PulumiCluster:
    stack_name: str
    store: ReleaseStore
    kubectl: str = "kubectl"
    on_output: Callable[[str], None] = print
    run_command: Callable[[list[str]], int] = field(
        default=lambda cmd: subprocess.run(cmd, capture_output=True).returncode)
    read_command: Callable[[list[str]], str] = field(
        default=lambda cmd: subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    work_dir: Path = REPO_ROOT  # the Pulumi project: Pulumi.yaml, Pulumi.<stack>.yaml
    policy_pack: str = POLICY_PACK  # a folder, or policy/run-pack where the CLI has no Python language plugin
    _stack: object = None

    @property
    def stack(self):
        if self._stack is None:
            from pulumi import automation as auto

            from infra.program import main

            try:
                self._stack = auto.select_stack(stack_name=self.stack_name, project_name=PROJECT,
                                                program=lambda: main(store=self.store),
                                                opts=auto.LocalWorkspaceOptions(work_dir=str(self.work_dir)))
            except FileNotFoundError as exc:  # the Automation API shells out to the CLI
                raise ReleaseError("the Pulumi CLI is not installed here. Fix: install it (pulumi.com/docs/install), "
                                   "or use --sim for a simulated cluster") from exc
        return self._stack

    def _intended(self) -> dict[int, int]:
        return self.store.tracks() or {}

    def _environment_namespace(self) -> str:
        return self.store.get(max(self.store.revisions())).stack_spec().environment.namespace

    def _up(self, targets: list[str] | None) -> None:
        # show_secrets=False: the update's output goes to our logs, secrets must not.
        self.stack.up(target=targets, target_dependents=False, policy_packs=[self.policy_pack],
                      on_output=self.on_output, show_secrets=False)

    def _program_run(self, tracks: dict[int, int]) -> OfflineRun:
        """The program as `up` will run it, under mocks: where the URNs come from."""
        from infra.program import build_stack

        planned = plan_tracks([(rev, weight, self.store.get(rev).spec) for rev, weight in sorted(tracks.items())])
        newest = max(tracks)
        spec = self.store.get(newest).stack_spec()
        return run_offline(lambda: build_stack(spec, release=str(newest), tracks=planned),
                           project=PROJECT, stack=self.stack_name)

    def _namespace(self, revision: int) -> str:
        return track_namespace(self.store.get(revision).stack_spec().environment.namespace, revision)

    def apply(self, revision: int, step: Step) -> None:
        tracks = self._intended()
        if revision not in tracks:
            raise ValueError(f"revision {revision} is not among the recorded tracks {tracks}: record it first")
        self._up(step_targets(self._program_run(tracks), step, revision))

    def ready(self, revision: int, step: Step) -> bool:
        ns = self._namespace(revision)
        return all(self.run_command(wait_command(w, ns, kubectl=self.kubectl)) == 0 for w in step.waits_for)

    def deployed(self, revision: int) -> bool:
        # A retired track's namespace goes with it (a full `up` deletes the track's resources).
        return self.run_command([self.kubectl, "get", "namespace", self._namespace(revision)]) == 0

    def healthy(self, revision: int) -> bool:
        ns = self._namespace(revision)
        waits = ["Deployment/router condition=Available", "LeaderWorkerSet/engine-prefill condition=Available"]
        spec = self.store.get(revision).stack_spec()
        if spec.deployment.mode == "disaggregated":
            waits.append("LeaderWorkerSet/engine-decode condition=Available")
        return self.deployed(revision) and all(self.run_command(wait_command(w, ns, kubectl=self.kubectl)) == 0 for w in waits)

    def set_traffic(self, weights: dict[int, int]) -> None:
        from infra.rollout.cluster import check_weights

        weights, tracks = check_weights(weights), self._intended()
        if {r: w for r, w in tracks.items() if w} != weights:
            raise ValueError(f"traffic {weights} is not what the release store records ({tracks}): record it first")
        missing = sorted(r for r in weights if not self.deployed(r))
        if missing:
            raise ValueError(f"cannot route to revision(s) {missing}: not deployed")
        route = [r.urn for r in self._program_run(tracks).custom() if r.name == "httproute-gateway"]
        self._up(route)

    def traffic(self) -> dict[int, int]:
        self.stack  # noqa: B018 - a missing Pulumi CLI is said before anything else is tried
        if not self.store.revisions():
            return {}
        namespace = self._environment_namespace()
        try:
            route = self.read_command([self.kubectl, "get", "httproute", naming.GATEWAY, "-n", namespace, "-o", "json"])
        except subprocess.CalledProcessError as exc:
            if "NotFound" in (exc.stderr or ""):
                return {}  # never deployed
            raise ReleaseError(f"cannot read the live route of {namespace}: {(exc.stderr or '').strip()}. Fix: check "
                               "kubectl's context for this environment") from None
        except FileNotFoundError:
            raise ReleaseError("kubectl is not installed here. Fix: install it, or use --sim") from None
        return traffic_from_route(json.loads(route), namespace)

    def retire(self, revision: int) -> None:
        if self.traffic().get(revision):
            raise ValueError(f"revision {revision} still takes traffic")
        if revision in self._intended():
            raise ValueError(f"revision {revision} is still among the recorded tracks: record its removal first")
        self._up(None)  # a full update deletes the track's resources
