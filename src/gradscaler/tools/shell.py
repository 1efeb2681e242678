"""How the user runs ``gradscaler`` again from their own shell: the commands the tools print must paste.

``make demo`` runs ``.venv/bin/gradscaler`` without putting ``.venv/bin`` on the shell's PATH, so a hint
that says ``gradscaler report ...`` fails there ("command not found"). ``command()`` names the
program as this shell can run it. Standard library only: the command line's help uses it too.
"""

from __future__ import annotations

import shlex
import shutil
import sys
from pathlib import Path


def command(cwd: Path | None = None, path: str | None = None) -> str:
    """The shortest way to run ``gradscaler`` from ``cwd`` (default: the current folder) that works.

    * ``gradscaler`` when the first ``gradscaler`` on PATH (``path``, default ``$PATH``) is the one
      installed beside this interpreter (an activated venv, a user install);
    * else that script's path, relative to ``cwd`` when it lies below it (``.venv/bin/gradscaler``
      after ``make demo`` in a clone), absolute otherwise;
    * else ``<this interpreter> -m gradscaler`` (run from a source tree, no script installed).
    """
    here = Path.cwd() if cwd is None else cwd
    script = Path(sys.executable).with_name("gradscaler")
    found = shutil.which("gradscaler", path=path)
    if found is not None and script.exists() and Path(found).resolve() == script.resolve():
        return "gradscaler"
    if script.exists():
        return _relative(script, here)
    return f"{shlex.quote(sys.executable)} -m gradscaler"


def python(cwd: Path | None = None, path: str | None = None) -> str:
    """The shortest way to run this interpreter from ``cwd``, for a hint such as ``python3 -c '...'``.

    * ``python3`` (or ``python``) when that name on PATH (``path``, default ``$PATH``) lies beside this
      interpreter (an activated venv; a fresh shell often has no ``python`` at all);
    * else this interpreter's path, relative to ``cwd`` when it lies below it (``.venv/bin/python`` after
      ``make demo`` in a clone), absolute otherwise.
    """
    here = Path.cwd() if cwd is None else cwd
    interpreter = Path(sys.executable)
    for name in ("python3", "python"):
        found = shutil.which(name, path=path)
        if found is not None and Path(found).absolute().parent == interpreter.absolute().parent:
            return name
    return _relative(interpreter, here)


def _relative(program: Path, here: Path) -> str:
    """``program`` as a shell word: relative to ``here`` when below it, absolute otherwise."""
    try:
        shown = str(program.absolute().relative_to(here.absolute()))
    except ValueError:
        shown = str(program.absolute())
    return shlex.quote(shown if "/" in shown else f"./{shown}")  # a bare name would be looked up on PATH


def quoted(path: Path | str) -> str:
    """``path`` as a shell word."""
    return shlex.quote(str(path))
