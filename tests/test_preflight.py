"""Preflight against real OpenSSH servers on 127.0.0.1, with stub GPU tools on their PATH."""

from __future__ import annotations


import pytest
import yaml

from infra.rollout.preflight import (
    Expectations,
    judge_clock,
    judge_disk,
    judge_rdma,
    load_inventory,
    parse_cuda_version,
    parse_df_available_bytes,
    parse_ibv_devinfo,
    run_preflight,
)
from infra.inputs import InputError
from tests.servers import free_port
from tests.ssh_hosts import inventory

EXPECT = Expectations(driver_version="570.133.20", cuda_version="12.8", gpus_per_node=8,
                      rdma_devices=("mlx5_0", "mlx5_1"), cache_path="/mnt/weights",
                      min_free_disk_gib=0.001, max_clock_offset_ms=5000)


def test_healthy_hosts_pass_every_check(tmp_path, client_key, hosts):
    port, key = hosts["good"]
    inv = load_inventory(inventory(tmp_path, client_key, {"gpu-0": port, "gpu-1": port}, {port: key}))
    report = run_preflight(inv, EXPECT)
    assert report.ok, report.summary()
    assert {(r.host, r.check) for r in report.results} == {
        (h, c) for h in ("gpu-0", "gpu-1") for c in ("driver", "gpus", "cuda", "toolkit", "rdma", "clock", "disk")}
    assert "8 x NVIDIA H100" in next(r.detail for r in report.results if r.check == "gpus")
    assert {r.detail for r in report.results if r.check == "toolkit"} == {"NVIDIA Container Toolkit 1.17.8"}


def test_wrong_driver_fails_naming_host_and_check(tmp_path, client_key, hosts):
    good, bad = hosts["good"], hosts["old-driver"]
    inv = load_inventory(inventory(tmp_path, client_key, {"gpu-0": good[0], "gpu-7": bad[0]},
                                   {good[0]: good[1], bad[0]: bad[1]}))
    report = run_preflight(inv, EXPECT)
    assert not report.ok
    assert [(r.host, r.check) for r in report.failures()] == [("gpu-7", "driver")]
    assert "gpu-7 driver: driver 550.54.15, pinned 570.133.20" in report.summary()


def test_more_gpus_expected_than_visible(tmp_path, client_key, hosts):
    port, key = hosts["good"]
    inv = load_inventory(inventory(tmp_path, client_key, {"gpu-0": port}, {port: key}))
    report = run_preflight(inv, Expectations(**{**EXPECT.__dict__, "gpus_per_node": 4}))
    assert [(r.check, r.detail) for r in report.failures()] == [("gpus", "8 GPUs visible, expected 4")]


def test_refused_connection_fails_the_host(tmp_path, client_key, hosts):
    port, key = hosts["good"]
    closed = free_port()
    inv = load_inventory(inventory(tmp_path, client_key, {"gpu-0": port, "gpu-9": closed}, {port: key}))
    report = run_preflight(inv, EXPECT)
    assert [(r.host, r.check, r.detail) for r in report.failures()] == [("gpu-9", "ssh", "connection refused")]


def test_changed_host_key_is_rejected_and_not_learned(tmp_path, client_key, hosts):
    good, other = hosts["good"], hosts["old-driver"]
    # known_hosts claims the good host has the other server's key: an impostor to us.
    path = inventory(tmp_path, client_key, {"gpu-0": good[0]}, {good[0]: other[1]})
    before = (tmp_path / "known_hosts").read_text()
    report = run_preflight(load_inventory(path), EXPECT)
    (failure,) = report.failures()
    assert (failure.host, failure.check) == ("gpu-0", "ssh")
    assert "host key does not match" in failure.detail
    assert (tmp_path / "known_hosts").read_text() == before


def test_unknown_host_key_is_rejected_never_auto_added(tmp_path, client_key, hosts):
    port, _ = hosts["good"]
    path = inventory(tmp_path, client_key, {"gpu-0": port}, {})
    report = run_preflight(load_inventory(path), EXPECT)
    (failure,) = report.failures()
    assert "not in known_hosts" in failure.detail
    assert (tmp_path / "known_hosts").read_text() == ""


def test_hanging_command_times_out_and_other_hosts_still_report(tmp_path, client_key, hosts):
    good, hung = hosts["good"], hosts["hung"]
    inv = load_inventory(inventory(tmp_path, client_key, {"gpu-0": good[0], "gpu-3": hung[0]},
                                   {good[0]: good[1], hung[0]: hung[1]}, timeout_seconds=10))
    # 10 s, not less: the same timeout bounds the good host's handshake and commands, which a busy
    # machine can slow past a second or two. The stub sleeps 60 s, so "timed out" below can only
    # come from the timeout.
    report = run_preflight(inv, EXPECT)
    failed = {(r.host, r.check) for r in report.failures()}
    assert failed == {("gpu-3", "driver"), ("gpu-3", "gpus"), ("gpu-3", "cuda")}
    assert all("timed out" in r.detail for r in report.failures())
    assert all(r.ok for r in report.results if r.host == "gpu-0")


def test_inventory_errors_name_the_field(tmp_path):
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump({"key_file": "k", "known_hosts": "kh", "hosts": [], "colour": "blue"}))
    with pytest.raises(InputError) as exc:
        load_inventory(path)
    text = str(exc.value)
    assert "hosts" in text and "colour" in text


# --- the pure parsers and verdicts --------------------------------------------------------------


def test_parsers_read_real_tool_output():
    assert parse_cuda_version("| NVIDIA-SMI 570.133.20  Driver Version: 570.133.20  CUDA Version: 12.8 |") == "12.8"
    assert parse_ibv_devinfo("hca_id:\tmlx5_0\n\t\t\tstate:\t\t\tPORT_ACTIVE (4)\nhca_id:\tmlx5_1\n\t\t\tstate:\t\tPORT_DOWN (1)\n") == {
        "mlx5_0": True, "mlx5_1": False}
    df = "Filesystem     1-blocks      Used  Available Capacity Mounted on\n/dev/nvme0n1 100 50 1073741824 50% /mnt\n"
    assert parse_df_available_bytes(df) == 2**30


def test_verdicts():
    assert judge_rdma("hca_id:\tmlx5_0\n\tstate:\tPORT_ACTIVE (4)\n", EXPECT) == (False, "missing mlx5_1")
    assert judge_clock("no\n100.0\n", EXPECT, 100.0)[0] is False
    assert judge_clock("yes\n100.0\n", EXPECT, 109.0) == (False, "clock 9000 ms off, limit 5000 ms")
    assert judge_clock("yes\n100.0\n", EXPECT, 100.2)[0] is True
    tight = Expectations(**{**EXPECT.__dict__, "min_free_disk_gib": 2})
    assert judge_disk("h\n/dev/x 1 1 1073741824 1% /\n", tight) == (False, "1 GiB free at /mnt/weights, need 2")


def test_a_host_without_the_container_toolkit_fails_naming_the_fix(tmp_path, client_key, hosts):
    """A host whose driver the platform expects preinstalled (controllers.gpu_driver_preinstalled:
    true, the GPU operator's driver.enabled and toolkit.enabled false) needs NVIDIA's Container
    Toolkit too: without it no container sees a GPU. Before, nothing checked it and the host
    passed; now `nvidia-ctk --version` (the toolkit's CLI) must answer."""
    from infra.rollout.preflight import TOOLKIT_MISSING

    port, key = hosts["no-toolkit"]
    report = run_preflight(load_inventory(inventory(tmp_path, client_key, {"gpu-5": port}, {port: key})), EXPECT)
    assert [(r.host, r.check, r.detail) for r in report.failures()] == [("gpu-5", "toolkit", TOOLKIT_MISSING)]
    assert "nvidia-ctk runtime configure --runtime=containerd" in TOOLKIT_MISSING


def test_what_the_gpu_operator_installs_is_not_looked_for_on_the_host(tmp_path, client_key, hosts):
    """With the platform's GPU operator installing the driver and the toolkit in containers
    (controllers.gpu_driver_preinstalled: false), the host has neither: its rows say they are not
    checked, and why, instead of failing (the wrong-driver host passes), and the rest is checked."""
    from infra.platform_stack.catalog import gpu_operator_values
    from infra.rollout.preflight import NOT_ON_HOST
    from infra.spec_checks import load_spec
    from tests.test_platform import context

    port, key = hosts["old-driver"]
    inv = load_inventory(inventory(tmp_path, client_key, {"gpu-7": port}, {port: key}))
    report = run_preflight(inv, Expectations(**{**EXPECT.__dict__, "host_driver": False}))
    assert report.ok, report.summary()
    assert {r.check: r.detail for r in report.results if r.detail == NOT_ON_HOST}.keys() == {
        "driver", "gpus", "cuda", "toolkit"}
    # what Expectations.of reads is what sets the operator's driver and toolkit
    spec = load_spec("stacks/prod.yaml")
    installs = gpu_operator_values(context("platform-prod"))
    assert Expectations.of(spec, inv).host_driver is not installs["driver"]["enabled"]
    assert installs["driver"]["enabled"] == installs["toolkit"]["enabled"]
