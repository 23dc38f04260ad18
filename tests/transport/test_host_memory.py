"""keep_freed_memory: a large temporary allocated again after being freed reuses the heap's
pages instead of page-faulting fresh ones (counted in a child process: the setting is global)."""

import subprocess
import sys

CHILD = r"""
import resource, sys, torch
from rlcli.transport.host_memory import keep_freed_memory

def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        x = torch.ones(16 * 2**20)  # 64 MiB, written: every page touched
        del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default = [faults() for _ in range(2)][-1]
if not keep_freed_memory():
    print("skip")
    sys.exit()
print(default, [faults() for _ in range(4)][-1])  # the first rounds grow the heap
"""


def test_a_freed_large_temporary_is_reused_without_page_faults():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout.split()
    if out == ["skip"]:
        import pytest

        pytest.skip("this C library has no mallopt")
    default, kept = map(int, out)
    assert default > 5 * 10_000  # 64 MiB is 16k pages: each allocation faulted them in again
    assert kept < 1_000
