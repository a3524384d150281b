"""The KV transfer libraries of the pinned wheels, unpacked so a process on a machine without a GPU
or an EFA device imports them: what twin/kv_handoff.py runs with, in the engine stand-ins at their
pod addresses (twin/pods.py) and in tests/test_kv_handoff.py.

- Mooncake's EFA build, the wheel the engine image installs (images/engine-efa.Dockerfile step 3):
  PyPI's `mooncake-transfer-engine-efa` at the stack's Mooncake release (the master image's tag,
  infra/spec mooncake_release), its sha256 checked, from scripts/pinned_wheels.py;
- libcudart.so.12 from PyPI's nvidia-cuda-runtime-cu12 at the specs' hardware.cuda_version (12.8);
- libcuda.so.1, which a GPU node's NVIDIA driver supplies: a stand-in compiled here (cc) in which
  every driver function the wheel's libraries import (their ELF imports, `nm -D`, so a new wheel's
  needs follow) answers CUDA_ERROR_NO_DEVICE (100), as the driver does where there is no GPU; only
  Mooncake's libraries find it;
- libfabric.so.1 (EFA provider) and libmlx5.so.1, which the wheel links and the image has (AWS's
  libfabric, rdma-core): Debian's libfabric1 and ibverbs-providers (with what libfabric links),
  fetched once with `apt-get download` into the machine's cache and unpacked beside the wheel's
  own libraries. Not installed on the system: there NIXL's LIBFABRIC plugin would load (its tests
  expect it not to, tests/test_engine_image.py) and UCX with the rdma-core providers crashes NIXL
  1.5.0 at exit.
- NIXL 1.5.0 (the engine image's NIXL_VERSION): `nixl` with its `nixl-cu12`/`nixl-cu13` wheels,
  beside Mooncake. `nixl._api` imports torch: the engines' CPU virtualenv has it.
libibverbs.so.1 is the system's (scripts/install-system-deps).

`environment()` unpacks them once per pin into the machine's cache and gives the environment a
process imports them with: PYTHONPATH, LD_LIBRARY_PATH, and UCX_TLS=tcp (two pods on a cluster
share no memory, so neither do the twin's: UCX would otherwise pick shared memory between two
processes of one machine).
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import shutil
import subprocess
import zipfile
from pathlib import Path

from twin.api import TwinError
from twin.paths import script_module

DIST = "mooncake-transfer-engine-efa"
# PyPI's sha256 of mooncake_transfer_engine_efa-<release>-cp311-cp311-manylinux_2_35_x86_64.whl
SHA256 = {"0.3.13.post1": "4addb0a2857ac3ed0bd5abf5e494e553682efbbed6eac746b777e00bb5022db9"}
CUDART = ("nvidia-cuda-runtime-cu12", "12.8.90")
CUDA_ERROR_NO_DEVICE = 100
# libfabric.so.1 and libmlx5.so.1 for the wheel, and what libfabric links (librdmacm, libefa, psm).
DEBIAN_PACKAGES = ("libfabric1", "ibverbs-providers", "librdmacm1", "libpsm2-2", "libpsm-infinipath1")
NIXL_DISTS = ("nixl", "nixl-cu12", "nixl-cu13")
NIXL_VERSION = "1.5.0"
CPU_ENV = {"UCX_TLS": "tcp"}


def _scripts(*names: str) -> tuple:
    return tuple(script_module(name) for name in names)


def require_binary(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if not path:
        raise TwinError(f"{name} is not installed: run `make test` (scripts/install-system-deps installs it)")
    return path


def stack_release() -> str:
    """The Mooncake release of the committed stacks (every stack runs the same)."""
    from infra.render.engine_check import variant_spec
    from infra.spec import mooncake_release

    (release,) = {mooncake_release(variant_spec(stack, "sglang")) for stack in ("dev", "prod")}
    return release


def efa_wheel() -> Path:
    release = stack_release()
    if release not in SHA256:
        raise TwinError(f"Mooncake {release}: no sha256 of {DIST} pinned in {__file__}")
    (pinned_wheels,) = _scripts("pinned_wheels")
    wheel = pinned_wheels.pinned_wheel(DIST, release)
    if hashlib.sha256(wheel.read_bytes()).hexdigest() != SHA256[release]:
        raise TwinError(f"{wheel} is not the pinned wheel of {DIST} {release} (its sha256 differs)")
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


def debian_libraries(folder: Path) -> None:
    """The shared libraries of DEBIAN_PACKAGES, copied into `folder` (a Mooncake RPATH folder)."""
    (machine_cache,) = _scripts("machine_cache")
    debs = machine_cache.cache_folder("upstream", "PDSTACK_UPSTREAM_CACHE") / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    for package in DEBIAN_PACKAGES:
        if not list(debs.glob(f"{package}_*.deb")):
            done = subprocess.run([require_binary("apt-get"), "download", package], cwd=debs, capture_output=True,
                                  text=True)
            if done.returncode:
                raise TwinError(f"apt-get download {package}: {done.stderr.strip()}. Fix: apt-get update")
    unpacked = folder.parent / "debs"
    for deb in sorted(debs.glob("*.deb")):
        if deb.name.split("_", 1)[0] in DEBIAN_PACKAGES:
            subprocess.run([require_binary("dpkg-deb"), "-x", str(deb), str(unpacked)], check=True)
    readelf = require_binary("readelf")
    for library in unpacked.rglob("lib*.so.*"):  # each under its SONAME (psm's .so.1 is an alternatives link)
        if library.is_symlink() or library.parent.name == "libibverbs":  # rdma-core's providers: no device here
            continue
        dynamic = subprocess.run([readelf, "-d", str(library)], capture_output=True, text=True, check=True).stdout
        soname = re.search(r"Library soname: \[(.+?)\]", dynamic)
        shutil.copy2(library, folder / (soname.group(1) if soname else library.name))


def unpack(folder: Path) -> dict[str, str]:
    """The EFA wheel and libcudart unpacked into `folder` as pip installs them, and the environment
    (PYTHONPATH, LD_LIBRARY_PATH) a Python process imports `mooncake` with."""
    (pinned_wheels,) = _scripts("pinned_wheels")
    for wheel in (efa_wheel(), pinned_wheels.pinned_wheel(*CUDART)):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(folder)
    # The driver stand-in goes beside the wheel's bundled libraries, which engine.so and store.so
    # find by their RPATH ($ORIGIN/../<dist>.libs), not on LD_LIBRARY_PATH: a process that loads no
    # Mooncake (NIXL's, whose CUDA backend would dlopen it) does not see it.
    libs = folder / f"{DIST.replace('-', '_')}.libs"
    driver_standin([folder / "mooncake" / "engine.so", folder / "mooncake" / "store.so"], libs)
    debian_libraries(libs)
    return {"PYTHONPATH": str(folder), "LD_LIBRARY_PATH": str(folder / "nvidia" / "cuda_runtime" / "lib")}


def unpack_nixl(folder: Path) -> None:
    """NIXL's wheels at NIXL_VERSION unpacked into `folder` as pip installs them."""
    (pinned_wheels,) = _scripts("pinned_wheels")
    for wheel in (pinned_wheels.pinned_wheel(dist, NIXL_VERSION) for dist in NIXL_DISTS):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(folder)


def environment() -> dict[str, str]:
    """Both libraries unpacked once per pin into the machine's cache (a second caller waits for the
    first, then finds them), and the environment a process imports them with (the module's docstring)."""
    (machine_cache,) = _scripts("machine_cache")
    folder = machine_cache.cache_folder("upstream", "PDSTACK_UPSTREAM_CACHE") / \
        f"kv-libraries-mooncake{stack_release()}-nixl{NIXL_VERSION}"
    marker = folder / ".unpacked.json"
    with machine_cache.building(folder):
        if not marker.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            unpack_nixl(folder)
            env = unpack(folder)
            marker.write_text(json.dumps(env))
    return {**json.loads(marker.read_text()), **CPU_ENV}



def write_env(path: Path) -> None:
    """environment() as a shell file that exports it (what twin/pods.py's engine shims source)."""
    path.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in environment().items()))
