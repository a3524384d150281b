"""The `Cluster` of a real environment: changes go through Pulumi's Automation API (targeted
`up`s with the policy pack of the program, which deploys the tracks the release store says:
`ReleaseStore.intend` writes them before each change), readiness is read with `kubectl wait`,
the same conditions the steps list, and what traffic the cluster serves is read from the
live HTTPRoute (what the gateway was given, not what was intended).

Fencing (cluster.py): the gateway's HTTPRoute carries the fence of the last lease that
changed the environment, in the `pdstack.io/fence` annotation. A traffic change is one
merge patch of the route's rules (as the program renders them from the recorded tracks) and
that annotation, carrying the resourceVersion the fence was read at: kube-apiserver refuses
the patch with 409 Conflict if the route changed since (kubernetes
staging/src/k8s.io/apiserver/pkg/registry/generic/registry/store.go, Store.Update:
`newResourceVersion != existingResourceVersion` -> `NewConflict(... OptimisticLockErrorMsg)`;
a patch is applied to the stored object and goes through that same Update, handlers/patch.go),
so the fence comparison and the change are one compare-and-swap. Before every other change
(a targeted `up`) the route's fence is compared, and raised, the same way.

kubectl is always given the stack's own cluster: `--context` from `kubernetes:context` in
`Pulumi.<stack>.yaml` (what Pulumi's Kubernetes provider uses too), and `--kubeconfig` when
the stack names one. A stack that pins no context is refused: kubectl would otherwise act on
whatever cluster the operator's current context points at.

The program is handed to the Automation API inline: it runs in this process (the Python
SDK's own language runtime serves it to the CLI) and reads the tracks from this rollout's
release store, the one `intend` just wrote to, `pdctl --releases` included. That also needs no
`pulumi-language-python` plugin beside the CLI. tests/test_engine.py drives this adapter with
the real CLI and Kubernetes provider (`make engine`); readiness and the live route need a
cluster (kubectl): tests/test_pulumi_cluster.py checks the command lines and the fenced patch
against a stand-in that answers as kube-apiserver does, until the cluster twin runs them.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from infra import naming
from infra.inputs import InputError, load_yaml_mapping
from infra.offline import run_offline
from infra.recording import OfflineRun, manifest_of
from infra.rollout.cluster import check_weights, fence_refused
from infra.rollout.faultpoints import before_change
from infra.rollout.releases import ReleaseError, ReleaseStore
from infra.rollout.steps import ROUTE_RESOURCE, Step, step_of
from infra.spec import REPO_ROOT
from infra.tracks import plan_tracks, track_namespace

PROJECT = "pdstack"  # Pulumi.yaml name
TRACK_NAME = re.compile(r"r\d+-")  # a release track's copy of a resource (infra/program.py name_prefix)
OPEN_ACCESS_STEP = "open access"
# The pack as an executable analyzer (policy/run-pack): any CLI starts it, the one built from
# the module proxy too, which has no pulumi-language-python plugin for the folder form.
POLICY_PACK = str(REPO_ROOT / "policy" / "run-pack")
FENCE_ANNOTATION = "pdstack.io/fence"
ROUTE_CAS_ATTEMPTS = 5  # the gateway controller's status writes also move the resourceVersion


@dataclass(frozen=True)
class KubeTarget:
    """Which cluster kubectl talks to: the stack's own, never the current context."""

    context: str
    kubeconfig: str | None = None

    def args(self) -> list[str]:
        return ["--context", self.context, *(["--kubeconfig", self.kubeconfig] if self.kubeconfig else [])]


def kube_target(stack_name: str, project_dir: Path = REPO_ROOT) -> KubeTarget:
    """The stack's cluster, from `Pulumi.<stack>.yaml`: `kubernetes:context` (required) and
    `kubernetes:kubeconfig` (a path; contents or a secret value are refused: a kubeconfig is a
    credential, and kubectl is handed a file)."""
    short = stack_name.rsplit("/", 1)[-1]  # org/project/stack -> stack
    if not naming.PULUMI_STACK_NAME.fullmatch(short):
        raise InputError(f"--pulumi-stack {stack_name[:80]!r}: not a stack name (letters, digits, '_', '.', '-', not "
                         "starting with '-', 100 at most). Fix: e.g. --pulumi-stack prod")
    path = project_dir / f"Pulumi.{short}.yaml"
    if not path.is_file():
        raise InputError(f"--pulumi-stack {stack_name}: {path} does not exist, so which cluster it deploys to is "
                         "unknown. Nothing was changed. Fix: name a stack of this project (Pulumi.<stack>.yaml)")
    config = load_yaml_mapping(path, "Pulumi stack").get("config") or {}
    if not isinstance(config, dict):
        raise InputError(f"{path}: config is not a mapping. Fix: config: {{key: value, ...}}")
    context = config.get("kubernetes:context")
    if not isinstance(context, str) or not context.strip():
        raise InputError(f"{path}: config kubernetes:context is not set, so kubectl would act on whatever cluster its "
                         "current context points at. Nothing was changed. Fix: add `kubernetes:context: <the context "
                         "of this environment's cluster>` under config (Pulumi's Kubernetes provider reads it too)")
    kubeconfig = config.get("kubernetes:kubeconfig")
    if kubeconfig is None:
        return KubeTarget(context)
    fix = ("Fix: keep the kubeconfig in a file only you can read and set kubernetes:kubeconfig to its path, or "
           "leave it unset and use KUBECONFIG")
    if not isinstance(kubeconfig, str):
        raise InputError(f"{path}: kubernetes:kubeconfig is a secret value; pdctl hands kubectl a file and does not "
                         f"decrypt stack secrets. {fix}")
    if "\n" in kubeconfig or kubeconfig.lstrip().startswith(("{", "apiVersion")):
        raise InputError(f"{path}: kubernetes:kubeconfig holds a kubeconfig's contents, credentials in plain text in "
                         f"the stack file. {fix}")
    file = Path(kubeconfig).expanduser()
    file = file if file.is_absolute() else project_dir / file
    if not file.is_file():
        raise InputError(f"{path}: kubernetes:kubeconfig {kubeconfig}: no such file. Fix: correct the path")
    return KubeTarget(context, str(file))


# --- pure: targets, waits ----------------------------------------------------------------------


def step_targets(run: OfflineRun, step: Step, revision: int) -> list[str]:
    """URNs for `pulumi up --target` of one step of one revision: the step's resources (its
    track's copies, and shared ones), then the component resources they sit under. The real
    engine refuses to create a resource whose parent is neither in the state nor targeted
    ("depends on ...::dev-r1-engines which was not specified in --target list"), and a
    track's components are new with its first step; a component has no cluster object, so
    targeting it changes nothing else."""
    prefix = f"r{revision}-"
    objects = []
    for r in run.custom():
        if r.type.startswith("pulumi:providers:") or step_of(r, manifest_of(r)) != step.name:
            continue
        # Classified by layer and kind, not matched by name against the untracked plan: a track
        # has objects the environment has not, or under another name (its own namespace
        # `r1-namespace-pdstack-dev-r1`, the ReferenceGrant that lets the route reach it).
        # The environment's own objects go with the shared steps and with "open access" (the
        # gateway, its keys and policies), except the route: set_traffic owns it, by one fenced
        # patch, so that no `up` rewrites its weights or drops the fence it carries.
        environment_wide = not TRACK_NAME.match(r.name)
        if r.name.startswith(prefix) or (environment_wide and r.name != ROUTE_RESOURCE
                                         and (step.shared or step.name == OPEN_ACCESS_STEP)):
            objects.append(r)
    components = {r.urn: r for r in run.resources if not r.custom and not r.remote}
    ancestors: list[str] = []
    for r in objects:
        parent = r.parent_urn
        while parent in components and parent not in ancestors:
            ancestors.append(parent)
            parent = components[parent].parent_urn
    return [r.urn for r in objects] + [engine_urn(urn) for urn in ancestors]


def engine_urn(urn: str) -> str:
    """A URN as the real engine writes it. Pulumi's mocks qualify a resource whose parent is the
    stack with the stack's type (`...::pulumi:pulumi:Stack$pdstack:engines:Engines::dev-r1-engines`);
    the engine leaves the root stack out of the type chain (`...::pdstack:engines:Engines::...`),
    as it does in every URN of a child of such a component."""
    return urn.replace("::pulumi:pulumi:Stack$", "::", 1)


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


def wait_command(wait: str, namespace: str, timeout: str = "1s") -> list[str]:
    """`Kind/name condition=X` or `Kind/name jsonpath=...` (Step.waits_for) -> kubectl wait's
    arguments, read in `namespace` unless the wait names its own (`... in <namespace>`)."""
    target, _, condition = wait.partition(" ")
    condition, _, own_namespace = condition.partition(" in ")
    namespace = own_namespace or namespace
    kind, _, name = target.partition("/")
    cmd = ["wait", f"{kind.lower()}/{name}", f"--for={condition}", f"--timeout={timeout}"]
    if kind not in ("NodePool", "Namespace"):  # cluster-scoped kinds take no namespace
        cmd += ["-n", namespace]
    return cmd


# --- the adapter -----------------------------------------------------------------------------------


def _run(cmd: list[str]) -> int:
    return subprocess.run(cmd, capture_output=True).returncode


def _read(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


@dataclass
class PulumiCluster:
    stack_name: str
    store: ReleaseStore
    kubectl: str = "kubectl"
    on_output: Callable[[str], None] = print
    run_command: Callable[[list[str]], int] = _run  # exit code
    read_command: Callable[[list[str]], str] = _read  # stdout; CalledProcessError (with stderr) on failure
    work_dir: Path = REPO_ROOT  # the Pulumi project: Pulumi.yaml, Pulumi.<stack>.yaml
    policy_pack: str = POLICY_PACK
    kube: KubeTarget | None = None  # default: the stack's (kube_target), checked when this is made
    _stack: object = None

    def __post_init__(self) -> None:
        if self.kube is None:
            self.kube = kube_target(self.stack_name, self.work_dir)

    def _kubectl(self, *args: str) -> list[str]:
        """Every kubectl command line: the stack's context (and kubeconfig) first."""
        return [self.kubectl, *self.kube.args(), *args]

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

    def _up(self, targets: list[str] | None, what: str) -> None:
        """`targets` None: the whole stack. An empty list is not passed on: the Automation API
        drops an empty --target, and the update would then change everything, the route too."""
        if targets is not None and not targets:
            return
        before_change(what)  # a fault point, like every change (infra/rollout/faultpoints.py)
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

    # --- the route: live traffic and the fence -----------------------------------------------------

    def _route(self) -> tuple[str, dict | None]:
        """The environment's namespace and its live HTTPRoute (None: not created yet)."""
        namespace = self._environment_namespace()
        try:
            text = self.read_command(self._kubectl("get", "httproute", naming.GATEWAY, "-n", namespace, "-o", "json"))
        except subprocess.CalledProcessError as exc:
            if "NotFound" in (exc.stderr or ""):
                return namespace, None
            raise ReleaseError(f"cannot read the live route of {namespace} (context {self.kube.context}): "
                               f"{(exc.stderr or '').strip()}. Fix: check kubectl's access to that cluster") from None
        except FileNotFoundError:
            raise ReleaseError("kubectl is not installed here. Fix: install it, or use --sim") from None
        return namespace, json.loads(text)

    def _swap_route(self, fence: int, what: str, rules: list | None = None) -> bool:
        """Compare the route's fence with `fence` and, in one patch conditional on the
        resourceVersion it was read at, raise it to `fence` (and set the rules, if given).
        FenceRefused if the route carries a newer fence; False if there is no route yet."""
        for _ in range(ROUTE_CAS_ATTEMPTS):
            namespace, route = self._route()
            if route is None:
                return False
            meta = route.get("metadata", {})
            current = int((meta.get("annotations") or {}).get(FENCE_ANNOTATION, 0))
            if fence < current:
                raise fence_refused(what, fence, current)
            if rules is None and current == fence:
                return True
            patch = {"metadata": {"resourceVersion": meta["resourceVersion"],
                                  "annotations": {FENCE_ANNOTATION: str(fence)}}}
            if rules is not None:
                patch["spec"] = {"rules": rules}
            try:
                before_change(what)
                self.read_command(self._kubectl("patch", "httproute", naming.GATEWAY, "-n", namespace,
                                                "--type=merge", "-p", json.dumps(patch, sort_keys=True)))
                return True
            except subprocess.CalledProcessError as exc:
                if "(Conflict)" not in (exc.stderr or ""):
                    raise ReleaseError(f"cannot change the route of {namespace} (context {self.kube.context}): "
                                       f"{(exc.stderr or '').strip()}. Fix: check kubectl's access to that "
                                       "cluster") from None
                # changed since it was read (by the gateway's status, or by another holder): read again
        raise ReleaseError(f"the route of {namespace} kept changing under {what}; nothing was changed by it. Fix: "
                           "run the command again")

    def raise_fence(self, fence: int) -> None:
        self.stack  # noqa: B018 - a missing Pulumi CLI is said before anything else is tried
        if self.store.revisions():
            self._swap_route(fence, f"fence {fence}")

    # --- the Cluster interface ------------------------------------------------------------------------

    def apply(self, revision: int, step: Step, fence: int) -> None:
        tracks = self._intended()
        if revision not in tracks:
            raise ValueError(f"revision {revision} is not among the recorded tracks {tracks}: record it first")
        self._swap_route(fence, f"apply {step.name} r{revision}")
        self._up(step_targets(self._program_run(tracks), step, revision), f"apply {step.name} r{revision}")

    def ready(self, revision: int, step: Step) -> bool:
        ns = self._namespace(revision)
        return all(self.run_command(self._kubectl(*wait_command(w, ns))) == 0 for w in step.waits_for)

    def deployed(self, revision: int) -> bool:
        # A retired track's namespace goes with it (a full `up` deletes the track's resources).
        return self.run_command(self._kubectl("get", "namespace", self._namespace(revision))) == 0

    def healthy(self, revision: int) -> bool:
        ns = self._namespace(revision)
        waits = ["Deployment/router condition=Available", "LeaderWorkerSet/engine-prefill condition=Available"]
        spec = self.store.get(revision).stack_spec()
        if spec.deployment.mode == "disaggregated":
            waits.append("LeaderWorkerSet/engine-decode condition=Available")
        return self.deployed(revision) and all(self.run_command(self._kubectl(*wait_command(w, ns))) == 0
                                               for w in waits)

    def set_traffic(self, weights: dict[int, int], fence: int) -> None:
        weights, tracks = check_weights(weights), self._intended()
        if {r: w for r, w in tracks.items() if w} != weights:
            raise ValueError(f"traffic {weights} is not what the release store records ({tracks}): record it first")
        missing = sorted(r for r in weights if not self.deployed(r))
        if missing:
            raise ValueError(f"cannot route to revision(s) {missing}: not deployed")
        (route,) = [r for r in self._program_run(tracks).custom() if r.name == ROUTE_RESOURCE]
        if not self._swap_route(fence, f"traffic {weights}", rules=route.inputs["spec"]["rules"]):
            # The environment's first rollout: no route yet. Pulumi creates it from the recorded
            # tracks, then it carries this fence like every later change.
            self._up([route.urn], f"create the route for {weights}")
            self._swap_route(fence, f"fence {fence}")

    def traffic(self) -> dict[int, int]:
        self.stack  # noqa: B018 - a missing Pulumi CLI is said before anything else is tried
        if not self.store.revisions():
            return {}
        namespace, route = self._route()
        return {} if route is None else traffic_from_route(route, namespace)

    def retire(self, revision: int, fence: int) -> None:
        if self.traffic().get(revision):
            raise ValueError(f"revision {revision} still takes traffic")
        if revision in self._intended():
            raise ValueError(f"revision {revision} is still among the recorded tracks: record its removal first")
        self._swap_route(fence, f"retire r{revision}")
        self._up(None, f"retire r{revision}")  # a full update deletes the track's resources
