"""GPU hosts for tests: real sshd processes on 127.0.0.1 with stub GPU tools on their PATH."""

from __future__ import annotations

import getpass
from pathlib import Path

import yaml


def write_stubs(folder: Path, driver="570.133.20", gpus=8, cuda="12.8", active=("mlx5_0", "mlx5_1"),
                ntp="yes", hang=False, toolkit="1.17.8") -> Path:
    """Shell stand-ins for the tools a GPU node has, printing what the real ones print."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = "\\n".join(f"{driver}, NVIDIA H100 80GB HBM3" for _ in range(gpus))
    hang_line = "sleep 60\n" if hang else ""
    (folder / "nvidia-smi").write_text(
        "#!/bin/sh\n" + hang_line +
        f'case "$1" in --query-gpu=*) printf "{rows}\\n";; '
        f'*) echo "| NVIDIA-SMI {driver}   Driver Version: {driver}   CUDA Version: {cuda}     |";; esac\n')
    devinfo = "".join(
        f"hca_id:\t{d}\n\ttransport:\t\t\tInfiniBand (0)\n\t\tport:\t1\n\t\t\tstate:\t\t\t"
        f"{'PORT_ACTIVE (4)' if d in active else 'PORT_DOWN (1)'}\n\n" for d in ("mlx5_0", "mlx5_1"))
    (folder / "ibv_devinfo").write_text(f"#!/bin/sh\nprintf '{devinfo}'\n")
    (folder / "timedatectl").write_text(f"#!/bin/sh\necho {ntp}\n")
    if toolkit:  # nvidia-ctk --version, as NVIDIA Container Toolkit's CLI prints it
        (folder / "nvidia-ctk").write_text(f"#!/bin/sh\necho 'NVIDIA Container Toolkit CLI version {toolkit}'\n"
                                           "echo 'commit: 0000000'\n")
    for f in folder.iterdir():
        f.chmod(0o755)
    return folder


def inventory(tmp_path: Path, client_key, host_ports: dict[str, int], known: dict[int, str], **extra) -> Path:
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("".join(f"[127.0.0.1]:{port} {' '.join(key.split()[:2])}\n" for port, key in known.items()))
    data = {"user": getpass.getuser(), "key_file": str(client_key[0]), "known_hosts": "known_hosts",
            "timeout_seconds": 3, "min_free_disk_gib": 0.001, "max_clock_offset_ms": 5000,
            "hosts": [{"name": name, "address": "127.0.0.1", "port": port} for name, port in host_ports.items()], **extra}
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


