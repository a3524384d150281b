"""The rendered fleet on a cluster: render it with pdctl, apply it with kubectl (server-side,
strict field validation), and read back where its pods landed. Works against the twin or any
cluster a kubeconfig names.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from infra.recording import SECRET_PLACEHOLDER
from twin.api import TwinError, kubectl
from twin.paths import KUBECONFIG

FIELD_MANAGER = "pdstack"


def render(stack: str, out: Path, engine: str | None = None) -> list[dict]:
    """`pdctl render` of a stack (the user's command), and the objects it wrote."""
    pdctl = Path(sys.executable).with_name("pdctl")
    argv = [str(pdctl), "render", "--stack", stack, "--out", str(out)] + (["--engine", engine] if engine else [])
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise TwinError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return read_rendered(out)


def read_rendered(out: Path) -> list[dict]:
    """The objects a render wrote into `out` (`pdctl render`, or infra.render.manifests.write_manifests),
    each Secret given a placeholder value."""
    objects = []
    for path in sorted(out.rglob("*.yaml")):
        objects += [d for d in yaml.safe_load_all(path.read_text()) if d and "kind" in d and "apiVersion" in d]
    return [with_placeholder_secrets(o) for o in objects]


def with_placeholder_secrets(obj: dict) -> dict:
    """A Secret as the cluster would get it, less its values: render never writes a secret
    (it writes SECRET_PLACEHOLDER where Pulumi holds one), so the twin is given one made-up key
    in its place. Everything else is applied exactly as rendered."""
    if obj["kind"] != "Secret":
        return obj
    made_up = {"stringData": {"twin-placeholder": "not-a-secret"},
               "data": {"twin-placeholder": base64.b64encode(b"not-a-secret").decode()}}
    return {**obj, **{field: value for field, value in made_up.items() if obj.get(field) == SECRET_PLACEHOLDER}}


def ident(obj: dict) -> str:
    meta = obj["metadata"]
    where = f"{meta['namespace']}/" if meta.get("namespace") else ""
    return f"{obj['kind']} {where}{meta['name']}"


@dataclass
class Applied:
    applied: list[str] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)  # object -> the API server's message


def apply_each_pass(objects: list[dict], kubeconfig: Path = KUBECONFIG, dry_run: bool = False) -> Applied:
    """Server-side apply with fieldValidation=Strict (kubectl --validate=strict): unknown or
    duplicate fields, schema and CEL violations and webhook denials are all rejections.
    Namespaces go first, so that what lives in them has somewhere to go."""
    result = Applied()
    first = [o for o in objects if o["kind"] == "Namespace"]
    rest = [o for o in objects if o["kind"] != "Namespace"]
    for batch in (first, rest):
        if batch:
            _apply_batch(batch, kubeconfig, dry_run, result)
    return result


def _apply_batch(batch: list[dict], kubeconfig: Path, dry_run: bool, result: Applied) -> None:
    """Apply `batch` in one kubectl call; if any object in it is refused, find which by halves.

    kubectl apply goes on past a refused object, but with `-o json` it prints the objects it
    applied only when none was refused (k8s.io/kubectl v0.34.4 pkg/cmd/apply/apply.go, Run: it
    returns the errors before PostProcessorFn, PrintAndPrunePostProcessor, prints the list), and
    its error names an object by kind and name at most (an admission webhook's denial names
    none). So a refused batch is split and each half applied again (server-side apply of what
    was applied is no change), down to single objects, whose refusal is theirs alone: the
    report names only the refused objects and counts every other one applied, in about
    2*log2(len(batch)) calls per refused object."""
    args = ["apply", "--server-side", f"--field-manager={FIELD_MANAGER}", "--force-conflicts",
            "--validate=strict", "-o", "json", "-f", "-"] + (["--dry-run=server"] if dry_run else [])
    done = kubectl(*args, kubeconfig_path=kubeconfig, input=yaml.safe_dump_all(batch), check=False)
    if done.returncode == 0:
        answered = json.loads(done.stdout) if done.stdout.strip() else {}
        items = answered.get("items", [answered] if answered.get("kind") else [])
        result.applied += sorted(ident(o) for o in items)
    elif len(batch) == 1:
        result.rejected[ident(batch[0])] = done.stderr.strip() or done.stdout.strip() or "refused, kubectl said nothing"
    else:
        half = len(batch) // 2
        for part in (batch[:half], batch[half:]):
            _apply_batch(part, kubeconfig, dry_run, result)


def get(kind: str, *args: str, kubeconfig: Path = KUBECONFIG) -> list[dict]:
    done = kubectl("get", kind, "-o", "json", *args, kubeconfig_path=kubeconfig)
    return json.loads(done.stdout)["items"]


def wait_for(what: str, check, timeout: float = 300, interval: float = 2.0, required: bool = False):
    """Poll check() until it returns something true; the last value otherwise (callers assert on it),
    or, if `required`, a TwinError naming `what`. A check that raises ends the wait with its error
    (e.g. a process it depends on exited)."""
    deadline = time.monotonic() + timeout
    value = check()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = check()
    if required and not value:
        raise TwinError(f"{what}: not within {timeout:.0f} s")
    return value


def scheduler_events(namespace: str, pod: str, kubeconfig: Path = KUBECONFIG) -> list[str]:
    """What the scheduler said about a pod (FailedScheduling and the like)."""
    items = get("events", "-n", namespace, f"--field-selector=involvedObject.name={pod}", kubeconfig=kubeconfig)
    return [f"{e.get('reason')}: {e.get('message', '').strip()}" for e in items]


def delete_namespaces(namespaces: list[str], kubeconfig: Path = KUBECONFIG) -> None:
    """Delete namespaces and wait until the namespace controller has removed them and their
    contents. The next test may create the same names: a namespace still Terminating refuses
    new objects ("namespaces ... not found" from the API server) and keeps the old route and
    its fence, which a fresh rollout then meets as another holder's."""
    if namespaces:
        kubectl("delete", "namespace", "--ignore-not-found", "--timeout=300s", *namespaces, kubeconfig_path=kubeconfig)


def users_objects(spec) -> None:
    """What the user makes before the first rollout (README, "Objects that stay the user's"): dev's
    weights credentials Secret (`access: secret`) in the environment's namespace, which each
    release track's Storage reads to copy into its own (the values are the twin's, no real key)."""
    from scripts.up import user_objects

    kubectl("apply", "-f", "-", input=json.dumps(user_objects(spec)))
