"""The real Pulumi engine against the twin (or against nothing): the CLI and the Kubernetes provider
that `make engine` builds from the Go modules pinned in engine/ (scripts/build_engine.py), a local
file backend and a throwaway copy of the project in a folder of the caller's. The tests use it
through tests/engine.py (which skips where the engine is not built); scripts/bench_rollback.py
--twin and twin/live.py directly, so that no test module is needed to drive a rollout.

What is real and what stands in (README, "The real Pulumi engine"):
- the `pulumi` CLI v3.274.1 and `pulumi-resource-kubernetes`: real, built from the modules;
- the language runtime: the Python SDK's own (pulumi.automation's in-process server, from the
  pinned wheel), which the CLI is pointed at; the `pulumi-language-python` plugin's module is
  not served by the module proxy;
- the policy pack: pulumi-policy's analyzer, started as an executable pack (policy/run-pack),
  which the CLI runs without the language plugin;
- pulumi-random: engine/provider-standins' stand-in (its module is not served either).

The cluster: a kubeconfig whose `pdstack-<env>` context (what Pulumi.<env>.yaml names) points at
the cluster twin or else at a closed port on 127.0.0.1, where the provider can only preview or
render YAML.
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import yaml

from infra.spec import REPO_ROOT, stack_spec_path

ENGINE_PATH = REPO_ROOT / ".engine" / "path"
STANDINS = REPO_ROOT / "engine" / "provider-standins"
# Encrypts the secrets of the throwaway stacks (file backend in a temp folder); not a real secret.
TEST_PASSPHRASE = "pdstack-tests-throwaway-passphrase"
BINARIES = ("pulumi", "pulumi-resource-kubernetes")


def missing_engine() -> str | None:
    """What is missing of the engine build, with the fix; None when it is there."""
    missing = [b for b in BINARIES if not (ENGINE_PATH / b).exists()]
    return f"no engine build ({', '.join(missing)} missing in {ENGINE_PATH}). Fix: make engine" if missing else None


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when this returns: nothing listens there


def write_kubeconfig(path: Path, context: str, twin: Path | None) -> Path:
    """A kubeconfig whose `context` reaches the twin (its current context, renamed), or nothing."""
    if twin is not None:
        config = yaml.safe_load(twin.read_text())
        current = next(c for c in config["contexts"] if c["name"] == config["current-context"])
        current["name"] = config["current-context"] = context
        config["contexts"] = [current]
    else:
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": context,
            "clusters": [{"name": "nowhere", "cluster": {"server": f"https://127.0.0.1:{_closed_port()}",
                                                         "insecure-skip-tls-verify": True}}],
            "users": [{"name": "nobody", "user": {"token": "not-a-token"}}],
            "contexts": [{"name": context, "context": {"cluster": "nowhere", "user": "nobody"}}],
        }
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass
class EngineProject:
    """A copy of the Pulumi project (Pulumi.yaml and one stack's settings) in a temp folder, so
    what the CLI writes there (the passphrase's salt, config) never touches the checkout."""

    work_dir: Path
    stack: str
    kubeconfig: Path
    spec_file: Path  # the stack's spec as deployed here: its placeholder images pinned (deployable_spec_file)
    environment: dict[str, str]  # what the CLI and its plugins need set (project_environment)

    def render_yaml_to(self, folder: Path) -> None:
        """The provider writes each object to `folder` instead of sending it (it takes no
        kubeconfig context then)."""
        settings_file = self.work_dir / f"Pulumi.{self.stack}.yaml"
        settings = yaml.safe_load(settings_file.read_text())
        settings["config"].pop("kubernetes:context", None)
        settings["config"]["kubernetes:renderYamlToDirectory"] = str(folder)
        settings_file.write_text(yaml.safe_dump(settings))


def stand_in_pins(spec):
    """`spec` with each marked placeholder pinned to a stand-in digest (the sha256 of its reference),
    for judging a deployable spec offline (the policy pack's rules, the real engine rendering to
    files, the twin): nothing pulls these images. Its platform entries move with it."""
    from infra.images import placeholders

    data = spec.model_dump(mode="json")
    for field, ref in placeholders(spec).items():
        *parents, leaf = field.split(".")
        node = data
        for key in parents:
            node = node[key]
        digest = "sha256:" + hashlib.sha256(ref.encode()).hexdigest()
        node[leaf] = f"{ref}@{digest}"
        platforms = data["images"].get("platforms")
        if platforms and ref in platforms:
            platforms[digest] = platforms.pop(ref)
    return type(spec).model_validate(data)


def deployable_spec_file(stack: str, folder: Path, engine: str | None = None) -> Path:
    """The committed spec with its placeholder images pinned to stand-in digests (stand_in_pins),
    written to `folder`: the policy pack refuses a placeholder, as it must at a real `pulumi up`,
    and nothing here pulls an image. `engine`: switched to that engine as `render --engine`
    switches it."""
    from infra.spec_checks import load_spec, switch_engine

    spec = load_spec(stack_spec_path(stack))
    if engine is not None:
        spec = switch_engine(spec, engine)[0]
    path = folder / f"{stack}-deployable.yaml"
    path.write_text(yaml.safe_dump(stand_in_pins(spec).model_dump(mode="json")))
    return path


def engine_project(folder: Path, stack: str = "dev", twin: Path | None = None,
                   engine: str | None = None) -> EngineProject:
    """The project's files in `folder` (project/, state/, the kubeconfig, the deployable spec) and
    the environment the CLI and its plugins need (found on PATH only, nothing downloaded); set
    it (`environment`) before running the engine."""
    work_dir = folder / "project"
    work_dir.mkdir()
    (work_dir / "Pulumi.yaml").write_text((REPO_ROOT / "Pulumi.yaml").read_text())
    (work_dir / "stacks").symlink_to(REPO_ROOT / "stacks")  # Pulumi.yaml's main: the CLI checks it exists
    settings = yaml.safe_load((REPO_ROOT / f"Pulumi.{stack}.yaml").read_text())
    spec_file = deployable_spec_file(stack, folder, engine)
    settings["config"]["pdstack:specFile"] = str(spec_file)
    (work_dir / f"Pulumi.{stack}.yaml").write_text(yaml.safe_dump(settings))
    kubeconfig = write_kubeconfig(folder / "kubeconfig", settings["config"]["kubernetes:context"], twin)
    (folder / "state").mkdir()
    values = {
        "PATH": os.pathsep.join([str(ENGINE_PATH), str(STANDINS), os.environ["PATH"]]),
        "PULUMI_HOME": str(folder / "pulumi-home"),  # plugin cache, credentials: none of the user's
        "PULUMI_BACKEND_URL": f"file://{folder / 'state'}",
        "PULUMI_CONFIG_PASSPHRASE": TEST_PASSPHRASE,
        "PULUMI_SKIP_UPDATE_CHECK": "true",
        "PULUMI_DISABLE_AUTOMATIC_PLUGIN_ACQUISITION": "true",  # nothing is downloaded, ever
        "KUBECONFIG": str(kubeconfig),
        "PDSTACK_PYTHON": sys.executable,  # the random stand-in's interpreter (grpc, pulumi)
    }
    return EngineProject(work_dir, stack, kubeconfig, spec_file, values)


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """os.environ with `values` set for the block (the engine's CLI and the in-process automation
    API read it), as it was afterwards."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def program_stack(project: EngineProject, program):
    """The project's stack (created if new) running `program` inline: `pulumi stack init/select`."""
    from pulumi import automation as auto

    from infra.rollout.pulumi_cluster import PROJECT

    return auto.create_or_select_stack(stack_name=project.stack, project_name=PROJECT, program=program,
                                       opts=auto.LocalWorkspaceOptions(work_dir=str(project.work_dir)))


def serving_program(folder: Path, stack: str = "dev"):
    """The program Pulumi.yaml runs, reading its tracks from an empty release store in `folder`."""
    from infra.program import main
    from infra.rollout.releases import ReleaseStore

    store = ReleaseStore(stack, folder / "releases")
    return lambda: main(store=store)


def platform_stand_in(project: EngineProject) -> None:
    """The platform stack the serving stack's StackReference reads (its spec's `platform.stack`),
    as a stack of the project's backend that exports what the real one would: the names from its
    platform spec (infra/platform_stack/program.py expected_outputs) and, as its cluster's
    kubeconfig, the project's (the twin's, or a closed port). The real platform program makes an
    EKS cluster, buckets and roles, which nothing here can create; the StackReference itself is
    the real engine's. The project's environment must be set."""
    import pulumi
    from pulumi import automation as auto

    from infra.platform_stack.program import expected_outputs
    from infra.platform_stack.spec import load_platform_spec
    from infra.rollout.pulumi_cluster import PROJECT
    from infra.spec_checks import load_spec

    spec = load_spec(stack_spec_path(project.stack))
    if spec.platform is None:
        return
    outputs = expected_outputs(load_platform_spec(REPO_ROOT / spec.platform.spec))
    outputs["kubeconfig"] = project.kubeconfig.read_text()

    def exports() -> None:
        for key, value in outputs.items():
            pulumi.export(key, pulumi.Output.secret(value) if key == "kubeconfig" else value)

    stack = auto.create_or_select_stack(stack_name=spec.platform.name(), project_name=PROJECT, program=exports,
                                        opts=auto.LocalWorkspaceOptions(work_dir=str(project.work_dir)))
    stack.set_config("pdstack:specFile", auto.ConfigValue(spec.platform.spec))  # Pulumi.yaml requires it
    stack.up(on_output=lambda line: None)
