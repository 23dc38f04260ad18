"""One rich console on stderr for logs and live tables; stdout stays for data.

Only rank 0 of a torchrun job logs; other ranks print errors only (and no Python warnings).
A process that joins a run directory also appends its log lines, and its closing error line,
to RUN/logs/<command>-<id>.log (``log_to_file``), unless its stderr already goes there.
"""

import logging
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.logging import RichHandler

console = Console(stderr=True, highlight=False, soft_wrap=True)

_configured = False
_name = "rlcli"
_file: logging.FileHandler | None = None


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def setup_logging(name: str, level: str | None = None) -> logging.Logger:
    """Configure the root logger once (rich on a terminal, plain lines in log files)."""
    global _configured, _name
    if not _configured:
        _name = name
        level = level or os.environ.get("RLCLI_LOG_LEVEL", "INFO")
        if rank() != 0:
            level = "ERROR"
            import warnings

            warnings.filterwarnings("ignore")
        if sys.stderr.isatty():
            handler: logging.Handler = RichHandler(console=console, show_path=False, rich_tracebacks=False,
                                                   log_time_format="[%X]")
            fmt = f"{name}: %(message)s"
        else:
            handler = logging.StreamHandler(sys.stderr)
            fmt = f"%(asctime)s {name} %(levelname)s %(message)s"
        handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
        logging.basicConfig(level=level, handlers=[handler], force=True)
        _configured = True
    return logging.getLogger(f"rlcli.{name}")


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def log_to_file(path: Path, name: str) -> Path | None:
    """Append this process's log records to ``path`` as plain lines, from now on; returns the path,
    or None where nothing was attached: stderr already goes to that file (``rl-orchestrate up`` and
    the Slurm scripts send their children's output there), the process is not rank 0, or a file
    is attached already. ``name`` names the process in each line where logging is not set up yet."""
    global _file
    setup_logging(name)  # first: configuring the root logger later would close this file's handler
    if _file is not None or rank() != 0:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if _same_file(2, path):
        return None
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter(f"%(asctime)s {_name} %(levelname)s %(message)s", datefmt="%H:%M:%S"))
    logging.getLogger().addHandler(handler)
    _file = handler
    return path


def log_error_line(line: str) -> None:
    """Write a closing error line (already printed on stderr) to the attached log file, if any."""
    if _file is not None:
        _file.acquire()
        try:
            _file.stream.write(line + "\n")
            _file.flush()
        except (OSError, ValueError):
            pass
        finally:
            _file.release()
