"""infra/platform_stack/modules.py: which twin/*/go.mod pin the platform reads a module's files at."""

from __future__ import annotations

import pytest

from infra.platform_stack import modules


def _go_mod(folder, requires: dict[str, str], tool: str | None = None) -> None:
    folder.mkdir()
    lines = ["module pdstack.dev/twin/" + folder.name, "", "go 1.26.0", "", "require ("]
    lines += [f"\t{m} {v}" for m, v in requires.items()] + [")"]
    if tool:
        lines += ["", f"tool {tool}"]
    (folder / "go.mod").write_text("\n".join(lines) + "\n")


@pytest.fixture
def twin_src(tmp_path, monkeypatch):
    monkeypatch.setattr(modules, "TWIN_SRC", tmp_path)
    modules._requirements.cache_clear()
    modules._pins_files.cache_clear()
    yield tmp_path
    modules._requirements.cache_clear()
    modules._pins_files.cache_clear()


def test_a_folder_that_pins_files_wins_over_one_that_builds_a_program_at_another_version(twin_src):
    """twin/endpoint-picker builds the picker on gateway-api-inference-extension v1.4.0 (a `tool`
    line), twin/crds pins the CRDs' v1.6.0 (no tool): the platform's InferencePool CRD is
    v1.6.0's. Two direct pins of files that differ stay an error."""
    gie = "sigs.k8s.io/gateway-api-inference-extension"
    _go_mod(twin_src / "crds", {gie: "v1.6.0"})
    _go_mod(twin_src / "endpoint-picker", {gie: "v1.4.0"}, tool="pdstack.dev/twin/endpoint-picker")
    assert (modules.pin(gie).version, modules.pin(gie).folder) == ("v1.6.0", "crds")
    _go_mod(twin_src / "platform", {gie: "v1.5.0"})
    modules._requirements.cache_clear()
    with pytest.raises(modules.ModuleUnavailable, match=r"pinned at v1\.5\.0, v1\.6\.0 in twin/\*/go\.mod"):
        modules.pin(gie)
