"""scripts/up.py (`make up` / `make down`) without a cluster: the specs it writes, its refusals,
its passphrase, and its recovery from a killed run with the real Pulumi engine (`make engine`).
The whole run on the twin is tests/twin/test_platform_on_twin.py."""

from __future__ import annotations

import json
import os
import signal
import stat
import threading
from pathlib import Path

import pytest

from infra.offline import run_spec
from infra.platform_stack.program import expected_outputs, hosted_environments
from infra.platform_stack.spec import load_platform_spec
from infra.spec import REPO_ROOT, stack_spec_path
from infra.spec_checks import load_spec
from scripts import up
from tests.engine import require_engine
from twin.nodes import stack_nodes
from twin.onprem import as_the_operator_has_them


def test_the_written_specs_point_at_each_other_and_the_serving_program_runs_on_the_onprem_platforms_outputs():
    """dev's spec names the on-prem platform stack and spec; that spec hosts dev with the
    inventory of dev's GPU nodes; and dev's program runs against what that platform exports (no
    kubeconfig: infra/program.py platform_link takes the stack's own context, #38 item 6)."""
    dev = load_spec(stack_spec_path("dev"))
    _, hosts = as_the_operator_has_them(dev, stack_nodes(dev))
    files = up.write_stack_files("dev", None, hosts)
    serving = load_spec(REPO_ROOT / files.serving)
    assert serving.platform.stack == up.PLATFORM_STACK and Path(serving.platform.spec) == files.platform
    platform = load_platform_spec(REPO_ROOT / files.platform)
    assert (platform.cloud.provider, platform.nodes.mode, platform.controllers.chart_source) == (
        "none", "static", "pinned-modules")
    [hosted] = hosted_environments(platform)
    assert hosted.stack == "dev" and {h.name for h in hosted.inventory.hosts} == {h.name for h in hosts}
    assert {h.role for h in hosted.inventory.hosts} == set(dev.deployment.pools())
    outputs = expected_outputs(platform)
    assert "kubeconfig" not in outputs
    run = run_spec(serving)
    assert not [r for r in run.resources if r.type.endswith("NodePool")], "static nodes: the platform's, no NodePool"


@pytest.mark.parametrize("argv, said", [
    (["up", "--kubeconfig", "k"], "--kubeconfig and --context go together"),
    (["down", "--context", "kind-kind"], "--kubeconfig and --context go together"),
    (["up", "--kubeconfig", "/nonexistent/kubeconfig", "--context", "kind-kind"], "no such file"),
])
def test_bad_arguments_are_one_line_with_the_fix_and_no_traceback(argv, said, capsys):
    assert up.main(argv) == 1
    out = capsys.readouterr().out
    assert said in out and "Fix:" in out and "Traceback" not in out


def test_up_on_a_cluster_of_ones_own_asks_for_the_inventory_before_touching_it(tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("{}")
    target = up.cluster_target(kubeconfig, "kind-kind")
    require_engine()
    with pytest.raises(up.UpError, match="--inventory"):
        up.up(target, inventory_file=None)
    assert not target.folder.exists() or not (target.folder / "state").exists()


def test_the_passphrase_is_a_private_file_handed_over_by_its_path(tmp_path, monkeypatch):
    """The CLI reads PULUMI_CONFIG_PASSPHRASE_FILE (pulumi v3.274.1 pkg/secrets/passphrase:
    readPassphrase), so the passphrase is in no argv and no environment; the caller's own wins."""
    monkeypatch.delenv("PULUMI_CONFIG_PASSPHRASE", raising=False)
    monkeypatch.delenv("PULUMI_CONFIG_PASSPHRASE_FILE", raising=False)
    target = up.Target(tmp_path / "kubeconfig", "c", tmp_path, on_twin=False)
    env = up.engine_environment(target)
    path = Path(env["PULUMI_CONFIG_PASSPHRASE_FILE"])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(path.read_text()) >= 32
    assert "PULUMI_CONFIG_PASSPHRASE" not in env and path.read_text() not in str(env)
    assert up.engine_environment(target)["PULUMI_CONFIG_PASSPHRASE_FILE"] == str(path)  # made once
    monkeypatch.setenv("PULUMI_CONFIG_PASSPHRASE", "the caller's")
    assert "PULUMI_CONFIG_PASSPHRASE_FILE" not in up.engine_environment(target)


def _children_named(name: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                comm = Path(f"/proc/{entry}/comm").read_text().strip()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and comm == name:
                found.append(int(entry))
    return found


def test_a_run_killed_inside_pulumi_up_leaves_a_lock_and_a_pending_create_that_the_next_run_recovers(tmp_path):
    """The real CLI is SIGKILLed while it holds the stack's lock (its program is running), as a
    killed `make up` leaves it: the next `up` of the stack is refused ("currently locked") until
    `recover` drops the lock (`pulumi cancel`: pkg/backend/diy/backend.go CancelCurrentUpdate at
    v3.274.1 deletes the stack's lock files). A pending create (what a kill between a create's
    start and its end leaves in a checkpoint) is kept by every later `up` (pkg/backend/journal.go:
    "we don't want to clear pending CREATE operations"); `recover` clears it with a refresh. That a
    run was killed is remembered until a run after it ends well (`change`)."""
    import pulumi
    from pulumi import automation as auto

    require_engine()
    target = up.Target(tmp_path / "kubeconfig", "unused", tmp_path / "stacks", on_twin=False)
    inside, release = threading.Event(), threading.Event()

    def program() -> None:
        pulumi.export("answer", 42)
        if not release.is_set():
            inside.set()
            release.wait(60)

    with up.holding(target):
        stack = auto.create_or_select_stack(stack_name="killed", project_name="pdstack", program=program,
                                            opts=auto.LocalWorkspaceOptions(work_dir=str(up.project_folder(target))))
        stack.set_config("pdstack:specFile", auto.ConfigValue("stacks/dev.yaml"))  # Pulumi.yaml asks for it
        failed: list[Exception] = []
        run = threading.Thread(target=lambda: _catch(failed, lambda: stack.up(on_output=lambda line: None)))
        run.start()
        while run.is_alive() and not inside.wait(1):
            pass
        assert inside.is_set(), f"the program never ran: {failed}"
        [cli] = _children_named("pulumi")
        os.kill(cli, signal.SIGKILL)
        release.set()
        run.join(120)
        assert failed, "the killed up succeeded"
        with pytest.raises(auto.CommandError, match="locked"):
            stack.up(on_output=lambda line: None)
        killed = up.recover(stack, target, log=lambda line: None)
        assert killed, "the killed run's lock was not seen"
        assert up.recover(stack, target, log=lambda line: None), "forgotten before a run ended well"
        up.change(stack, target, killed, on_output=lambda line: None)
        assert stack.outputs()["answer"].value == 42
        assert not up.recover(stack, target, log=lambda line: None)  # the run after it ended well

        # The checkpoint as a CLI killed inside a create writes it (`pulumi stack import` would
        # drop the pending operation: pkg/cmd/pulumi/stack/io.go "Explicitly clear-out").
        checkpoint = target.folder / "state" / ".pulumi" / "stacks" / "pdstack" / "killed.json"
        saved = json.loads(checkpoint.read_text())
        urn = "urn:pulumi:killed::pdstack::pdstack:test:Half::half"
        saved["checkpoint"]["latest"]["pending_operations"] = [
            {"resource": {"urn": urn, "custom": False, "type": "pdstack:test:Half"}, "type": "creating"}]
        checkpoint.write_text(json.dumps(saved))
        stack.up(on_output=lambda line: None)
        assert stack.export_stack().deployment.get("pending_operations"), "an up cleared the pending create"
        said: list[str] = []
        assert not up.recover(stack, target, log=said.append)  # no killed run this time
        assert not stack.export_stack().deployment.get("pending_operations")
        assert said and "pending" in said[0]


def _catch(failed: list, call) -> None:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test reads it
        failed.append(exc)
