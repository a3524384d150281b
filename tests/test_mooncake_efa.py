"""dev's P->D hop is Mooncake over EFA (MOONCAKE_PROTOCOL=efa): the engine image's Mooncake must
have the efa transport and honour that protocol, at the release the stack pins, and still offer what
the pinned engines call.

The recipe once built Mooncake v0.3.7 from git with -DUSE_EFA=ON, an option that release does not
have; 0.3.8.post1's Python TransferEngine ignores its protocol argument (kvcache-ai/Mooncake
v0.3.8.post1, mooncake-integration/transfer_engine/transfer_engine_py.cpp, `(void)(protocol);`) and
picks RDMA or TCP by the devices it finds. The efa transport and a binding that honours "efa" appear
in v0.3.10; PyPI publishes the build as `mooncake-transfer-engine-efa` (x86_64, CUDA 12). The recipe
now installs that wheel at the stack's release, and these tests run the same wheel
(twin/kv_libraries.py) in the engines' CPU virtualenv (scripts/extract_engine_flags.py).
"""

from __future__ import annotations

import ast
import json
import subprocess
import zipfile

import pytest

from infra.render.engine_check import variant_spec
from infra.spec import ENGINE_IMAGE_RECIPE, REPO_ROOT, mooncake_release
from twin import kv_libraries as mooncake_efa_wheel
from tests.conftest import script_modules
from tests.servers import require_binary
from tests.test_engine_image import engine_wheel, recipe_args

RECIPE = REPO_ROOT / ENGINE_IMAGE_RECIPE
# What each pinned engine runs of Mooncake where pdstack renders it: SGLang's P->D transfer engine
# (--disaggregation-transfer-backend mooncake) and HiCache store (--hicache-storage-backend
# mooncake); vLLM's MooncakeStoreConnector (deployment.cache.store: mooncake). The receiver each
# file keeps Mooncake's object in, and the class that object is.
ENGINE_FILES = {
    "sglang": ("sglang/srt/distributed/device_communicators/mooncake_transfer_engine.py",
               "sglang/srt/mem_cache/storage/mooncake_store/mooncake_store.py"),
    "vllm": ("vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/worker.py",),
}
RECEIVERS = {"engine": ("mooncake.engine", "TransferEngine"), "store": ("mooncake.store", "MooncakeDistributedStore")}
# Imported only for what pdstack does not render: SGLang's elastic EP over Mooncake
# (--elastic-ep-backend mooncake; the EFA wheel's mooncake.pg is built for other torch releases than
# the CPU virtualenv's) and Mooncake's custom memory pools (SGLANG_MOONCAKE_CUSTOM_MEM_POOL, which
# SGLang refuses with MOONCAKE_PROTOCOL=efa: sglang/srt/disaggregation/mooncake/utils.py).
NOT_RENDERED = ("mooncake.pg.", "mooncake.allocator.")


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory) -> dict:
    """The interpreter and environment that import the recipe's Mooncake."""
    env = mooncake_efa_wheel.unpack(tmp_path_factory.mktemp("mooncake-efa"))
    python = script_modules("extract_engine_flags")[0].engine_venv() / "bin" / "python"
    return {"python": str(python), "env": {"PATH": "/usr/bin:/bin", **env}}


def run(mooncake: dict, code: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([mooncake["python"], "-c", code], input=stdin, env=mooncake["env"], capture_output=True,
                          text=True, timeout=120)


def test_the_recipe_installs_the_efa_build_at_the_stacks_release():
    """One release: the master image's tag (stacks/*.yaml) is the recipe's MOONCAKE_VERSION, and the
    recipe installs PyPI's EFA build at it (no git build of an option the release lacks)."""
    text = RECIPE.read_text()
    assert recipe_args(text).get("MOONCAKE_VERSION") == mooncake_efa_wheel.stack_release(), (
        f"{ENGINE_IMAGE_RECIPE}: ARG MOONCAKE_VERSION={recipe_args(text).get('MOONCAKE_VERSION')}, the stacks' "
        f"images.mooncake_master is tagged v{mooncake_efa_wheel.stack_release()}")
    assert f'"{mooncake_efa_wheel.DIST}==${{MOONCAKE_VERSION}}"' in text
    assert "USE_EFA" not in text and "kvcache-ai/Mooncake" not in text.split("# 3.", 1)[1].split("# 4.", 1)[0]
    assert mooncake_release(variant_spec("dev", "sglang")) == mooncake_efa_wheel.stack_release()


def test_the_efa_build_links_libfabric(tmp_path):
    """engine.so (the transfer engine) and store.so (the store client) link libfabric.so.1, which the
    image takes from AWS's EFA installer (/opt/amazon/efa/lib; the recipe's step 4 checks it with ldd)."""
    readelf = require_binary("readelf")
    with zipfile.ZipFile(mooncake_efa_wheel.efa_wheel()) as z:
        for member in ("mooncake/engine.so", "mooncake/store.so"):
            z.extract(member, tmp_path)
            dynamic = subprocess.run([readelf, "-d", str(tmp_path / member)], capture_output=True, text=True).stdout
            assert "Shared library: [libfabric.so.1]" in dynamic, f"{member}: links no libfabric\n{dynamic}"


PROTOCOL = """
import sys
from mooncake.engine import TransferEngine
print("initialize:", TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", sys.argv[1], ""), flush=True)
"""


def test_protocol_efa_installs_the_efa_transport_and_fails_here_without_an_efa_device(mooncake):
    """kvcache-ai/Mooncake v0.3.13.post1, mooncake-integration/transfer_engine/transfer_engine_py.cpp:
    protocol "efa" installs the EfaTransport (mooncake-transfer-engine/src/transport/efa_transport/),
    which finds no EFA device on this machine and fails initialize (-1) with its own error, instead of
    moving KV over TCP as 0.3.8.post1 did. Any other protocol gets TCP in the EFA build ("auto_discover
    disabled in EFA build"), so the render must say efa (infra/render/fabric.py)."""
    done = subprocess.run([mooncake["python"], "-c", PROTOCOL, "efa"], env=mooncake["env"], capture_output=True,
                          text=True, timeout=120)
    assert "initialize: -1" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "Installing EFA transport as requested by protocol parameter" in done.stderr
    assert "EfaTransport: No available EFA devices" in done.stderr and "Failed to install EFA transport" in done.stderr
    assert "TcpTransport" not in done.stderr
    done = subprocess.run([mooncake["python"], "-c", PROTOCOL, "tcp"], env=mooncake["env"], capture_output=True,
                          text=True, timeout=120)
    assert "initialize: 0" in done.stdout and "TcpTransport: listen" in done.stderr, done.stderr[-3000:]


def mooncake_uses(engine: str) -> dict[str, list[str]]:
    """{"module.Name": [methods]} of Mooncake that the engine's files import and call (`from
    mooncake.X import Y`, and `self.engine.m(...)` / `self.store.m(...)` on the receivers above)."""
    uses: dict[str, set[str]] = {}
    with zipfile.ZipFile(engine_wheel(engine)) as z:
        for member in ENGINE_FILES[engine]:
            tree = ast.parse(z.read(member).decode())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mooncake."):
                    for alias in node.names:
                        if not f"{node.module}.{alias.name}".startswith(NOT_RENDERED):
                            uses.setdefault(f"{node.module}.{alias.name}", set())
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and isinstance(node.func.value, ast.Attribute) and node.func.value.attr in RECEIVERS
                      and isinstance(node.func.value.value, ast.Name) and node.func.value.value.id == "self"):
                    module, name = RECEIVERS[node.func.value.attr]
                    uses.setdefault(f"{module}.{name}", set()).add(node.func.attr)
    return {k: sorted(v) for k, v in uses.items()}


MISSING = """
import importlib, json, sys
missing = []
for qualified, methods in json.load(sys.stdin).items():
    module, name = qualified.rsplit(".", 1)
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        missing.append(f"{qualified}: {exc}")
        continue
    missing += [f"{qualified}.{m}" for m in methods if not hasattr(obj, m)]
print(json.dumps(missing))
"""


@pytest.mark.parametrize("engine", sorted(ENGINE_FILES))
def test_what_the_engine_calls_of_mooncake_is_in_the_efa_build(engine, mooncake):
    """SGLang 0.5.23's MooncakeTransferEngine (initialize, register_memory, batch_register_memory,
    transfer_sync_write, batch_transfer_sync_write, get_rpc_port, ...) and its HiCache store
    (MooncakeDistributedStore, ReplicateConfig, MooncakeHostMemAllocator: setup, put,
    batch_put_from, ...), vLLM 0.33.0's MooncakeStoreConnector (MooncakeDistributedStore,
    ReplicateConfig): each name is imported from the installed wheel and each method is found."""
    uses = mooncake_uses(engine)
    assert any(uses.values()), f"{engine}: no Mooncake call found in {ENGINE_FILES[engine]}; update this test"
    done = run(mooncake, MISSING, json.dumps(uses))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [], f"{engine} calls what the EFA build lacks"
    if engine == "sglang":  # the P->D calls are among those checked
        assert {"initialize", "register_memory", "transfer_sync_write"} <= set(uses["mooncake.engine.TransferEngine"])
