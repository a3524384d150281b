"""`pdctl`, the operator's command line, one module per command (or tight group):

- `run`: the parser and the one error boundary (messages, exit codes, --debug);
- `common`: the consoles, the json/yaml emitter, tables, exit codes and spec-path resolution;
- one module per command: `validate`, `preview`, `render`, `eplb`, `plan`, `preflight`,
  `rollout` (rollout and rollback), `canary`, `releases`, `cost`, `policy`,
  `validate_deployment`, `diff`. Each registers its own options and stays a thin shell over `infra`.

This module imports nothing but the standard streams and `interrupts` (standard library only,
shared with `run`): the console script imports it before anything can catch a Ctrl-C, so
everything slow (rich, pydantic, the commands) is imported inside `main`, where an interrupt is
one line and exit 130.
"""

import os
import sys

from infra.cli.interrupts import EXIT_INTERRUPTED, caused_by_interrupt


def _open_standard_fds() -> None:
    """A standard descriptor that is closed (`pdctl validate >&-`) is opened on /dev/null, as git
    does before anything else (git setup.c sanitize_stdfds): Python would leave sys.stdout None,
    and the next file pdctl opened would get descriptor 1, so that output, and any child's,
    would land in it."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            opened = os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: this one
            if opened != fd:
                os.dup2(opened, fd)
                os.close(opened)
    if sys.stdout is None:
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - the process's own stdout
    if sys.stderr is None:
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115


def _say_interrupted() -> int:
    try:
        os.write(2, b"interrupted\n")
    except OSError:
        pass
    return EXIT_INTERRUPTED


def _interrupt_python_could_not_raise(unraisable) -> None:
    """A Ctrl-C that lands while Python runs a callback of its own (a weakref's, such as the one
    importlib's module locks use, or a finalizer) cannot be raised: Python prints "Exception
    ignored in ..." with a traceback and goes on as if no key was pressed. pdctl stops there
    instead, as Ctrl-C anywhere else would: one line, exit 130. Leaving at once is safe because
    everything that changes an environment is crash-safe (tests/test_fault_matrix.py kills the
    rollout at every point where it writes). Anything else keeps Python's own report."""
    if issubclass(unraisable.exc_type, KeyboardInterrupt):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(_say_interrupted())
    sys.__unraisablehook__(unraisable)


# Python's cycle collector, as a short-lived command needs it. By default a collection starts
# every 700 new container objects, and each third of those looks at everything older too: a
# preview (megabytes of CRD schema as dicts, Pulumi's outputs, pydantic's models) spent a third
# of its time there, and the interpreter's exit, which collects again as it unloads every
# module, another fifth: gc.freeze, once the last atexit handler has run, leaves what is still
# alive out of those (it is freed as modules unload all the same; only cycles among it are left
# to the process's end). mypy sets a threshold of this size in its own main for the same
# reason. Memory did not grow (peak RSS of platform-prod's preview: 263 MB either way).
GC_THRESHOLD = (50_000, 10, 10)


def _tune_collector() -> None:
    import atexit  # here, not at the top: importing this package loads nothing but itself
    import gc

    if gc.get_threshold() != GC_THRESHOLD:  # once per process (tests call main many times)
        gc.set_threshold(*GC_THRESHOLD)
        atexit.register(gc.freeze)  # registered first, so it runs last


def main(argv: list[str] | None = None) -> int:
    """The entry point (`pdctl = infra.cli:main`): the commands' boundary is `infra.cli.run.run`."""
    _tune_collector()
    try:
        sys.unraisablehook = _interrupt_python_could_not_raise
        _open_standard_fds()
        from infra.cli.run import run

        return run(argv)
    except KeyboardInterrupt:  # while pdctl starts (imports, parsing), before run's own boundary
        return _say_interrupted()
    except Exception as exc:  # a model class built during the imports, the signal wrapped (caused_by_interrupt)
        if not caused_by_interrupt(exc):
            raise
        return _say_interrupted()
