"""python -m twin build | up | down | status | supervise (the last one is what `up` starts)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from twin import build, cluster
from twin.api import TwinError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m twin", description=__doc__)
    parser.add_argument("command", choices=("build", "up", "down", "status", "supervise"))
    parser.add_argument("--no-karpenter", action="store_true", help="start without Karpenter")
    parser.add_argument("--lock-fd", type=int, help=argparse.SUPPRESS)  # supervise: the lock `up` took
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            build.build()
        elif args.command == "up":
            cluster.up(with_karpenter=not args.no_karpenter)
        elif args.command == "down":
            cluster.down()
        elif args.command == "status":
            state = cluster.running()
            print(json.dumps(state, indent=1) if state else cluster.not_running())
            return 0 if state else 1
        else:
            lock = cluster.hold_lock() if args.lock_fd is None else args.lock_fd
            return cluster.Supervisor(lock, with_karpenter=not args.no_karpenter).run()
    except subprocess.CalledProcessError as exc:
        print(f"twin: {' '.join(map(str, exc.cmd[:3]))} failed with {exc.returncode}; its output is above",
              file=sys.stderr)
        return 1
    except (TwinError, RuntimeError, OSError) as exc:
        print(f"twin: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
