"""Write the files a generator derives from upstream, or compare them with the committed ones.

Why: every generator of an upstream-derived file (upstream/PROVENANCE.json lists them) runs in
`make test` with `--check`; one way to compare and to say what differs and how to fix it.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def shown(path: Path) -> str:
    full = path.resolve()
    return full.relative_to(ROOT).as_posix() if full.is_relative_to(ROOT) else str(path)


def write_or_check(files: dict[Path, str], check: bool, source: str, fix: str) -> int:
    """With `check`: one line per file, whether it matches `source`; exit status 1 if any differs
    (or is missing). Without: write each file. Returns the exit status."""
    stale = 0
    for path, text in files.items():
        if check:
            same = path.is_file() and path.read_text() == text
            stale += not same
            print(f"{shown(path)}: {'matches' if same else 'differs from'} {source}" + ("" if same else f". Fix: {fix}"))
        else:
            path.write_text(text)
            print(f"wrote {shown(path)}")
    return 1 if stale else 0
