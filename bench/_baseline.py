"""The baseline arm's tree, for the benches that run the working tree against a baseline, each arm in
its own processes with its tree first on ``PYTHONPATH``."""

import contextlib
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def baseline_tree(ref: str, tree: Path | None = None, same: bool = False) -> Iterator[tuple[Path, str]]:
    """``(path, label)`` of the baseline: ``tree`` where given (an unpacked tree, e.g. on a machine
    without the repository's .git); the working tree itself with ``same`` (a smoke run); else
    ``ref`` checked out into a temporary git worktree, removed on exit."""
    if tree is not None:
        yield tree.resolve(), str(tree)
        return
    if same:
        yield REPO, "working tree"
        return
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(base), ref], check=True,
                       capture_output=True)
        try:
            yield base, ref
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], capture_output=True)
