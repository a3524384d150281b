"""Run one rendered engine command line through the pinned engine's own validation. Standalone.

Runs inside the scratch virtualenv that scripts/check_engine_args.py builds (the pinned
sglang / vllm wheels with --no-deps beside torch); it imports nothing from pdstack.

    python probe.py PROFILE_JSON -- <engine argv, model path already mapped to a config dir>

PROFILE_JSON: {"engine": "sglang"|"vllm", "gpu_type": "H100"|"GB200", "gpus_per_node": N,
"probes": {"dense_mlp": {...}}}. Prints one JSON line {"verdict": "pass"|"fail", "detail": ...}.

What runs is the engine's code: SGLang's `prepare_server_args` + `resolve_once` (every
resolution hook) + `check_server_args`; vLLM's `vllm serve` subcommand (`validate`, then
`cmd`, which applies the headless / API-server / LB rules and builds the full engine config
through `create_engine_config`). It stops before any process, socket or GPU kernel starts.

Stand-ins, each because this machine has no GPU (and nothing else is replaced):
- torch.cuda answers device count, capability, name, properties and memory from the
  profile (`GPU_PROFILES`); nvidia-smi on PATH is a script answering the same.
- compiled kernel extensions that need libcuda (sgl_kernel, vllm._C*) import as modules whose
  attributes raise if called; vLLM's torch.ops capability queries answer False, and Python-side
  fake-kernel registrations for ops those extensions would have defined are skipped.
- /sys/class/infiniband lists the node's RDMA devices (the profile's `rdma_devices`, from
  hardware.fabric.devices; preflight checks the real ones on each node).
- vLLM's API-server / engine-process launchers are replaced by "build the engine config, stop".
- Model weights: a config.json with the model's public dimensions (models/), no tensors.
Model-construction check done here by calling the engine's function on the resolved sizes:
SGLang's FP8 block-shape rule for the dense MLP (validate_fp8_block_shape), which runs when
the model is built, not when arguments are parsed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import sys
import types

GPU_PROFILES = {
    "H100": {"name": "NVIDIA H100 80GB HBM3", "cap": (9, 0), "mem_gib": 80, "sms": 132},
    "H200": {"name": "NVIDIA H200", "cap": (9, 0), "mem_gib": 141, "sms": 132},
    "B200": {"name": "NVIDIA B200", "cap": (10, 0), "mem_gib": 180, "sms": 148},
    "GB200": {"name": "NVIDIA GB200", "cap": (10, 0), "mem_gib": 186, "sms": 152},
}

VLLM_EXTENSIONS = ("vllm._C", "vllm._C_stable_libtorch", "vllm._moe_C", "vllm._moe_C_stable_libtorch",
                   "vllm._flashmla_C", "vllm._flashmla_extension_C", "vllm.cumem_allocator", "vllm._deepselect_C",
                   "vllm._flashkda_C", "vllm._qutlass_C", "vllm.fs_io_C", "vllm.spinloop",
                   "vllm.vllm_flash_attn._vllm_fa2_C", "vllm.vllm_flash_attn._vllm_fa3_C")
TORCH_OP_NAMESPACES = ("_C", "_moe_C", "_C_cache_ops", "_C_custom_ar")


class Stop(Exception):
    """Validation is over; the engine would now start processes."""


def answer_gpu_queries(gpu_type: str, gpus_per_node: int) -> None:
    import torch

    p = GPU_PROFILES[gpu_type]
    total = p["mem_gib"] << 30
    props = types.SimpleNamespace(name=p["name"], major=p["cap"][0], minor=p["cap"][1], total_memory=total,
                                  multi_processor_count=p["sms"], L2_cache_size=50 << 20, gcnArchName="",
                                  uuid="GPU-standin", warp_size=32, regs_per_multiprocessor=65536,
                                  max_threads_per_multi_processor=2048)
    c = torch.cuda
    c.is_available = lambda: True
    c.device_count = lambda: gpus_per_node
    c._device_count_nvml = lambda: gpus_per_node
    torch.accelerator.device_count = lambda: gpus_per_node
    c.get_device_capability = lambda device=None: p["cap"]
    c.get_device_name = lambda device=None: p["name"]
    c.get_device_properties = lambda device=None: props
    c.mem_get_info = lambda device=None: (total, total)
    c.is_initialized = lambda: True
    c.current_device = lambda: 0
    c.set_device = lambda d: None
    c.is_bf16_supported = lambda *a, **k: True


def answer_rdma_sysfs(devices: list[str]) -> None:
    import os

    sysfs = "/sys/class/infiniband"
    isdir, listdir = os.path.isdir, os.listdir
    os.path.isdir = lambda path: bool(devices) if str(path) == sysfs else isdir(path)
    os.listdir = lambda path=".": list(devices) if str(path) == sysfs else listdir(path)


class _Kernel:
    def __init__(self, name):
        self._name = name

    def __call__(self, *a, **k):
        raise RuntimeError(f"stand-in kernel {self._name} called")

    def __getattr__(self, item):
        return _Kernel(f"{self._name}.{item}")

    def __mro_entries__(self, bases):
        return (object,)


class _KernelModule(types.ModuleType):
    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Kernel(f"{self.__name__}.{item}")


class _KernelFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = roots

    def find_spec(self, name, path, target=None):
        if any(name == r or name.startswith(r + ".") for r in self.roots):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _KernelModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def stand_in_extensions(*roots: str) -> None:
    sys.meta_path.insert(0, _KernelFinder(set(roots)))


def stand_in_torch_ops(namespaces) -> None:
    import functools

    import torch._ops as ops
    import torch.library as lib

    original = ops._OpNamespace.__getattr__

    def getattr_(self, name):
        try:
            return original(self, name)
        except AttributeError:
            if self.name in namespaces:
                return lambda *a, **k: False
            raise

    ops._OpNamespace.__getattr__ = getattr_

    def tolerate(fn):
        @functools.wraps(fn)
        def wrapper(qualname, *a, **k):
            if isinstance(qualname, str) and qualname.split("::")[0] in namespaces:
                return None if a and callable(a[-1]) else (lambda f=None, *aa, **kk: f)
            return fn(qualname, *a, **k)
        return wrapper

    for attr in ("impl", "register_fake", "register_kernel", "register_autograd"):
        setattr(lib, attr, tolerate(getattr(lib, attr)))


def check_sglang(argv: list[str], probes: dict) -> dict:
    """SGLang's own resolution and checks; returns what it resolved that pdstack relies on."""
    stand_in_extensions("sgl_kernel")
    from sglang.srt.server_args import prepare_server_args

    from sglang.srt.arg_groups.overrides import resolution_result

    server_args = prepare_server_args(argv)
    server_args.resolve_once()
    server_args.check_server_args()
    dense = probes.get("dense_mlp")
    if dense:
        check_sglang_dense_mlp(server_args, dense)
    return {"kv_page_size": resolution_result(server_args, "page_size")}


def check_sglang_dense_mlp(server_args, dense: dict) -> None:
    """The dense MLP's FP8 block check, with the TP split the resolved arguments give it."""
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.layers.quantization.fp8_utils import validate_fp8_block_shape

    tp = resolution_result(server_args, "tp_size")
    fully_dp = resolution_result(server_args, "moe_dense_tp_size") == 1
    split = 1 if fully_dp else tp
    layer = types.SimpleNamespace(tp_group=types.SimpleNamespace(world_size=split))
    width, hidden, block = dense["intermediate_size"], dense["hidden_size"], dense["block"]
    # gate_up_proj: column-parallel, two merged outputs; down_proj: row-parallel.
    validate_fp8_block_shape(layer, hidden, 2 * width, hidden, [width // split] * 2, [block, block])
    validate_fp8_block_shape(layer, width, hidden, width // split, [hidden], [block, block])


def check_vllm(argv: list[str]) -> dict:
    """`vllm serve`'s validation through create_engine_config; returns what it resolved."""
    stand_in_extensions(*VLLM_EXTENSIONS)
    stand_in_torch_ops(TORCH_OP_NAMESPACES)
    import vllm.platforms as platforms
    from vllm.platforms.cuda import CudaPlatform

    platforms.current_platform = CudaPlatform()
    import vllm.entrypoints.cli.serve as serve
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    resolved: dict = {}
    create_engine_config = AsyncEngineArgs.create_engine_config

    def recording_create_engine_config(self, *a, **k):
        # Both paths build the config here: the API server's, and run_headless's for workers.
        config = create_engine_config(self, *a, **k)
        resolved["kv_page_size"] = config.cache_config.block_size
        return config

    AsyncEngineArgs.create_engine_config = recording_create_engine_config

    def build_config_then_stop(args, headless=False):
        AsyncEngineArgs.from_cli_args(args).create_engine_config(
            usage_context=UsageContext.OPENAI_API_SERVER, headless=headless)
        raise Stop

    class NoProcess:
        def __init__(self, *a, **k):
            raise Stop  # run_headless built its config before starting engine processes

    parser = FlexibleArgumentParser(prog="vllm")
    command = serve.ServeSubcommand()
    command.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", *argv])
    serve.CoreEngineProcManager = NoProcess
    serve.MultiprocExecutor = NoProcess
    serve.run_multi_api_server = build_config_then_stop
    serve.run_dp_supervisor = build_config_then_stop
    serve.uvloop = types.SimpleNamespace(run=lambda coro: (coro.close(), build_config_then_stop(args)))
    command.validate(args)
    try:
        command.cmd(args)
    except Stop:
        return resolved
    raise RuntimeError("vllm serve returned without building an engine config")


def main() -> int:
    profile = json.loads(sys.argv[1])
    argv = sys.argv[sys.argv.index("--") + 1:]
    answer_gpu_queries(profile["gpu_type"], profile["gpus_per_node"])
    answer_rdma_sysfs(profile.get("rdma_devices", []))
    try:
        if profile["engine"] == "sglang":
            resolved = check_sglang(argv, profile.get("probes", {}))
        else:
            resolved = check_vllm(argv)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the verdict is what failed, reported
        lines = [line.strip() for line in f"{type(exc).__name__}: {exc}".splitlines()
                 if line.strip() and "errors.pydantic.dev" not in line]
        print(json.dumps({"verdict": "fail", "detail": lines[-1][:500] if lines else type(exc).__name__}))
        return 0
    print(json.dumps({"verdict": "pass", "detail": "", "resolved": resolved}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
