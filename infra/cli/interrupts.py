"""What a Ctrl-C is to pdctl, for both of its boundaries: the entry point (this package's
`main`, while pdctl starts) and the commands' (`run`). Standard library only, like the package
itself: it is imported before anything can catch a Ctrl-C."""

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command Ctrl-C stopped


def caused_by_interrupt(exc: BaseException | None) -> bool:
    """A Ctrl-C that reached pdctl inside a library that turned it into an error of its own.
    pydantic-core, building a model's serializer when the signal arrives, reports it as a
    SchemaError whose text ends in "KeyboardInterrupt:" and chains nothing (seen by
    tests/test_cli.py's Ctrl-C test under another timing); other wrappers chain it."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, KeyboardInterrupt):
            return True
        if type(exc).__module__.startswith("pydantic_core") and "KeyboardInterrupt" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
