"""One table from exceptions to a one-line message and an exit code.

Exit codes: 0 ok, 1 runtime failure, 2 usage or config error. Set ``RLCLI_DEBUG=1`` to
get the traceback instead.
"""

import functools
import hashlib
import os
import sys
import tempfile
from typing import Callable

import typer

from rlcli.errors import RLCLIError

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def _describe(exc: BaseException) -> tuple[str, int]:
    if isinstance(exc, RLCLIError):
        return str(exc), exc.exit_code
    if isinstance(exc, FileNotFoundError):
        return f"file not found: {exc.filename}", EXIT_USAGE
    if isinstance(exc, PermissionError):
        return f"permission denied: {exc.filename}", EXIT_FAILURE
    if isinstance(exc, ImportError):
        return f"{exc} (an optional dependency is missing; see README)", EXIT_FAILURE
    if isinstance(exc, MemoryError):
        return "out of memory; lower the batch or model size", EXIT_FAILURE
    return f"{type(exc).__name__}: {exc} (set RLCLI_DEBUG=1 for the traceback)", EXIT_FAILURE


_SAID = "rlcli-error-"
SAID_KEEP_S = 3600.0
"""How long a marker of first_to_say stays: the ranks of one torchrun job hit their errors within it."""


def _prune_said(tmp: str) -> None:
    """Remove first_to_say's markers older than SAID_KEEP_S (their jobs have ended)."""
    import time

    old = time.time() - SAID_KEEP_S
    try:
        for entry in os.scandir(tmp):
            if entry.name.startswith(_SAID):
                try:
                    if entry.stat().st_mtime < old:
                        os.unlink(entry.path)
                except OSError:
                    pass  # another rank removed it, or it is not ours
    except OSError:
        pass


def first_to_say(message: str) -> bool:
    """Whether this process should print a usage error: always, except under torchrun, where
    every rank of a node often hits the same one and only the first of them says it (an empty
    file per message and torchrun agent, created exclusively in the temp directory; the one that
    creates a marker removes those older than an hour). An error that only some ranks hit (a rank
    holding no row) still shows, from one of them."""
    if "RANK" not in os.environ or "LOCAL_RANK" not in os.environ:
        return True
    agent = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}|{os.getppid()}|{os.environ.get('MASTER_PORT', '')}"
    key = hashlib.sha1(f"{agent}\0{message}".encode()).hexdigest()[:20]
    tmp = tempfile.gettempdir()
    try:
        os.close(os.open(os.path.join(tmp, f"{_SAID}{key}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        _prune_said(tmp)
        return True
    except FileExistsError:
        return False
    except OSError:  # no writable temp directory: rank 0 speaks, as before
        return os.environ.get("RANK", "0") == "0"


def handle_errors(command: str) -> Callable:
    """Decorate a typer command so errors print one line on stderr and set the exit code."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except (typer.Exit, typer.Abort, SystemExit):
                raise
            except KeyboardInterrupt:
                raise typer.Exit(130) from None
            except Exception as exc:
                if os.environ.get("RLCLI_DEBUG"):
                    raise
                message, code = _describe(exc)
                if code != EXIT_USAGE or first_to_say(message):
                    print(f"{command}: error: {message}", file=sys.stderr, flush=True)
                    from rlcli.logging import log_error_line

                    log_error_line(f"{command}: error: {message}")
                raise typer.Exit(code) from None

        return inner

    return wrap
