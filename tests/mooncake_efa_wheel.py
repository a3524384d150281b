"""Mooncake's EFA build, the wheel the engine image installs (images/engine-efa.Dockerfile step 3),
unpacked so a machine without a GPU or an EFA device runs it (tests/test_mooncake_efa.py,
tests/test_kv_handoff.py):

- PyPI's `mooncake-transfer-engine-efa` at the stack's Mooncake release (the master image's tag,
  infra/spec mooncake_release), its sha256 checked, from scripts/pinned_wheels.py;
- libcudart.so.12 from PyPI's nvidia-cuda-runtime-cu12 at the specs' hardware.cuda_version (12.8);
- libcuda.so.1, which a GPU node's NVIDIA driver supplies: a stand-in compiled here (cc) in which
  every driver function the wheel's libraries import (their ELF imports, `nm -D`, so a new wheel's
  needs follow) answers CUDA_ERROR_NO_DEVICE (100), as the driver does where there is no GPU;
- libfabric.so.1 (EFA provider), libibverbs, libmlx5 and libefa from the system (Debian's libfabric1
  and ibverbs-providers: scripts/install-system-deps). The image has AWS's libfabric instead.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import zipfile
from pathlib import Path

from infra.render.engine_check import variant_spec
from infra.spec import mooncake_release
from tests.conftest import script_modules
from tests.servers import require_binary

DIST = "mooncake-transfer-engine-efa"
# PyPI's sha256 of mooncake_transfer_engine_efa-<release>-cp311-cp311-manylinux_2_35_x86_64.whl
SHA256 = {"0.3.13.post1": "4addb0a2857ac3ed0bd5abf5e494e553682efbbed6eac746b777e00bb5022db9"}
CUDART = ("nvidia-cuda-runtime-cu12", "12.8.90")
CUDA_ERROR_NO_DEVICE = 100


def stack_release() -> str:
    """The Mooncake release of the committed stacks (every stack runs the same)."""
    (release,) = {mooncake_release(variant_spec(stack, "sglang")) for stack in ("dev", "prod")}
    return release


def efa_wheel() -> Path:
    release = stack_release()
    assert release in SHA256, f"Mooncake {release}: no sha256 of {DIST} pinned in {__file__}"
    (pinned_wheels,) = script_modules("pinned_wheels")
    wheel = pinned_wheels.pinned_wheel(DIST, release)
    assert hashlib.sha256(wheel.read_bytes()).hexdigest() == SHA256[release], f"{wheel} is not the pinned wheel"
    return wheel


def driver_standin(libraries: list[Path], folder: Path) -> Path:
    """A libcuda.so.1 in `folder` defining each cu* function `libraries` import, each answering
    CUDA_ERROR_NO_DEVICE (cuGetErrorString names it)."""
    nm, cc = require_binary("nm"), require_binary("cc")
    folder.mkdir(parents=True, exist_ok=True)
    wanted = set()
    for library in libraries:
        out = subprocess.run([nm, "-D", "--undefined-only", str(library)], capture_output=True, text=True, check=True)
        wanted |= set(re.findall(r"\bcu[A-Z]\w*", out.stdout))  # the driver API's (cudart's are cuda*)
    wanted.discard("cuGetErrorString")
    source = folder / "cuda_standin.c"
    source.write_text('int cuGetErrorString(int e, const char **s) { *s = "no CUDA device (pdstack test stand-in)"; '
                      'return 0; }\n' + "".join(f"int {name}() {{ return {CUDA_ERROR_NO_DEVICE}; }}\n"
                                                for name in sorted(wanted)))
    subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(folder / "libcuda.so.1"),
                    str(source)], check=True, capture_output=True)
    return folder


def unpack(folder: Path) -> dict[str, str]:
    """The EFA wheel and libcudart unpacked into `folder` as pip installs them, and the environment
    (PYTHONPATH, LD_LIBRARY_PATH) a Python process imports `mooncake` with."""
    (pinned_wheels,) = script_modules("pinned_wheels")
    for wheel in (efa_wheel(), pinned_wheels.pinned_wheel(*CUDART)):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(folder)
    driver = driver_standin([folder / "mooncake" / "engine.so", folder / "mooncake" / "store.so"], folder / "driver")
    return {"PYTHONPATH": str(folder),
            "LD_LIBRARY_PATH": f"{driver}:{folder / 'nvidia' / 'cuda_runtime' / 'lib'}"}
