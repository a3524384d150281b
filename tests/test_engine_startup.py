"""Engine start-up (issue #37 item 9): a node-local cache of compiled kernels on every engine pod,
weight fetches in waves of a bounded number of nodes, and startup probes that allow for both.

The cache variables are read from the pinned wheels (scripts/pinned_wheels.py):
- sglang 0.5.23, sglang/srt/environ.py: SGLANG_CACHE_DIR (default ~/.cache/sglang) holds
  SGLANG_DG_CACHE_DIR (`_default_cache_subdir("deep_gemm")`, which
  sglang/srt/layers/deep_gemm_wrapper/compile_utils.py gives DeepGEMM as DG_JIT_CACHE_DIR), and
  `third_party_cache_defaults` puts Triton's, Inductor's, CUDA's, TileLang's and FlashInfer's
  caches under it, applied at `import sglang` (sglang/__init__.py, _redirect_third_party_caches).
- vllm 0.33.0: vllm/envs.py VLLM_CACHE_ROOT; vllm/utils/deep_gemm.py gives DeepGEMM
  `<VLLM_CACHE_ROOT>/deep_gemm` as DG_JIT_CACHE_DIR; vllm/compilation/compiler_interface.py
  (initialize_inductor_cache) sets TORCHINDUCTOR_CACHE_DIR itself inside its compile cache and
  keeps a TRITON_CACHE_DIR the caller set. The other third-party caches it leaves at their defaults.
"""

from __future__ import annotations

import math
import re
import subprocess
import zipfile

import pytest

from infra import naming, weights
from infra.components.storage import WAVE_WAIT_SHELL, jit_cache_host_path
from infra.offline import run_spec
from infra.render.engine_args import JIT_CACHE_MOUNT, jit_cache_env
from infra.render.engine_check import variant_spec
from infra.render.metrics import catalogue
from infra.render.probes import PROBE_PERIOD_SECONDS
from tests.conftest import script_modules


def wheel_source(engine: str, module: str) -> str:
    (pinned_wheels,) = script_modules("pinned_wheels")
    with zipfile.ZipFile(pinned_wheels.pinned_wheel(engine, catalogue(engine)["version"])) as z:
        return z.read(module.replace(".", "/") + ".py").decode()


def sglang_third_party_caches() -> set[str]:
    """The variables sglang 0.5.23's third_party_cache_defaults sets under SGLANG_CACHE_DIR."""
    environ = wheel_source("sglang", "sglang.srt.environ")
    body = environ[environ.index("def third_party_cache_defaults("):]
    body = body[:body.index("\ndef ")]
    return set(re.findall(r'"([A-Z_]+)": (?:os\.path\.join\(base|base\b)', body))


def test_the_kernel_cache_variables_are_the_ones_the_pinned_engines_read():
    environ = wheel_source("sglang", "sglang.srt.environ")
    assert re.search(r"^\s+SGLANG_CACHE_DIR = EnvStr\(", environ, re.M)
    assert 'SGLANG_DG_CACHE_DIR = EnvStr(lambda: _default_cache_subdir("deep_gemm"))' in environ
    assert 'os.environ["DG_JIT_CACHE_DIR"] = envs.SGLANG_DG_CACHE_DIR.get()' in wheel_source(
        "sglang", "sglang.srt.layers.deep_gemm_wrapper.compile_utils")
    assert "_redirect_third_party_caches()" in wheel_source("sglang", "sglang.__init__")
    third_party = sglang_third_party_caches()
    assert {"TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH", "FLASHINFER_WORKSPACE_BASE"} <= third_party
    assert set(jit_cache_env("sglang")) == {"SGLANG_CACHE_DIR"}

    assert '"VLLM_CACHE_ROOT": lambda' in wheel_source("vllm", "vllm.envs")
    deep_gemm = wheel_source("vllm", "vllm.utils.deep_gemm")
    assert re.search(r'DEEP_GEMM_JIT_CACHE_ENV_NAME = "DG_JIT_CACHE_DIR".*?os\.path\.join\(\s*envs\.VLLM_CACHE_ROOT, '
                     r'"deep_gemm"', deep_gemm, re.S)
    inductor = wheel_source("vllm", "vllm.compilation.compiler_interface")
    assert 'os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache' in inductor
    assert 'triton_cache = os.environ.get("TRITON_CACHE_DIR")' in inductor
    assert set(jit_cache_env("vllm")) == {"VLLM_CACHE_ROOT"} | (third_party - {"TORCHINDUCTOR_CACHE_DIR"})
    for engine in ("sglang", "vllm"):
        for value in jit_cache_env(engine).values():
            assert value == JIT_CACHE_MOUNT or value.startswith(JIT_CACHE_MOUNT + "/")


def engine_pod_templates(run):
    """(template, its engine container) of every LWS leader and worker, and of a dedicated encoder."""
    for lws in run.by_kind("LeaderWorkerSet"):
        group = lws["spec"]["leaderWorkerTemplate"]
        for template in filter(None, (group.get("leaderTemplate"), group["workerTemplate"])):
            yield template, next(c for c in template["spec"]["containers"] if c["name"] == "engine")
    for deployment in run.by_kind("Deployment"):
        if deployment["metadata"]["name"] == naming.ENCODER:
            template = deployment["spec"]["template"]
            yield template, template["spec"]["containers"][0]


@pytest.mark.parametrize("stack", ["dev", "prod"])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_every_engine_pod_keeps_its_compiled_kernels_on_the_node_beside_the_weights(stack, engine):
    spec = variant_spec(stack, engine)
    node_cache = spec.model.weights.node_cache_path.rstrip("/")
    pods = list(engine_pod_templates(run_spec(spec)))
    assert pods
    for template, container in pods:
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == JIT_CACHE_MOUNT]
        assert not mount.get("readOnly")
        host_path = volumes[mount["name"]]["hostPath"]
        assert host_path == {"path": jit_cache_host_path(spec), "type": "DirectoryOrCreate"}
        assert host_path["path"].startswith(node_cache + "/")  # the weights' node-local store
        assert f"{engine}-{spec.engine.version}" in host_path["path"]  # another build compiles its own
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert {k: env.get(k) for k in jit_cache_env(engine)} == jit_cache_env(engine)


def test_the_startup_budget_counts_the_latest_workers_fetch_wave():
    """prod: prefill up to 8 groups of 2 nodes, decode up to 2 groups of 16: 48 nodes, 16 at once,
    so 3 waves of 642 GiB / 1 GiB/s = 642 s. Prefill's workers (nodes 1, 3, .. 15) fetch in wave 0,
    decode's second group's (nodes 33..47) in wave 2. Each leader allows twice (its latest worker's
    wave end + load 642/4 s + warm-up 600 s)."""
    spec = variant_spec("prod", "sglang")
    w = spec.model.weights
    assert (w.size_gib, w.load_gib_per_second, w.start_minutes, w.fetch_gib_per_second, w.fetch_nodes_at_once) == \
        (642, 4.0, 10, 1.0, 16)

    def startup(spec) -> dict[str, int]:
        run = run_spec(spec)
        return {lws["metadata"]["name"]: next(c for c in lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
                                              ["containers"] if c["name"] == "engine")["startupProbe"]
                ["failureThreshold"] * PROBE_PERIOD_SECONDS for lws in run.by_kind("LeaderWorkerSet")}

    allowed = startup(spec)
    assert allowed["engine-prefill"] == 10 * math.ceil(2 * (1 * 642 + 642 / 4 + 600) / 10) == 2810
    assert allowed["engine-decode"] == 10 * math.ceil(2 * (3 * 642 + 642 / 4 + 600) / 10) == 5380
    at_once = spec.model_copy(update={"model": spec.model.model_copy(update={
        "weights": w.model_copy(update={"fetch_nodes_at_once": 48})})})
    assert startup(at_once)["engine-decode"] == 10 * math.ceil(2 * (1 * 642 + 642 / 4 + 600) / 10) == 2810


def pod_env(template: dict, labels: dict) -> dict[str, str]:
    """The weights init container's environment as the kubelet resolves it for a pod with `labels`."""
    (init,) = [c for c in template["spec"]["initContainers"] if c["name"] == "fetch-weights"]
    env = {}
    for e in init["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            key = re.fullmatch(r"metadata\.labels\['(.+)'\]", e["valueFrom"]["fieldRef"]["fieldPath"]).group(1)
            env[e["name"]] = labels[key]
    return env


def test_no_more_nodes_fetch_at_once_than_the_spec_allows_and_each_group_fetches_together():
    """Every node of prod at the pools' largest, with the env its pod gets and LWS's labels on it."""
    spec = variant_spec("prod", "sglang")
    waves: dict[int, list[tuple[str, int, int]]] = {}
    for lws in run_spec(spec).by_kind("LeaderWorkerSet"):
        group = lws["spec"]["leaderWorkerTemplate"]
        role = lws["metadata"]["labels"][naming.ROLE_LABEL]
        for g in range(spec.deployment.pools()[role].bounds()[1]):
            for w in range(group["size"]):
                template = group["leaderTemplate"] if w == 0 and "leaderTemplate" in group else group["workerTemplate"]
                env = pod_env(template, {naming.LWS_GROUP_INDEX_LABEL: str(g), naming.LWS_WORKER_INDEX_LABEL: str(w)})
                waves.setdefault(weights.wave_wait_seconds(env), []).append((role, g, w))
    assert len(sum(waves.values(), [])) == 48
    assert sorted(waves) == [0, 642, 1284]
    assert all(len(nodes) <= spec.model.weights.fetch_nodes_at_once for nodes in waves.values())
    for nodes in waves.values():  # a group's nodes fetch in one wave, where it fits
        groups = {(role, g) for role, g, _ in nodes}
        assert all(sum(1 for r, g, _ in nodes if (r, g) == key) == (2 if key[0] == "prefill" else 16) for key in groups)


def shell_wait(env: dict[str, str], tmp_path) -> tuple[int, str]:
    """WAVE_WAIT_SHELL run by /bin/sh with a `sleep` that records its argument instead."""
    (tmp_path / "sleep").write_text('#!/bin/sh\necho "$1" > "$SLEPT"\n')
    (tmp_path / "sleep").chmod(0o755)
    slept = tmp_path / "slept"
    slept.unlink(missing_ok=True)
    done = subprocess.run(["/bin/sh", "-c", "set -eu\n" + "\n".join(WAVE_WAIT_SHELL) + "\nwave_wait\n"],
                          env={**env, "PATH": f"{tmp_path}:/usr/bin:/bin", "SLEPT": str(slept)},
                          capture_output=True, text=True, cwd=tmp_path)
    return done.returncode, slept.read_text().strip() if slept.exists() else "0"


@pytest.mark.parametrize("first,size,group,worker", [(0, 2, 0, 1), (16, 16, 1, 3), (16, 16, 0, 15), (0, 1, 40, 0)])
def test_the_shell_fetcher_waits_as_long_as_the_python_one(tmp_path, first, size, group, worker):
    env = {"PDSTACK_WEIGHTS_FIRST_NODE": str(first), "PDSTACK_WEIGHTS_GROUP_NODES": str(size),
           "PDSTACK_WEIGHTS_GROUP_INDEX": str(group), "PDSTACK_WEIGHTS_WORKER_INDEX": str(worker),
           "PDSTACK_WEIGHTS_NODES_AT_ONCE": "16", "PDSTACK_WEIGHTS_WAVES": "3", "PDSTACK_WEIGHTS_WAVE_SECONDS": "642"}
    expected = ((first + group * size + worker) // 16) % 3 * 642
    assert weights.wave_wait_seconds(env) == expected
    assert shell_wait(env, tmp_path) == (0, str(expected))
    assert weights.wave_wait_seconds({}) == 0 and shell_wait({}, tmp_path) == (0, "0")  # a pod in no pool


@pytest.mark.parametrize("bad", ["", "$(touch INJECTED)", "08", "1x", "1234567890", "-1"])
def test_a_wave_setting_that_is_not_a_whole_number_is_refused_by_both_fetchers(tmp_path, bad):
    env = {f"PDSTACK_WEIGHTS_{k}": "1" for k in weights.WAVE_ENV}
    env["PDSTACK_WEIGHTS_GROUP_INDEX"] = bad
    with pytest.raises(weights.WaveSettingsError, match="PDSTACK_WEIGHTS_GROUP_INDEX"):
        weights.wave_wait_seconds(env)
    assert shell_wait(env, tmp_path)[0] == 3
    assert not (tmp_path / "INJECTED").exists()
    with pytest.raises(weights.WaveSettingsError, match="NODES_AT_ONCE"):
        weights.wave_wait_seconds({**env, "PDSTACK_WEIGHTS_GROUP_INDEX": "1", "PDSTACK_WEIGHTS_NODES_AT_ONCE": "0"})


def test_a_node_waits_its_wave_once_before_its_first_get_and_a_warm_cache_waits_for_nothing(
        s3_endpoint, tmp_path, monkeypatch):
    source = tmp_path / "model"
    source.mkdir()
    for i in range(4):
        (source / f"shard-{i}.safetensors").write_bytes(bytes([i]) * 1000)
    s3 = weights.s3_client(s3_endpoint)
    weights.upload(s3, "weights-waves", "m", source)
    slept = []
    monkeypatch.setattr(weights.time, "sleep", slept.append)
    dest = tmp_path / "cache"
    weights.fetch_and_verify(s3, "weights-waves", "m", dest, workers=4, wait_seconds=642)
    assert slept == [642] and len(list(dest.glob("shard-*"))) == 4
    weights.fetch_and_verify(s3, "weights-waves", "m", dest, workers=4, wait_seconds=642)  # a restart: warm
    assert slept == [642]


def test_pdctl_cost_never_flags_the_kernel_cache_as_an_unused_weights_folder():
    from infra.reports.cost import CacheEntry, cache_folders, stale_entries

    spec = variant_spec("prod", "sglang")
    (folder, retention, what, keep), = [f for f in cache_folders(spec) if f[2] == "weights cache"]
    old = 0.0
    entries = [CacheEntry("node-1", jit_cache_host_path(spec).rsplit("/", 1)[0], old),
               CacheEntry("node-1", f"{folder}/an-old-model", old)]
    stale = stale_entries(entries, (retention + 1) * 3600, retention, what, keep)
    assert [s.path for s in stale] == [f"{folder}/an-old-model"]
