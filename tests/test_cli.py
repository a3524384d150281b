"""pdctl as an operator runs it."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import stack_data


def pdctl(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infra.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_validate_bad_file_exits_nonzero_names_field_and_writes_nothing(tmp_path):
    data = stack_data("prod")
    data["deployment"]["decode"]["expert_parallel"] = 128
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    before = sorted(p.name for p in tmp_path.iterdir())
    result = pdctl("validate", "--spec", str(bad), cwd=tmp_path)
    assert result.returncode == 2
    assert "deployment.decode.expert_parallel: 128 is larger than the supernode's 72 GPUs" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("command", [["validate"], ["render", "--out", "out"], ["policy"]])
def test_a_platform_spec_given_to_a_serving_command_is_named_as_such(tmp_path, command):
    """A platform stack's spec where a serving stack's is expected: one line that says what the
    file is and what to run instead, not twenty "required field is missing"; nothing written."""
    result = pdctl(*command, "--stack", "platform-prod", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "platform-prod.yaml is a platform stack's spec (kind: platform)" in result.stderr
    assert "pdctl preview --offline --spec" in result.stderr and "required field" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_render_bad_spec_writes_nothing(tmp_path):
    data = stack_data("dev")
    data["deployment"]["pd_ratio"] = "3:1"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    result = pdctl("render", "--spec", str(bad), "--out", str(out))
    assert result.returncode == 2 and "deployment.pd_ratio" in result.stderr
    assert not out.exists()


def test_preview_offline_prints_layers_with_counts():
    result = pdctl("preview", "--offline", "--stack", "dev")
    assert result.returncode == 0, result.stderr
    assert "offline preview under Pulumi mocks" in result.stdout
    assert "foundation (" in result.stdout
    assert "total" in result.stdout


def test_render_writes_one_file_per_manifest(tmp_path):
    result = pdctl("render", "--stack", "dev", "--out", str(tmp_path / "m"))
    assert result.returncode == 0, result.stderr
    files = list((tmp_path / "m").rglob("*.yaml"))
    assert len(files) >= 2
    assert all(yaml.safe_load(f.read_text())["kind"] for f in files)


def test_generated_keys_never_appear_in_plain_text_in_render_or_preview(tmp_path):
    """Keys come from pulumi-random as secret outputs; what operators see or commit never holds them."""
    from infra.recording import is_secret
    from infra.render.manifests import unwrap
    from tests.conftest import shipped_run

    (secret,) = shipped_run("prod").by_kind("Secret")
    assert is_secret(secret["stringData"])
    keys = list(unwrap(secret["stringData"]).values())
    assert keys and all(len(k) >= 20 for k in keys)
    preview = pdctl("preview", "--offline", "--stack", "prod")
    render = pdctl("render", "--stack", "prod", "--out", str(tmp_path / "m"))
    assert preview.returncode == 0 and render.returncode == 0, preview.stderr + render.stderr
    written = "".join(f.read_text() for f in (tmp_path / "m").rglob("*") if f.is_file())
    assert "<secret>" in written  # the Secret is rendered, its values redacted
    for key in keys:
        for text in (preview.stdout, preview.stderr, render.stdout, render.stderr, written):
            assert key not in text


def test_version_names_the_installed_package(capsys):
    from importlib.metadata import version

    from infra.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"pdctl (pdstack) {version('pdstack')}"


# --- the process as a shell runs it: Ctrl-C, a closed stdout, a reader that goes away ----------

PDCTL = Path(sys.executable).with_name("pdctl")  # the console script pip made: `pdctl = infra.cli:main`


# SIGINT's default action in the child, as a terminal's foreground job has it. A test run
# started in the background of a script (`make test &`, a job without job control) inherits
# SIGINT ignored, and Python then leaves it ignored: pdctl would never see the Ctrl-C this test
# sends (seen: every run exited 0). Set by env(1) after the fork (coreutils --default-signal), not
# by a preexec_fn, which runs this process's at-fork handlers in the child (twin/process.py
# dying_with_parent says why that aborts children where gRPC is loaded).
CTRL_C_AS_A_TERMINAL_SENDS_IT = ["env", "--default-signal=INT"]


def _pdctl_is_importing(pid: int) -> bool:
    """pdctl's own imports have begun: the first extension module is mapped. Before that the
    interpreter runs its own start-up (site, .pth files), which no program's code can guard."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False
    return re.search(r"lib-dynload/|site-packages/\S*\.so", maps) is not None


def test_importing_the_entry_point_loads_nothing_a_ctrl_c_could_interrupt():
    """The console script runs `from infra.cli import main` before any try can catch a Ctrl-C:
    that import must be the package files and `interrupts` (which `run` shares, standard
    library only) and nothing else (no rich, no pydantic)."""
    done = subprocess.run([sys.executable, "-c", "import sys; before = set(sys.modules); import infra.cli; "
                           "print(' '.join(sorted(set(sys.modules) - before))); import infra.cli.run; "
                           "print(callable(infra.cli.main))"], capture_output=True, text=True, check=True)
    loaded, main_still_the_entry_point = done.stdout.splitlines()
    assert loaded.split() == ["infra", "infra.cli", "infra.cli.interrupts"]
    assert main_still_the_entry_point == "True"  # no submodule named main may shadow it once imported


def test_a_ctrl_c_python_cannot_raise_stops_pdctl_with_one_line():
    """CI caught a SIGINT landing in importlib's module-lock weakref callback: Python printed
    "Exception ignored in ... Traceback ... KeyboardInterrupt" and would have run on. The same
    thing, made to happen on purpose: a weakref callback that is interrupted."""
    program = ("import sys, weakref, infra.cli\n"
               "sys.unraisablehook = infra.cli._interrupt_python_could_not_raise\n"
               "class Box: pass\n"
               "def interrupted(ref): raise KeyboardInterrupt\n"
               "box = Box(); ref = weakref.ref(box, interrupted); del box\n"
               "print('ran on')\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
    assert (done.returncode, done.stdout, done.stderr) == (130, "", "interrupted\n")


@pytest.mark.parametrize("command", [["validate"], ["preview", "--offline"]])
def test_ctrl_c_while_pdctl_starts_or_runs_is_one_line_and_exit_130(command):
    """SIGINT at several moments after pdctl's imports begin, three times over: each run ends with
    `interrupted` and 130, or (a signal at the very end, after Python restored the default
    action) killed by SIGINT with nothing said; never a traceback."""
    codes = []
    for _ in range(3):
        for delay in (0, 0.01, 0.03, 0.1, 0.3, 1.0):
            proc = subprocess.Popen([*CTRL_C_AS_A_TERMINAL_SENDS_IT, str(PDCTL), *command], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            while proc.poll() is None and not _pdctl_is_importing(proc.pid):
                time.sleep(0.001)
            time.sleep(delay)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=120)
            assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
            assert proc.returncode in (0, 130, -signal.SIGINT), (proc.returncode, err)
            if proc.returncode == 130:
                assert err.strip() == "interrupted", err
            codes.append(proc.returncode)
    assert 130 in codes, codes


_INTERRUPT_IN_A_CONSTRUCTOR = """
import sys
import pulumi.runtime.resource as resource
from infra.cli import main

calls, stack_trace = 0, resource._get_stack_trace

def ctrl_c_on_the_nth_call():
    global calls
    calls += 1
    if calls == int(sys.argv[1]):
        raise KeyboardInterrupt
    return stack_trace()

resource._get_stack_trace = ctrl_c_on_the_nth_call
sys.exit(main(["preview", "--offline"]))
"""


@pytest.mark.parametrize("nth", [1, 3, 20, 40, 57])
def test_ctrl_c_inside_a_resource_constructor_ends_the_preview(nth):
    """A Ctrl-C that lands in a resource's constructor, between its URN's future and its
    registration (pulumi/runtime/resource.py register_resource, pulumi 3.272.0 pinned in
    pyproject: `_get_stack_trace` is the slow step there), is caught by Pulumi's
    run_pulumi_func, which then waits for registrations that can never finish: `pdctl preview
    --offline` hung until CI's timeout (the Ctrl-C test above, under load). Here the interrupt
    is put at that exact point of dev's program, at its first, early, middle and last (57th of
    58) constructor: one line, exit 130, nothing else."""
    done = subprocess.run([sys.executable, "-c", _INTERRUPT_IN_A_CONSTRUCTOR, str(nth)], capture_output=True,
                          text=True, timeout=300)
    assert (done.returncode, done.stderr) == (130, "interrupted\n"), done.stderr[-2000:]


def test_a_closed_stdout_is_no_traceback_and_no_file_gets_the_output(tmp_path):
    """`pdctl validate >&-`: Python leaves sys.stdout None, and the next file pdctl opens would
    get descriptor 1. The command runs with its output dropped; render's manifests hold only
    manifests."""
    for command in (["validate"], ["validate", "--output", "json"], ["render", "--out", str(tmp_path / "out")]):
        done = subprocess.run(["/bin/sh", "-c", 'exec "$0" "$@" >&-', str(PDCTL), *command], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0 and done.stderr == "", (command, done.stderr)
    written = [p for p in (tmp_path / "out").rglob("*.yaml")]
    # render's own lines ("schema-checked N manifests: ...", "wrote N manifests to <out>/"), not
    # a word a manifest may hold (the weights fetcher's docstrings say "wrote")
    said = re.compile(r"schema-checked \d+ manifests|wrote \d+ manifests to ")
    assert written and not [p for p in written if said.search(p.read_text())]


def test_a_reader_that_goes_away_ends_nothing_half_way(tmp_path):
    """`pdctl ... | head -1`: the pipe breaks (EPIPE). Output is dropped, silently, and the
    command carries on to its end: a rollout whose log reader died still judges its revision
    and records the outcome (rich would raise SystemExit at the first print after the break)."""
    from infra.rollout.releases import ReleaseStore
    from tests.servers import healthy_prometheus

    def reader_gone(*args: str) -> tuple[int, str]:
        proc = subprocess.Popen([str(PDCTL), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        proc.stdout.close()  # the reader leaves before the first line
        err = proc.stderr.read()
        return proc.wait(timeout=300), err

    for command in (["validate"], ["preview", "--offline", "--stack", "prod"],
                    ["preview", "--offline", "--stack", "prod", "--output", "json"]):
        code, err = reader_gone(*command)
        assert code == 0 and err == "", (command, err)
    releases = tmp_path / "releases"
    with healthy_prometheus() as prometheus:
        code, err = reader_gone("rollout", "--sim", str(tmp_path / "cluster.json"), "--releases", str(releases),
                                "--prometheus", prometheus, "--stages", "100", "--bake", "0")
    assert code == 0 and "Traceback" not in err, err
    store = ReleaseStore("dev", releases)
    assert store.traffic() == {1: 100} and store.status(1) == "good" and store.operation() is None


def test_an_interrupt_a_library_wrapped_is_still_one_line_and_exit_130(monkeypatch, capsys):
    """Ctrl-C while pydantic-core builds a model's serializer comes back as its SchemaError,
    "... KeyboardInterrupt:" in its text and nothing chained: pdctl printed "unexpected error:
    SchemaError ... KeyboardInterrupt" (found by the Ctrl-C test above under pytest-xdist's
    timing). It is an interrupt: one line, exit 130. A SchemaError of any other kind stays an
    unexpected error."""
    from pydantic_core import SchemaError

    from infra.cli import main, validate

    def interrupted(args):
        raise SchemaError("Error building `model` serializer:\n  SchemaError: Field `role`:\n  KeyboardInterrupt: ")

    monkeypatch.setattr(validate, "cmd_validate", interrupted)
    capsys.readouterr()
    assert main(["validate"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"

    def broken(args):
        raise SchemaError("Error building `model` serializer: something else")

    monkeypatch.setattr(validate, "cmd_validate", broken)
    assert main(["validate"]) == 1
    assert "unexpected error: SchemaError" in capsys.readouterr().err


def test_a_spec_nested_too_deeply_is_one_message_not_a_crash(tmp_path):
    """60,000 nested mappings: PyYAML's Python parser gives up with RecursionError, which
    parse_yaml turns into one line naming the file. libyaml's C parser has no depth limit and
    killed pdctl with a segmentation fault (exit 139), which is why specs are not parsed with it."""
    depth = 60_000
    spec = tmp_path / "deep.yaml"
    spec.write_text("a: " + "{b: " * depth + "1" + "}" * depth + "\n")
    done = subprocess.run([sys.executable, "-m", "infra.cli", "validate", str(spec)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, (done.returncode, done.stderr[-500:])
    assert "nested too deeply to read" in done.stderr and "Traceback" not in done.stderr
