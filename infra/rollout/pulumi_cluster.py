"""The `Cluster` of a real environment: changes go through Pulumi's Automation API (the
stack's `pdstack:tracks` config and targeted `up`s, with the policy pack), readiness is
read with `kubectl wait`, the same conditions the steps list.

This machine has no Pulumi CLI (the Automation API drives it) and no API server, so this
adapter runs only where they exist; its pure parts (which resources a step targets, the
tracks config, the wait commands) are tested here.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from typing import Callable

from infra.offline import OfflineRun, run_offline
from infra.rollout.releases import ReleaseError, ReleaseStore
from infra.rollout.steps import Step
from infra.spec import REPO_ROOT
from infra.tracks import CONFIG_KEY, plan_tracks, track_namespace

PROJECT = "pdstack"  # Pulumi.yaml name
POLICY_PACK = str(REPO_ROOT / "policy")


# --- pure: tracks config, targets, waits ------------------------------------------------------


def with_track(entries: list[dict], revision: int) -> list[dict]:
    """The tracks config with `revision` present (a new track joins with weight 0)."""
    if any(e["revision"] == revision for e in entries):
        return [dict(e) for e in entries]
    return [*(dict(e) for e in entries), {"revision": revision, "weight": 0}]


def with_weights(entries: list[dict], weights: dict[int, int]) -> list[dict]:
    missing = sorted(set(weights) - {e["revision"] for e in entries})
    if missing:
        raise ValueError(f"cannot route to revision(s) {missing}: not deployed")
    return [{**e, "weight": weights.get(e["revision"], 0)} for e in entries]


def without_track(entries: list[dict], revision: int) -> list[dict]:
    return [dict(e) for e in entries if e["revision"] != revision]


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
    _stack: object = None

    @property
    def stack(self):
        if self._stack is None:
            from pulumi import automation as auto

            try:
                self._stack = auto.select_stack(stack_name=self.stack_name, work_dir=str(REPO_ROOT))
            except FileNotFoundError as exc:  # the Automation API shells out to the CLI
                raise ReleaseError("the Pulumi CLI is not installed here. Fix: install it (pulumi.com/docs/install), "
                                   "or use --sim for a simulated cluster") from exc
        return self._stack

    def _entries(self) -> list[dict]:
        # get_all_config: the key is absent before the first rollout, and that is not an error
        # (a missing CLI or a broken stack is, and reaches the operator as itself).
        value = self.stack.get_all_config().get(f"pdstack:{CONFIG_KEY}")
        raw = getattr(value, "value", None)
        return json.loads(raw) if raw else []

    def _up(self, entries: list[dict], targets: list[str] | None) -> None:
        from pulumi import automation as auto

        self.stack.set_config(f"pdstack:{CONFIG_KEY}", auto.ConfigValue(json.dumps(entries)))
        # show_secrets=False: the update's output goes to our logs, secrets must not.
        self.stack.up(target=targets, target_dependents=False, policy_packs=[POLICY_PACK],
                      on_output=self.on_output, show_secrets=False)

    def _program_run(self, entries: list[dict]) -> OfflineRun:
        """The program as `up` will run it, under mocks: where the URNs come from."""
        from infra.program import build_stack

        tracks = plan_tracks([(e["revision"], e["weight"], self.store.get(e["revision"]).spec) for e in entries])
        newest = max(e["revision"] for e in entries)
        spec = self.store.get(newest).stack_spec()
        return run_offline(lambda: build_stack(spec, release=str(newest), tracks=tracks),
                           project=PROJECT, stack=self.stack_name)

    def _namespace(self, revision: int) -> str:
        return track_namespace(self.store.get(revision).stack_spec().environment.namespace, revision)

    def apply(self, revision: int, step: Step) -> None:
        entries = with_track(self._entries(), revision)
        self._up(entries, step_targets(self._program_run(entries), step, revision))

    def ready(self, revision: int, step: Step) -> bool:
        ns = self._namespace(revision)
        return all(self.run_command(wait_command(w, ns, kubectl=self.kubectl)) == 0 for w in step.waits_for)

    def deployed(self, revision: int) -> bool:
        return any(e["revision"] == revision for e in self._entries())

    def healthy(self, revision: int) -> bool:
        ns = self._namespace(revision)
        waits = ["Deployment/router condition=Available", "LeaderWorkerSet/engine-prefill condition=Available"]
        spec = self.store.get(revision).stack_spec()
        if spec.deployment.mode == "disaggregated":
            waits.append("LeaderWorkerSet/engine-decode condition=Available")
        return self.deployed(revision) and all(self.run_command(wait_command(w, ns, kubectl=self.kubectl)) == 0 for w in waits)

    def set_traffic(self, weights: dict[int, int]) -> None:
        from infra.rollout.cluster import check_weights

        entries = with_weights(self._entries(), check_weights(weights))
        route = [r.urn for r in self._program_run(entries).custom() if r.name == "httproute-gateway"]
        self._up(entries, route)

    def traffic(self) -> dict[int, int]:
        return {e["revision"]: e["weight"] for e in self._entries() if e["weight"]}

    def retire(self, revision: int) -> None:
        entries = self._entries()
        if any(e["revision"] == revision and e["weight"] for e in entries):
            raise ValueError(f"revision {revision} still takes traffic")
        self._up(without_track(entries, revision), None)  # a full update deletes the track's resources
