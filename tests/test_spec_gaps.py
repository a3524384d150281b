"""Spec inputs that used to pass validation and fail later (or leak): each refused at `validate`
with the field and the fix. Names are DNS labels of at most 63 characters (RFC 1123, as
kubernetes.io/docs/concepts/overview/working-with-objects/names/ requires for namespaces);
YAML 1.1 reads 1:1 as the base-60 integer 61 (PyYAML's resolver, tested below)."""

from __future__ import annotations

import json

import pytest

from infra.spec_checks import parse_spec
from tests.conftest import problems_of, stack_data


def text(change) -> str:
    data = stack_data("prod")
    change(data)
    return "\n".join(problems_of(data))


@pytest.mark.parametrize("change, expected", [
    (lambda d: d["access"]["api_keys"].append({"name": "batch-eval", "requests_per_minute": 5}),
     "access.api_keys: API key name(s) batch-eval appear more than once"),
    (lambda d: d["environment"].update(namespace="n" * 58),
     "environment.namespace: '" + "n" * 58 + "' has 58 characters; at most 57 fit (release tracks run in"),
    (lambda d: d["environment"].update(name="e" * 64), "environment.name: '" + "e" * 64 + "' has 64 characters"),
    (lambda d: d["model"]["weights"].update(endpoint_url="https://AKIA:secret@s3.example.com"),
     "model.weights.endpoint_url: the URL carries credentials (user:password@)"),
    (lambda d: d["deployment"]["autoscaling"].update(prometheus_url="http://prom:9090/?token=abc"),
     "deployment.autoscaling.prometheus_url: the URL's query carries token"),
    (lambda d: d["observability"].update(otlp_endpoint="http://u:p@tempo:4317"),
     "observability.otlp_endpoint: the URL carries credentials"),
    (lambda d: d["deployment"]["decode"]["scaling"].update(min_instances=3, max_instances=2),
     "deployment.decode.scaling: min_instances 3 is above max_instances 2. Fix: swap them"),
    (lambda d: d["deployment"].update(pd_ratio=61),  # what YAML makes of an unquoted 1:1
     "deployment.pd_ratio: is the number 61: YAML reads an unquoted ratio such as 1:1 as a base-60 number"),
    (lambda d: d["deployment"]["decode"].update(expert_placement="placements/missing.json"),
     "deployment.decode.expert_placement: "),
])
def test_refused_with_field_and_fix(change, expected):
    assert expected in text(change)


def test_an_unquoted_ratio_really_is_61_in_yaml():
    import yaml

    assert yaml.safe_load("pd_ratio: 1:1") == {"pd_ratio": 61}


def test_the_shipped_specs_still_pass():
    for stack in ("dev", "prod"):
        parse_spec(stack_data(stack))


def _placement(tmp_path, rows) -> str:
    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"physical_to_logical_map": rows}))
    return str(path)  # absolute: expert_placement is read relative to the project, or as given


@pytest.mark.parametrize("rows, expected", [
    ([[0] * 320] * 60, "has 60 layers; the model has 61"),  # prod decode: 256 experts + 64 redundant
    ([[0] * 320] * 60 + [[0] * 319], "layer 60 has 319 slots; this pool has 320 (256 experts + redundant)"),
    ([[0] * 320] * 60 + [[0] * 319 + [256]], "layer 60 names an expert outside 0..255"),
    ([[0] * 320] * 60 + [[0] * 319 + [-1]], "layer 60 names an expert outside 0..255"),
    ("not rows", "has str layers"),
])
def test_an_expert_placement_must_fit_the_model_and_the_pool(tmp_path, rows, expected):
    """SGLang reads --init-expert-location as [hidden layers][physical slots] of logical expert ids
    (sgl-project/sglang python/sglang/srt/eplb/expert_location.py, ExpertLocationMetadata.init_by_mapping)
    and fails at start on any other shape: refused at validate instead."""
    data = stack_data("prod")
    data["deployment"]["decode"]["expert_placement"] = _placement(tmp_path, rows)
    assert any(f"deployment.decode.expert_placement: {tmp_path / 'placement.json'} {expected}" in p
               for p in problems_of(data)), problems_of(data)


def test_a_placement_pdctl_eplb_writes_passes(tmp_path):
    from infra.cli import main

    loads = tmp_path / "loads.json"
    loads.write_text(json.dumps({"logical_count": [[i % 7 + 1 for i in range(256)]] * 58}))
    assert main(["eplb", "--stack", "prod", "--loads", str(loads), "--out", str(tmp_path / "placement.json")]) == 0
    data = stack_data("prod")
    data["deployment"]["decode"]["expert_placement"] = str(tmp_path / "placement.json")
    assert parse_spec(data).deployment.decode.expert_placement == str(tmp_path / "placement.json")


def test_a_gpu_quota_below_one_instance_is_refused():
    data = stack_data("prod")
    data["hardware"]["max_gpus"] = 32  # one decode instance is 64 GPUs
    assert any(p.startswith("hardware.max_gpus: the pools reserve") and "but the quota is 32" in p
               for p in problems_of(data))
