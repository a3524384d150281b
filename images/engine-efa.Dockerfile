# syntax=docker/dockerfile:1
#
# An engine image that can move KV and NCCL traffic over AWS EFA: the stock SGLang and vLLM
# images carry neither AWS's libfabric (EFA provider) nor aws-ofi-nccl, and their NIXL has only
# its UCX backend. What this adds is what the stack spec declares under images.engines.<kind>
# (efa_libfabric, aws_ofi_nccl, nixl_backends, mooncake_efa); infra/spec.py refuses a spec whose
# image lacks what its fabric and architecture need.
#
# NOT BUILT HERE: pdstack is developed without a container runtime or access to AWS's and
# GitHub's download servers, so this recipe has not been built or run. Build it on each
# architecture you deploy (GB200 nodes are arm64), push it, and put the digests in the stack
# spec (images.engines.<kind>.image and images.platforms):
#
#   docker buildx build --platform linux/amd64 -f images/engine-efa.Dockerfile \
#     --build-arg BASE=docker.io/lmsysorg/sglang@sha256:<digest of the pinned 0.5.23 image> \
#     --build-arg MOONCAKE_EFA=1 -t <registry>/pdstack/sglang-efa:0.5.23 --push .
#   docker buildx build --platform linux/arm64 -f images/engine-efa.Dockerfile \
#     --build-arg BASE=docker.io/vllm/vllm-openai@sha256:<digest of the pinned 0.33.0 image> \
#     -t <registry>/pdstack/vllm-efa:0.33.0 --push .
#
# Versions are build arguments; pin them to the releases you validated (the values below are
# where to start, not versions this project has run).

ARG BASE
FROM ${BASE}

ARG TARGETARCH
ARG EFA_INSTALLER_VERSION=1.43.1
# NIXL: the version the pinned engines need, read from their wheels by tests/test_engine_image.py
# (vLLM 0.33.0 refuses NIXL below 1.5.0, check_nixl_version("1.5.0") in its NIXL connector;
# SGLang 0.5.23's connector imports nixl_thread_sync_t and passes sync_mode=, which NIXL 0.7.1
# lacks, so every scheduler raised at start). The same version is installed twice over: the
# PyPI meta package `nixl` (the import name both engines use) and its CUDA backend built here.
ARG NIXL_VERSION=1.5.0
# NIXL's LIBFABRIC plugin needs libfabric v1.21.0 or later (ai-dynamo/nixl
# src/plugins/libfabric/README.md); step 4 holds the installer's libfabric to it.
ARG NIXL_LIBFABRIC_MIN=1.21.0
# Mooncake: the stack's release, the tag of images.mooncake_master (kvcacheai/mooncake:v<release>),
# so the engines' store clients and transfer engines run the master's release; tests/test_mooncake_efa.py
# checks the two agree. Its efa transport, and a Python binding that honours protocol "efa", exist
# from 0.3.10 on (infra/spec/ refuses mooncake_efa with an older master tag).
ARG MOONCAKE_VERSION=0.3.13.post1
# 1 on x86_64 only: installs Mooncake's EFA build, PyPI's mooncake-transfer-engine-efa (published
# for x86_64 alone, CUDA 12).
ARG MOONCAKE_EFA=0

# 1. AWS's libfabric with the EFA provider and rdma-core, as user-space libraries only: the
#    kernel driver is the node's (the EKS GPU AMI), so no kernel module and no limits file. EFA
#    installers 1.30 and later also install aws-ofi-nccl (/opt/amazon/ofi-nccl), NCCL's plugin
#    for libfabric, which NCCL loads as libnccl-net.so.
RUN set -eux; \
    apt-get update; apt-get install -y --no-install-recommends curl ca-certificates pciutils environment-modules \
        build-essential meson ninja-build pkg-config cmake git; \
    curl -fsSL "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" | tar xz -C /tmp; \
    cd /tmp/aws-efa-installer; ./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify; \
    rm -rf /tmp/aws-efa-installer /var/lib/apt/lists/*
ENV PATH=/opt/amazon/efa/bin:${PATH} \
    LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib:${LD_LIBRARY_PATH}

# 2. NIXL with its LIBFABRIC backend (ai-dynamo/nixl, src/plugins/libfabric), built against the
#    installer's libfabric, beside UCX. This is the P->D path on arm64 (prod, GB200) for both
#    engines: SGLang selects it with SGLANG_DISAGGREGATION_NIXL_BACKEND=LIBFABRIC, vLLM with the
#    NixlConnector's "backends": ["LIBFABRIC"] (pdstack renders both).
#    Both meson runs (the C++ install, and the one pip's meson-python makes for the Python
#    backend) are given AWS's libfabric: without it meson finds the distribution's by pkg-config.
RUN set -eux; \
    libfabric="-Dlibfabric_path=/opt/amazon/efa"; \
    git clone --depth 1 --branch "${NIXL_VERSION}" https://github.com/ai-dynamo/nixl /tmp/nixl; \
    cd /tmp/nixl; \
    meson setup build --prefix=/usr/local/nixl --libdir=lib "${libfabric}"; \
    ninja -C build install; \
    pip install --no-cache-dir --no-deps --force-reinstall -Csetup-args="${libfabric}" . "nixl==${NIXL_VERSION}"; \
    rm -rf /tmp/nixl
# (step 4 fails the build if NIXL does not find its LIBFABRIC plugin here)
ENV NIXL_PLUGIN_DIR=/usr/local/nixl/lib/plugins

# 3. Mooncake's transfer engine with its efa transport (x86_64 only; on arm64 the store runs over
#    TCP and the P->D hop over NIXL, which is what the spec check allows there): PyPI's EFA build at
#    the stack's release, in place of the base image's Mooncake (both install the package `mooncake`).
#    Its engine.so and store.so link libfabric.so.1, found in /opt/amazon/efa/lib (step 1).
RUN set -eux; \
    if [ "${MOONCAKE_EFA}" = "1" ]; then \
      test "${TARGETARCH}" = "amd64" || { echo "Mooncake's EFA build is x86_64 only"; exit 1; }; \
      pip uninstall -y mooncake-transfer-engine mooncake-transfer-engine-non-cuda; \
      pip install --no-cache-dir "mooncake-transfer-engine-efa==${MOONCAKE_VERSION}"; \
    fi

# 4. What the spec will claim, checked where it can be without an EFA device: the libraries are
#    there, the installer's libfabric is one NIXL's plugin accepts, the engines' NIXL agent configs
#    are made and an agent with SGLang 0.5.23's (sync_mode, num_threads), the LIBFABRIC plugin that agent loads
#    links AWS's libfabric (ldd) and its backend is created. A backend that fails with
#    NIXL_ERR_NOT_FOUND ("unsupported backend") is a plugin that did not load (a library it links
#    is missing): that fails the build; any other error is the absent EFA device, which only a node
#    has. (Whether they reach the NICs is the preflight's and the first rollout's to show:
#    `fi_info -p efa` on a node.)
RUN set -eux; \
    test -e /opt/amazon/efa/lib/libfabric.so; \
    ls /opt/amazon/ofi-nccl/lib/libnccl-net*.so; \
    have="$(fi_info --version | sed -n 's/^libfabric: *//p')"; \
    test "$(printf '%s\n' "${NIXL_LIBFABRIC_MIN}" "${have%%[!0-9.]*}" | sort -V | head -n1)" = "${NIXL_LIBFABRIC_MIN}"; \
    plugin="${NIXL_PLUGIN_DIR}/libplugin_LIBFABRIC.so"; \
    ldd "${plugin}"; \
    ldd "${plugin}" | grep -q 'libfabric\.so.* => /opt/amazon/efa/lib'; \
    if [ "${MOONCAKE_EFA}" = "1" ]; then \
      engine="$(python3 -c "import importlib.metadata as m; print([f.locate() for f in m.files('mooncake-transfer-engine-efa') if f.name == 'engine.so'][0])")"; \
      ldd "${engine}" | grep -q 'libfabric\.so.* => /opt/amazon/efa/lib'; \
    fi
# Mooncake's efa transport is there and honoured: protocol "efa" installs the EfaTransport, which
# without an EFA device (a build has none) fails initialize with its own error; a Mooncake without
# it (or one that ignores the protocol, as 0.3.8.post1 did) would install TCP and succeed. The
# driver's libcuda.so.1 is not in a build container: the CUDA toolkit's stub stands for it.
RUN <<'SH'
set -eux
[ "${MOONCAKE_EFA}" = "1" ] || exit 0
mkdir -p /tmp/cuda-stub
ln -s /usr/local/cuda/lib64/stubs/libcuda.so /tmp/cuda-stub/libcuda.so.1
LD_LIBRARY_PATH="/tmp/cuda-stub:${LD_LIBRARY_PATH}" python3 - "${MOONCAKE_VERSION}" 2>/tmp/mooncake-efa.log <<'PY' \
  || { cat /tmp/mooncake-efa.log; exit 1; }
import importlib.metadata, sys
import mooncake.store  # the store client SGLang's HiCache and vLLM's MooncakeStoreConnector import
from mooncake.engine import TransferEngine

assert importlib.metadata.version("mooncake-transfer-engine-efa") == sys.argv[1]
ret = TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", "efa", "")
sys.exit(0 if ret == -1 else f"protocol efa: initialize returned {ret}, not EFA's failure without a device")
PY
grep -q "Installing EFA transport as requested by protocol parameter" /tmp/mooncake-efa.log
grep -q "EfaTransport: No available EFA devices" /tmp/mooncake-efa.log
rm -rf /tmp/cuda-stub /tmp/mooncake-efa.log
SH
RUN python3 - <<'PY'
import importlib.metadata, os
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
from nixl._bindings import nixlNotFoundError

assert importlib.metadata.version("nixl") == os.environ["NIXL_VERSION"], importlib.metadata.version("nixl")
nixl_agent_config(backends=[], capture_telemetry=True)  # vLLM 0.33.0's (kv_connector/v1/nixl/base_worker.py)
config = nixl_agent_config(backends=[], num_threads=8, sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)  # SGLang 0.5.23's
agent = nixl_agent("check", config)
assert "LIBFABRIC" in agent.get_plugin_list(), agent.get_plugin_list()
try:
    agent.create_backend("LIBFABRIC", {})
except nixlNotFoundError:
    raise
except Exception as exc:
    print("LIBFABRIC backend not created without an EFA device:", exc)
PY
