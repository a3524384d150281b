"""`pdctl`: the operator's command line. Each subcommand is a thin shell over `infra`."""

from __future__ import annotations

import argparse
import io
import os
import sys
from contextlib import contextmanager

from rich.markup import escape

from infra.cli import (canary, cost, diff, eplb, images, plan, policy, preflight, preview, releases, render, rollout,
                       validate, validate_deployment)
from infra.cli.common import EXIT_FAILED, EXIT_REFUSED, err_console
from infra.cli.interrupts import EXIT_INTERRUPTED, caused_by_interrupt
from infra.inputs import InputError
from infra.spec import SpecError

# In the order `pdctl --help` lists them.
COMMANDS = (validate.register, preview.register, render.register, eplb.register, plan.register, preflight.register,
            rollout.register_rollout, canary.register, rollout.register_rollback, cost.register, policy.register,
            validate_deployment.register, diff.register, releases.register, images.register)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdstack")
    except PackageNotFoundError:  # run from a checkout that was not installed
        return "unknown (not installed: run `make setup`)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdctl", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an unexpected error")
    parser.add_argument("--version", action="version", version=f"pdctl (pdstack) {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for register in COMMANDS:
        register(sub)
    return parser


class _Reader:
    """A standard stream whose reader may go away (`pdctl ... | head`): the first write that
    finds the pipe broken (EPIPE) sends the descriptor to /dev/null and every later write goes
    there too, silently, as well-behaved tools end on a closed pipe. The command itself goes on:
    a rollout whose log reader died must still end with traffic on a judged revision, so output
    is never a reason to stop one half way (rich's own handling would raise SystemExit)."""

    def __init__(self, stream):
        self._stream = stream
        self._gone = False

    def _drop(self) -> None:
        self._gone = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())  # what is still buffered, and any child, goes there
            os.close(devnull)
        except (OSError, ValueError, io.UnsupportedOperation):
            pass

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._drop()
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._drop()

    def __getattr__(self, name):  # isatty, fileno, encoding: the stream's own
        return getattr(self._stream, name)


@contextmanager
def _readers_may_leave():
    stdout, stderr = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Reader(stdout), _Reader(stderr)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = stdout, stderr


def run(argv: list[str] | None = None) -> int:
    """One boundary: expected failures become a message and an exit code (2 input, 1 a check
    failed, 3 refused); anything else a short line, and the traceback only with --debug."""
    with _readers_may_leave():
        return _run(argv)


def _run(argv: list[str] | None) -> int:
    from infra.prometheus import PrometheusError
    from infra.rollout.objectstore import StoreUnavailable
    from infra.rollout.releases import ReleaseError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (SpecError, InputError) as exc:
        err_console.print(f"[red]{escape(str(exc))}[/red]", highlight=False, soft_wrap=True)
        return 2
    except OSError as exc:  # a disk that is full, read-only or gone, while writing an output
        where = exc.filename or "a file"
        err_console.print(f"[red]cannot write {escape(str(where))}: {escape(exc.strerror or str(exc))}. Fix: check "
                          "the disk and the path, then run again[/red]", highlight=False, soft_wrap=True)
        return EXIT_FAILED
    except (PrometheusError, StoreUnavailable) as exc:
        err_console.print(f"[red]{escape(str(exc))}[/red]", highlight=False, soft_wrap=True)
        return EXIT_FAILED
    except ReleaseError as exc:  # e.g. a corrupt record, read by `releases`
        err_console.print(f"[red]{escape(str(exc))}[/red]", highlight=False, soft_wrap=True)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - the boundary: no traceback reaches a user without --debug
        if caused_by_interrupt(exc):
            err_console.print("interrupted")
            return EXIT_INTERRUPTED
        if args.debug:
            raise
        err_console.print(f"[red]unexpected error: {type(exc).__name__}: {escape(str(exc))}[/red] "
                          "(run again with --debug for the traceback)", highlight=False, soft_wrap=True)
        return EXIT_FAILED


