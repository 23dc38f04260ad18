"""`rl-train --nproc-per-node N`: re-execute the same command under torchrun.

``rl-train`` is a torchrun program: started by torchrun (RANK / WORLD_SIZE / LOCAL_RANK
set), every rank runs the trainer. Given ``--nproc-per-node``, a plain ``rl-train``
replaces itself (exec, so signals reach torchrun directly) with
``python -m rlcli.cli.torchrun --nproc-per-node N ... -m rlcli.cli.train run <the same
arguments minus the launch flags>``: torchrun's agent (``torch.distributed.run``) in that
process, which says a failed rank in one line instead of torchrun's traceback and report
(:func:`agent`). Rendezvous:

* one node: ``--standalone`` (a free local port);
* ``--rdzv-endpoint HOST:PORT``: the c10d rendezvous at that endpoint (any node count);
* ``--nnodes M`` > 1, or a Slurm allocation of several nodes: static rendezvous with
  ``--node-rank`` and master address = the first host of ``SLURM_JOB_NODELIST``
  (expanded here, or by ``scontrol show hostnames`` when present), port ``MASTER_PORT``
  or 29500. ``SLURM_NNODES`` / ``SLURM_NODEID`` fill in ``--nnodes`` / ``--node-rank``.

Stdlib only, but for :func:`agent`: this runs before torch is imported.
"""

import os
import re
import shutil
import subprocess
import sys

LAUNCH_FLAGS = ("--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint")


def under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list (``gpu[01-03,07],login1``) as host names, in order."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                 timeout=10, check=True).stdout.split()
            if out:
                return out
        except (subprocess.SubprocessError, OSError):
            pass
    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist):
        prefix, ranges = m.group(1), m.group(2)
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                hosts.append(prefix + lo)
                continue
            for i in range(int(lo), int(hi) + 1):
                hosts.append(prefix + str(i).zfill(len(lo)))
    return hosts


def strip_launch_flags(argv: list[str]) -> list[str]:
    """``argv`` without the launch flags (``--flag value`` and ``--flag=value`` forms)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in LAUNCH_FLAGS:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def torchrun_command(nproc: int, nnodes: int | None, node_rank: int | None, rdzv_endpoint: str | None,
                     args: list[str], env: dict | None = None) -> list[str]:
    """The torchrun command line that runs ``rlcli.cli.train run <args>`` on this node."""
    env = os.environ if env is None else env
    cmd = [sys.executable, "-m", "rlcli.cli.torchrun", "--nproc-per-node", str(nproc)]
    slurm_nodes = int(env.get("SLURM_NNODES", "1") or 1)
    if nnodes is None and slurm_nodes > 1 and env.get("SLURM_JOB_NODELIST"):
        nnodes = slurm_nodes
        node_rank = int(env.get("SLURM_NODEID", "0")) if node_rank is None else node_rank
    nnodes = nnodes or 1
    if rdzv_endpoint:
        run_id = env.get("SLURM_JOB_ID", "rlcli")
        cmd += ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint,
                "--rdzv-id", run_id]
    elif nnodes > 1:
        nodelist = env.get("SLURM_JOB_NODELIST")
        if not nodelist and not env.get("MASTER_ADDR"):
            from rlcli.errors import ConfigError

            raise ConfigError(f"--nnodes {nnodes} needs a rendezvous: pass --rdzv-endpoint HOST:PORT "
                              f"(or run inside a Slurm allocation, or set MASTER_ADDR)")
        master = env.get("MASTER_ADDR") or expand_nodelist(nodelist)[0]
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank or 0), "--master-addr", master,
                "--master-port", env.get("MASTER_PORT", "29500")]
    else:
        cmd += ["--standalone"]
    return cmd + ["-m", "rlcli.cli.train", "run", *args]


def relaunch(nproc: int, nnodes: int | None, node_rank: int | None, rdzv_endpoint: str | None) -> None:
    """Replace this process with torchrun running the same rl-train command (never returns)."""
    args = sys.argv[1:]
    if args and args[0] == "run":
        args = args[1:]
    cmd = torchrun_command(nproc, nnodes, node_rank, rdzv_endpoint, strip_launch_flags(args))
    sys.stdout.flush()
    sys.stderr.flush()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default, without its banner
    os.execv(sys.executable, cmd)


def world_size(nproc: int, nnodes: int | None, env: dict | None = None) -> int:
    env = os.environ if env is None else env
    if nnodes is None:
        nnodes = int(env.get("SLURM_NNODES", "1") or 1) if env.get("SLURM_JOB_NODELIST") else 1
    return nproc * nnodes


def agent(argv: list[str]) -> int:
    """Run torchrun's agent on ``argv`` (torchrun's own arguments) in this process; return the exit
    code. A rank that failed is said in one line (its own output, above it, has the why), where
    torchrun adds a traceback and a report. A rank that exited 2 said its usage error itself
    (:mod:`rlcli.cli._errors`, one line from the first rank to hit it), so 2 passes on silently."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        if code == 2:
            return 2
        how = f"was killed by {failure.signal_name()}" if code < 0 else f"exited with code {code}"
        print(f"rl-train: error: rank {rank} (pid {failure.pid}) {how}; its output above says why",
              file=sys.stderr, flush=True)
        return 128 - code if code < 0 else code
    return 0


if __name__ == "__main__":
    sys.exit(agent(sys.argv[1:]))
