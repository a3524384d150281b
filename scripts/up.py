"""`make up` / `make down`: the platform stack and dev's serving stack applied by the real Pulumi
engine onto the cluster twin (or a cluster a kubeconfig names), the serving stack reading the
platform's outputs through the real StackReference; then every pod bound and Ready, and one
request to the fleet's entry. `down` destroys both, in reverse order, and stops the twin.

    python -m scripts.up up   [--kubeconfig PATH --context NAME --inventory FILE] [--debug]
    python -m scripts.up down [--kubeconfig PATH --context NAME] [--keep-twin]

The cluster is taken as an existing on-prem one: the platform spec is dev's (its
`platform.spec`) with `cloud: none`, `nodes.mode: static` and its charts rendered from the pinned
Go modules, written with dev's spec pointing at it to .pdstack/up/ (project paths: the serving
program reads its platform spec by one, infra/program.py platform_link). On the twin, dev's
GPU nodes are made as an operator's kubeadm nodes come (twin/onprem.py) and the inventory names
them; elsewhere `--inventory` names the cluster's own GPU nodes.

State: a file backend beside what it describes. On the twin, in its run folder, which a fresh
start of the twin empties with its cluster, so state and cluster never disagree; checkpoints
are skipped there (PULUMI_SKIP_CHECKPOINTS: the platform's CRD schemas made each step's
checkpoint two thirds of the run). On another cluster, under .pdstack/up/clusters/<context>/,
checkpoints on. The stacks' secrets are encrypted with a passphrase: the caller's
PULUMI_CONFIG_PASSPHRASE(_FILE) if set, else a random one in a 0600 file beside the state,
handed to the CLI as PULUMI_CONFIG_PASSPHRASE_FILE (never in argv, a log or the output).

Crash safety: `up` and `down` hold an flock on the state folder for their whole run, so a
Pulumi lock found while holding it is a killed run's; it is dropped (`pulumi cancel`, which on a
file backend deletes the stack's lock files: pkg/backend/diy/backend.go CancelCurrentUpdate at
v3.274.1), and a state with pending operations is refreshed with `--clear-pending-creates`
before the next change (pulumi v3.274.1 keeps a pending create across `up`s:
pkg/backend/journal.go "we don't want to clear pending CREATE operations"). On the twin a killed
run's state is the one before it (no checkpoints), so the next `up` or `down` first runs one
`up` that takes over, by forced server-side apply, the objects that run made (change); a twin
stopped by `down` takes every object with it anyway. A run that fails, rather than being killed,
leaves its state as it ended. A SIGKILL of `up`'s process group leaves Pulumi's provider
plugins running (each is a process group of its own): they hold nothing the next run needs.

What stands in: pulumi-random's provider is engine/provider-standins' (its module is not served;
README, "The real Pulumi engine"); kwok runs the pods; the platform's rows the twin cannot
install are `controllers.user_installed` (USER_INSTALLED).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from infra.spec import REPO_ROOT, StackSpec, stack_spec_path

ENGINE_PATH = REPO_ROOT / ".engine" / "path"
RANDOM_STAND_IN = REPO_ROOT / "engine" / "provider-standins"  # pulumi-resource-random (see the docstring)
SPECS_DIR = Path(".pdstack") / "up"  # relative to the project: a serving spec names its platform spec so
PLATFORM_STACK = "platform-onprem"
# Rows of the catalog the twin provides or that no pinned module carries (tests/test_platform.py
# test_charts_from_pinned_modules_refuse_a_row_whose_chart_no_module_carries): lws runs on the
# twin for real; KEDA's, the DRA driver's and the EFA plugin's charts are in no module.
USER_INSTALLED = ["lws", "keda", "nvidia-dra-driver-gpu", "aws-efa-k8s-device-plugin"]
READY_WITHIN_SECONDS = 600
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"  # a deadline, not a measurement: a busy machine only waits longer


class UpError(RuntimeError):
    """What stops `up` or `down`, said with its fix."""


# --- the specs: dev's, and its cluster as an existing one -------------------------------------

@dataclass(frozen=True)
class StackFiles:
    serving: Path  # dev's spec, its `platform` naming the on-prem platform stack and spec
    platform: Path
    inventory: Path


def onprem_platform_spec(serving: StackSpec, environment_spec: str, inventory: str, stack: str = PLATFORM_STACK):
    """The serving spec's platform spec as an existing cluster's: `cloud: none`, static nodes named
    in `inventory`, charts from the pinned modules, USER_INSTALLED left to the cluster."""
    from infra.platform_stack.spec import HostedEnvironment, OnPremSpec, load_platform_spec

    spec = load_platform_spec(REPO_ROOT / serving.platform.spec)
    return spec.model_copy(update={
        "name": stack, "cloud": OnPremSpec(),
        "environments": [HostedEnvironment(spec=environment_spec, stack=serving.environment.name, inventory=inventory)],
        "nodes": spec.nodes.model_copy(update={"mode": "static"}),
        "controllers": spec.controllers.model_copy(update={"chart_source": "pinned-modules",
                                                           "user_installed": USER_INSTALLED})})


def write_stack_files(stack: str, inventory_file: Path | None, hosts: list | None) -> StackFiles:
    """dev's spec pointing at its on-prem platform, that platform spec, and the inventory (the
    given file, or one written for `hosts`), in .pdstack/up/. Written whole and renamed, so a
    run killed here, or another run beside it, never reads half a file."""
    from infra.platform_stack.spec import PlatformSpecError
    from infra.spec import PlatformRef
    from infra.spec_checks import load_spec
    from twin.onprem import inventory

    folder = REPO_ROOT / SPECS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    serving = load_spec(stack_spec_path(stack))
    if serving.platform is None:
        raise UpError(f"{stack_spec_path(stack)}: no `platform:`, so no platform spec to take the cluster's from. "
                      "Fix: name the stack's platform stack and spec (stacks/dev.yaml has one)")
    files = StackFiles(serving=SPECS_DIR / f"{stack}.yaml", platform=SPECS_DIR / f"{PLATFORM_STACK}.yaml",
                       inventory=SPECS_DIR / f"inventory-{stack}.yaml")
    if inventory_file is None:
        _write(files.inventory, inventory(hosts).model_dump(mode="json", exclude_none=True))
    else:
        files = StackFiles(files.serving, files.platform, Path(os.path.relpath(inventory_file.resolve(), REPO_ROOT)))
    try:
        platform = onprem_platform_spec(serving, str(files.serving), str(files.inventory))
    except PlatformSpecError as exc:
        raise UpError(str(exc)) from None
    linked = serving.model_copy(update={"platform": PlatformRef(stack=PLATFORM_STACK, spec=str(files.platform))})
    _write(files.platform, platform.model_dump(mode="json", exclude_none=True))
    _write(files.serving, linked.model_dump(mode="json"))
    return files


def _write(relative: Path, data: dict) -> None:
    path = REPO_ROOT / relative
    part = path.with_name(f".{path.name}.{os.getpid()}")
    part.write_text("# written by `make up` (scripts/up.py); edit the specs in stacks/ instead\n"
                    + yaml.safe_dump(data, sort_keys=False))
    part.replace(path)


# --- the cluster and the engine's environment -------------------------------------------------

@dataclass(frozen=True)
class Target:
    kubeconfig: Path
    context: str
    folder: Path  # the stacks' state, their passphrase, the project's copy, the Pulumi log
    on_twin: bool


def twin_target() -> Target:
    from twin.paths import CONTEXT, KUBECONFIG, RUN_DIR

    return Target(KUBECONFIG, CONTEXT, RUN_DIR / "stacks", on_twin=True)


def cluster_target(kubeconfig: Path, context: str) -> Target:
    if not kubeconfig.is_file():
        raise UpError(f"--kubeconfig {kubeconfig}: no such file. Fix: the kubeconfig of the cluster to deploy to")
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", context)[:100]
    return Target(kubeconfig.resolve(), context, REPO_ROOT / ".pdstack" / "up" / "clusters" / safe, on_twin=False)


def require_engine() -> None:
    missing = [b for b in ("pulumi", "pulumi-resource-kubernetes") if not (ENGINE_PATH / b).exists()]
    if missing:
        raise UpError(f"no Pulumi engine build ({', '.join(missing)} missing in {ENGINE_PATH}). Fix: make engine")


def passphrase_file(folder: Path) -> Path:
    """A random passphrase for the stacks' secrets, made once, readable by its owner only."""
    path = folder / "passphrase"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(32))
    return path


def engine_environment(target: Target) -> dict[str, str]:
    """What the Pulumi CLI runs with: the engine `make engine` built first on PATH (its plugins
    beside it, nothing downloaded), this target's file backend and home, and the passphrase."""
    env = {
        "PATH": os.pathsep.join([str(ENGINE_PATH), str(RANDOM_STAND_IN), os.environ.get("PATH", "")]),
        "PULUMI_HOME": str(target.folder / "pulumi-home"),
        "PULUMI_BACKEND_URL": f"file://{target.folder / 'state'}",
        "PULUMI_SKIP_UPDATE_CHECK": "true",
        "PULUMI_DISABLE_AUTOMATIC_PLUGIN_ACQUISITION": "true",
        "PDSTACK_PYTHON": sys.executable,  # the random stand-in's interpreter
    }
    if target.on_twin:
        env["PULUMI_SKIP_CHECKPOINTS"] = "true"
    if not (os.environ.get("PULUMI_CONFIG_PASSPHRASE") or os.environ.get("PULUMI_CONFIG_PASSPHRASE_FILE")):
        env["PULUMI_CONFIG_PASSPHRASE_FILE"] = str(passphrase_file(target.folder))
    return env


@contextlib.contextmanager
def holding(target: Target):
    """The state folder's flock, for the whole run, and the engine's environment meanwhile."""
    folder = target.folder
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    (folder / "state").mkdir(exist_ok=True)
    fd = os.open(folder / "up.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UpError(f"another `up` or `down` is running on {folder}. Fix: wait for it, or stop it") from None
        saved = dict(os.environ)
        os.environ.update(engine_environment(target))
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(saved)
    finally:
        os.close(fd)


def project_folder(target: Target) -> Path:
    """A copy of the Pulumi project (Pulumi.yaml, and stacks/ for its `main`), so what the CLI
    writes beside it (each stack's settings, the passphrase's salt) never touches the checkout."""
    work = target.folder / "project"
    work.mkdir(exist_ok=True)
    (work / "Pulumi.yaml").write_text((REPO_ROOT / "Pulumi.yaml").read_text())
    if not (work / "stacks").exists():
        (work / "stacks").symlink_to(REPO_ROOT / "stacks")
    return work


def open_stack(target: Target, name: str, spec_file: Path, program):
    """The stack (created if new) running `program` inline, configured for the target's cluster."""
    from pulumi import automation as auto

    from infra.rollout.pulumi_cluster import PROJECT

    stack = auto.create_or_select_stack(stack_name=name, project_name=PROJECT, program=program,
                                        opts=auto.LocalWorkspaceOptions(work_dir=str(project_folder(target))))
    stack.set_all_config({"pdstack:specFile": auto.ConfigValue(str(REPO_ROOT / spec_file)),
                          "kubernetes:context": auto.ConfigValue(target.context),
                          "kubernetes:kubeconfig": auto.ConfigValue(str(target.kubeconfig))})
    return stack


def recover(stack, target: Target, log) -> bool:
    """What a killed run left: its Pulumi lock (a killed run's: our flock is held), dropped, and
    pending operations, cleared by a refresh. True if a killed run's lock was there, now or at
    an earlier recovery whose run did not end well. A run that failed instead leaves no lock,
    and its state as it ended (written at the end, checkpoints off or on)."""
    from infra.rollout.pulumi_cluster import PROJECT

    # The file backend's locks: pkg/backend/diy/backend.go stackLockDir at v3.274.1.
    locks = target.folder / "state" / ".pulumi" / "locks" / "organization" / PROJECT / stack.name
    killed = _killed_marker(target, stack.name)  # kept until a run after it ends well (change)
    if locks.is_dir() and any(locks.iterdir()):
        killed.touch()
    stack.cancel()
    pending = stack.export_stack().deployment.get("pending_operations") or []
    if pending:
        log(f"{stack.name}: {len(pending)} operation(s) a killed run left pending; refreshing from the cluster")
        stack.refresh(clear_pending_creates=True, on_output=lambda line: None, color="never")
    return killed.exists()


def _killed_marker(target: Target, name: str) -> Path:
    return target.folder / f"killed-{name}"


def change(stack, target: Target, killed: bool, on_output, log=print, destroy: bool = False) -> None:
    """`pulumi up` (or destroy) of the stack. After a killed run on the twin, whose runs skip
    checkpoints, the state may lack objects that run made: each carries the field manager of the lost state's resource, so the new run's
    server-side apply meets them as another manager's ("Server-Side Apply field conflict", seen on
    cert-manager's webhook configurations). They are this stack's own, so that one run forces
    the conflicts (PULUMI_K8S_ENABLE_PATCH_FORCE: pulumi-kubernetes pkg/await/await.go patchForce);
    every other run keeps the provider's default, so a conflict with another manager still shows."""
    from pulumi.automation import CommandError

    forced = killed and target.on_twin
    if forced:
        os.environ["PULUMI_K8S_ENABLE_PATCH_FORCE"] = "true"
    try:
        if not destroy:
            stack.up(on_output=on_output, color="never")
        elif forced:  # a destroy first records what the lost state lacks, if it can
            try:
                stack.up(on_output=on_output, color="never")
            except CommandError as exc:
                log(f"{stack.name}: the catching-up `up` failed, so objects the killed run made may stay; "
                          f"destroying what the state holds ({str(exc).strip().splitlines()[-1][:200]})")
    finally:
        os.environ.pop("PULUMI_K8S_ENABLE_PATCH_FORCE", None)
    if destroy:
        stack.destroy(on_output=on_output, color="never")
    _killed_marker(target, stack.name).unlink(missing_ok=True)


def stack_programs(target: Target, stack: str) -> dict:
    """Stack name -> the program `up` runs for it (the same for `down`'s catching up). The serving
    program reads its tracks from a release store of the target's, empty before any rollout."""
    from infra.program import main
    from infra.rollout.releases import ReleaseStore
    from infra.spec_checks import load_spec

    def serving() -> None:
        main(store=ReleaseStore(load_spec(stack_spec_path(stack)).environment.name, target.folder / "releases"))

    return {PLATFORM_STACK: main, stack: serving}


# --- the cluster's objects --------------------------------------------------------------------

def kubectl(target: Target, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    from twin.build import program

    binary = program("kubectl")
    argv = [str(binary if binary.exists() else "kubectl"), f"--kubeconfig={target.kubeconfig}",
            f"--context={target.context}", *args]
    done = subprocess.run(argv, input=input, capture_output=True, text=True)
    if check and done.returncode:
        raise UpError(f"kubectl {' '.join(args[:3])}: {done.stderr.strip() or done.stdout.strip()}")
    return done


def get(target: Target, kind: str, *args: str) -> list[dict]:
    return json.loads(kubectl(target, "get", kind, "-o", "json", *args).stdout)["items"]


def operators_nodes(target: Target, spec: StackSpec) -> list:
    """On the twin: dev's GPU and system nodes as kubeadm gives them to the operator, made if
    missing (a node there is left as it is: the platform's patch owns its role and taints), and
    the inventory's hosts naming them."""
    from twin.nodes import stack_nodes
    from twin.onprem import as_the_operator_has_them

    bare, hosts = as_the_operator_has_them(spec, stack_nodes(spec))
    there = {n["metadata"]["name"] for n in get(target, "nodes")}
    missing = [n for n in bare if n["metadata"]["name"] not in there]
    if missing:
        kubectl(target, "create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": missing}))
    return hosts


def user_objects(spec: StackSpec) -> dict:
    """What the user makes before the first `up` (README, "Objects that stay the user's"): the
    environment's namespace and the weights credentials Secret (`access: secret`), here with the
    twin's values, no real key. A List, as `kubectl apply -f -` reads it."""
    namespace = spec.environment.namespace
    return {"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": spec.model.weights.credentials_secret,
                                                            "namespace": namespace},
         "stringData": {"AWS_ACCESS_KEY_ID": "twin", "AWS_SECRET_ACCESS_KEY": "twin"}}]}


def users_objects(target: Target, spec: StackSpec) -> None:
    kubectl(target, "apply", "--server-side", "--field-manager=pdstack-user", "-f", "-",
            input=json.dumps(user_objects(spec)))


def _ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))


def not_ready(target: Target, namespace: str, ready: bool = True) -> list[str]:
    """Why the namespace is not serving yet, one line per object or pod; empty once every
    LeaderWorkerSet's and Deployment's replicas are ready and every pod is bound and Ready
    (`ready` False: once every pod there is bound)."""
    problems = []
    pods = get(target, "pods", "-n", namespace)
    sets = get(target, "leaderworkersets", "-n", namespace)
    if not ready:
        want = sum(s["spec"].get("replicas", 1) * s["spec"]["leaderWorkerTemplate"].get("size", 1) for s in sets)
        made = sum(LWS_NAME_LABEL in p["metadata"].get("labels", {}) for p in pods)
        return [f"pod {p['metadata']['name']}: not bound" for p in pods if not p["spec"].get("nodeName")] \
            + ([f"{made}/{want} LeaderWorkerSet pods made"] if made < want else [])
    for lws in sets:
        want, ready = lws["spec"].get("replicas", 1), lws.get("status", {}).get("readyReplicas", 0)
        if ready < want:
            problems.append(f"LeaderWorkerSet {lws['metadata']['name']}: {ready}/{want} groups ready")
    for deployment in get(target, "deployments", "-n", namespace):
        want, ready = deployment["spec"].get("replicas", 1), deployment.get("status", {}).get("readyReplicas", 0)
        if ready < want:
            problems.append(f"Deployment {deployment['metadata']['name']}: {ready}/{want} ready")
    for pod in pods:
        name = pod["metadata"]["name"]
        if not pod["spec"].get("nodeName"):
            events = get(target, "events", "-n", namespace, f"--field-selector=involvedObject.name={name}")
            said = "; ".join(f"{e.get('reason')}: {e.get('message', '').strip()}" for e in events[-2:])
            problems.append(f"pod {name}: not bound ({said or 'no scheduler event yet'})")
        elif not _ready(pod):
            waiting = [f"{s['name']}: {s['state']['waiting'].get('reason')}"
                       for s in pod.get("status", {}).get("containerStatuses", []) if "waiting" in s.get("state", {})]
            problems.append(f"pod {name} on {pod['spec']['nodeName']}: not Ready ({'; '.join(waiting) or 'starting'})")
    return problems


def wait_serving(target: Target, namespace: str, status, ready: bool = True) -> list[dict]:
    """Every pod bound (and, if `ready`, everything Ready: not_ready), or UpError naming what is not."""
    deadline = time.monotonic() + READY_WITHIN_SECONDS
    while problems := not_ready(target, namespace, ready):
        if time.monotonic() > deadline:
            raise UpError(f"{namespace} not ready within {READY_WITHIN_SECONDS} s:\n  " + "\n  ".join(problems))
        status(f"waiting: {problems[0]} (and {len(problems) - 1} more)" if len(problems) > 1 else f"waiting: {problems[0]}")
        time.sleep(2)
    return get(target, "pods", "-n", namespace)


# --- up and down ------------------------------------------------------------------------------

class Progress:
    """Each step on a line of its own with its time, and the running step's latest word on a
    spinner (rich; a plain line per step where the output is no terminal)."""

    def __init__(self, console=None):
        from rich.console import Console

        self.console = console or Console()
        self._status = None

    def log(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def status(self, line: str) -> None:
        if self._status is not None:
            self._status.update(line[:150])

    @contextlib.contextmanager
    def step(self, what: str):
        started = time.monotonic()
        with self.console.status(what) as self._status:
            try:
                yield
            finally:
                self._status = None
        self.log(f"done: {what} ({time.monotonic() - started:.0f} s)")


@dataclass
class Deployed:
    platform_outputs: dict
    serving_outputs: dict
    platform_resources: list[dict]  # each stack's state, as `pulumi stack export` has it
    serving_resources: list[dict]
    pods: list[dict]
    answer: str | None  # the entry's answer to one request; None when none was sent
    why_no_request: str | None = None


def up(target: Target | None = None, stack: str = "dev", inventory_file: Path | None = None,
       progress: Progress | None = None) -> Deployed:
    """Build what is missing, start the twin (or reuse it; `target` None) or use the given cluster,
    `pulumi up` the platform stack and then the serving stack, wait until it serves, and send
    one request to its entry."""
    from infra.spec_checks import load_spec
    from twin import cluster

    progress = progress or Progress()
    require_engine()
    if target is None:
        with progress.step("the cluster twin: built and started (or the running one)"):
            cluster.up(log=progress.status)
        target = twin_target()
    elif inventory_file is None:
        raise UpError("--inventory: on a cluster of your own, the platform stack labels and taints the GPU nodes an "
                      "inventory names. Fix: --inventory stacks/inventory/dev.yaml, its hosts your nodes' names")
    spec = load_spec(stack_spec_path(stack))
    hosts = None
    if target.on_twin:
        hosts = operators_nodes(target, spec)
        users_objects(target, spec)
    files = write_stack_files(stack, inventory_file, hosts)
    out = target.folder / "pulumi.log"
    with holding(target), out.open("a") as pulumi_log:
        def shown(line: str) -> None:
            pulumi_log.write(line if line.endswith("\n") else line + "\n")
            if line.strip():
                progress.status(line.strip())

        progress.log(f"the stacks' state: {target.folder / 'state'}; Pulumi's output: {out}")
        programs = stack_programs(target, stack)
        platform = open_stack(target, PLATFORM_STACK, files.platform, programs[PLATFORM_STACK])
        with progress.step(f"pulumi up {PLATFORM_STACK} (cloud: none, on {target.context})"):
            change(platform, target, recover(platform, target, progress.log), shown)
        serving = open_stack(target, stack, files.serving, programs[stack])
        with progress.step(f"pulumi up {stack} (its StackReference reads {PLATFORM_STACK})"):
            change(serving, target, recover(serving, target, progress.log), shown)
        platform_outputs = {k: v.value for k, v in platform.outputs().items()}
        serving_outputs = {k: v.value for k, v in serving.outputs().items() if not v.secret}
        states = [s.export_stack().deployment["resources"] for s in (platform, serving)]
    namespace = spec.environment.namespace
    with progress.step(f"every pod of {namespace} bound"):
        wait_serving(target, namespace, progress.status, ready=False)
    processes, why_not = start_processes(target, namespace)
    try:
        with progress.step(f"every pod of {namespace} Ready"):
            pods = wait_serving(target, namespace, progress.status)
        deployed = Deployed(platform_outputs, serving_outputs, *states, pods, answer=None, why_no_request=why_not)
        progress.log(f"{stack}: {len(pods)} pods bound and Ready in {namespace}; entry {serving_outputs.get('endpoint')}")
        if processes is not None:
            from twin import pods as pod_processes

            with progress.step(f"one request to {namespace}'s router"):
                answer = pod_processes.send_request(namespace, kubeconfig=target.kubeconfig, folder=processes.folder,
                                                    check=processes.check)
            deployed.answer = answer["choices"][0]["message"]["content"]
            progress.log(f"the fleet answered: {deployed.answer}")
        else:
            progress.log(f"no request sent: {why_not}")
    finally:
        if processes is not None:
            processes.stop()  # they would die with this process anyway (parent-death signal)
    return deployed


def start_processes(target: Target, namespace: str):
    """On the twin, the router and engine pods started as processes at their pod addresses
    (twin/pods.py), and None; elsewhere None and why no request is sent."""
    if not target.on_twin:
        return None, (f"on a cluster of your own the entry is the gateway's: send a request there with an API key "
                      f"(`pulumi stack output api_keys --show-secrets` in {target.folder / 'project'})")
    from twin import pods

    return pods.start_processes(namespace, kubeconfig=target.kubeconfig), None


def down(target: Target | None = None, stack: str = "dev", stop_twin: bool = True,
         progress: Progress | None = None) -> None:
    """`pulumi destroy` of the serving stack and then of the platform stack, and the twin stopped
    (unless `stop_twin` is False), which takes the nodes `up` made with it: like a cluster's own
    nodes, they outlive the platform stack, which leaves them as it found them. Works after a
    killed `up` (recover); on the twin, whose runs skip checkpoints, a stack a killed run was
    changing is brought up first, so that its state holds every object before the destroy.
    With no twin running there is nothing left to destroy."""
    from pulumi import automation as auto

    from infra.rollout.pulumi_cluster import PROJECT
    from twin import cluster

    progress = progress or Progress()
    if target is None:
        if not cluster.running():
            progress.log("the twin is not running: its cluster is gone, and the stacks' state with it at its next start")
            return
        target = twin_target()
    if (target.folder / "state").is_dir():
        require_engine()
        programs = stack_programs(target, stack)
        with holding(target):
            for name in (stack, PLATFORM_STACK):
                try:
                    found = auto.select_stack(stack_name=name, project_name=PROJECT, program=programs[name],
                                              opts=auto.LocalWorkspaceOptions(work_dir=str(project_folder(target))))
                except auto.StackNotFoundError:
                    continue
                with progress.step(f"pulumi destroy {name}"):
                    killed = recover(found, target, progress.log)
                    if killed and target.on_twin:
                        progress.log(f"{name}: a killed run may have made objects its state lacks (no checkpoints on "
                                     "the twin); `pulumi up` records them before the destroy")
                    change(found, target, killed, lambda line: progress.status(line.strip()), progress.log,
                           destroy=True)
                    found.workspace.remove_stack(name)
    if target.on_twin and stop_twin:
        cluster.down(log=progress.log)


# --- the command --------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.up", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("up", "down"))
    parser.add_argument("--stack", default="dev", help="the serving stack (its spec in stacks/)")
    parser.add_argument("--kubeconfig", type=Path, help="a cluster of your own (kind, kubeadm) instead of the twin")
    parser.add_argument("--context", help="the kubeconfig's context to use (with --kubeconfig)")
    parser.add_argument("--inventory", type=Path, help="up, with --kubeconfig: the inventory naming your GPU nodes")
    parser.add_argument("--keep-twin", action="store_true", help="down: leave the twin running")
    parser.add_argument("--debug", action="store_true", help="a traceback on failure")
    args = parser.parse_args(argv)
    from pulumi import automation as auto

    from infra.inputs import InputError
    from twin.api import TwinError

    progress = Progress()
    try:
        target = None
        if args.kubeconfig or args.context:
            if not (args.kubeconfig and args.context):
                raise UpError("--kubeconfig and --context go together. Fix: give both, or neither for the twin")
            target = cluster_target(args.kubeconfig, args.context)
        if args.command == "up":
            up(target, args.stack, args.inventory, progress)
        else:
            down(target, args.stack, not args.keep_twin, progress)
    except KeyboardInterrupt:
        progress.log(f"interrupted: `make {args.command}` again goes on from where the stacks' state says")
        return 130
    except (UpError, TwinError, InputError, auto.CommandError, OSError, ValueError) as exc:
        if args.debug:
            raise
        text = str(exc).strip().splitlines()
        progress.log(f"{args.command}: " + "\n".join(text[-30:]))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
