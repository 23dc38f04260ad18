"""`rl-orchestrate up`: every process of a recipe as a child of one command, for one machine.

Each child is the same command a user would type in its own shell, pointed at one
resolved recipe (RUN/config/up.toml, paths made absolute) and one run directory; its
stdout and stderr go to RUN/logs/<command>-<id>.log. Children are tracked and ended
by pid: when one fails, on Ctrl-C, or once the trainer and the orchestrator are done,
every child gets SIGTERM (servers last), then SIGKILL after a grace period. If this command
dies without that (``kill -9``), the kernel sends each child SIGTERM (``PR_SET_PDEATHSIG``).

GPUs (:func:`place_gpus`): on a machine with several, and ``infer.device = "cuda"`` (no index),
rl-train takes the first ``up.train_nproc_per_node`` and each rl-infer the next
``infer.engine.tensor_parallel_size`` (``CUDA_VISIBLE_DEVICES`` per child), as the Slurm
launcher places them on a node. With too few for that they share, as on one GPU.
"""

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from rlcli.config import RecipeConfig, dump_toml, to_dict
from rlcli.errors import ConfigError
from rlcli.logging import console, setup_logging
from rlcli.orchestrate.dashboard import LiveView, ProcessRow
from rlcli.process import stop_with_parent
from rlcli.transport.rundir import RunDir

log = setup_logging("rl-orchestrate")

# Start order; servers first so the others find them, stopped in reverse.
ORDER = ("cache", "train", "sync", "infer", "teacher", "orchestrate")
MODULES = {"cache": ["rlcli.cli.cache", "serve"], "train": ["rlcli.cli.train", "run"], "sync": ["rlcli.cli.sync"],
           "infer": ["rlcli.cli.infer", "serve"], "teacher": ["rlcli.cli.infer", "serve"],
           "orchestrate": ["rlcli.cli.orchestrate", "run"]}
TEACHER_EXTRA_LEN = 64  # the teacher's model.max_seq_len over the student's: a scored sequence plus its one token
FINITE = ("train", "orchestrate")  # the run is over when these exit 0


@dataclass
class Child:
    name: str
    instance: int
    proc: subprocess.Popen
    log_path: Path

    @property
    def label(self) -> str:
        return f"{self.name}-{self.instance}" if self.name == "infer" else self.name


def resolved_recipe(cfg: RecipeConfig) -> RecipeConfig:
    """The recipe with every path absolute, so children can run from any directory."""
    tree = to_dict(cfg)
    tree["run_dir"] = os.path.abspath(cfg.run_dir)
    if cfg.model.path:
        tree["model"]["path"] = os.path.abspath(cfg.model.path)
    if cfg.train.sft.dataset != "env":
        tree["train"]["sft"]["dataset"] = os.path.abspath(cfg.train.sft.dataset)
    if cfg.up.teacher:
        tree["up"]["teacher"] = os.path.abspath(cfg.up.teacher)
        tree["orchestrate"]["teacher"]["run_dir"] = os.path.join(tree["run_dir"], "teacher")
    return msgspec.convert(tree, RecipeConfig)


def teacher_recipe(cfg: RecipeConfig) -> RecipeConfig:
    """The recipe of ``up.teacher``'s rl-infer: ``cfg`` (resolved) serving the teacher's model from RUN/teacher."""
    tree = to_dict(cfg)
    tree["run_dir"] = cfg.orchestrate.teacher.run_dir
    tree["model"]["path"] = cfg.up.teacher
    tree["model"]["max_seq_len"] = cfg.model.max_seq_len + TEACHER_EXTRA_LEN
    tree["up"]["teacher"] = ""
    tree["orchestrate"]["teacher"] = {}
    tree["infer"]["port"], tree["infer"]["http_port"] = 0, -1  # beside the student's servers: ports of its own
    return msgspec.convert(tree, RecipeConfig)


def visible_gpus() -> list[str]:
    """The GPUs children may use: ``CUDA_VISIBLE_DEVICES``, else those ``nvidia-smi -L`` lists
    (torch is not imported here: ``up`` stays light)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip() and not g.strip().startswith("-")]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i in range(sum(line.startswith("GPU ") for line in out.splitlines()))]


def place_gpus(cfg: RecipeConfig, gpus: list[str]) -> dict[str, str]:
    """Child label (train, infer-<i>) -> its CUDA_VISIBLE_DEVICES; empty when the children share."""
    tp = getattr(cfg.infer.engine, "tensor_parallel_size", 1)
    nproc, servers = cfg.up.train_nproc_per_node, cfg.up.num_infer
    if cfg.infer.device != "cuda" or len(gpus) < 2:
        return {}
    if len(gpus) < nproc + servers * tp:
        log.warning("%d GPUs cannot give rl-train %d and %d rl-infer %d each: they share (the trainer's ranks "
                    "from GPU 0, every rl-infer on %s)", len(gpus), nproc, servers, tp,
                    "GPU 0" if tp == 1 else f"GPUs 0-{tp - 1}")
        return {}
    out = {"train": ",".join(gpus[:nproc])}
    for i in range(servers):
        out[f"infer-{i}"] = ",".join(gpus[nproc + i * tp:nproc + (i + 1) * tp])
    return out


def preflight(cfg: RecipeConfig) -> None:
    """What would stop a child at its start, checked before ``up`` claims the run directory or starts
    anyone, so a refused recipe is one line here (a ConfigError or ModelLoadError naming the key):
    the model directory and tokenizer, the trainer's parallel degrees against
    ``up.train_nproc_per_node``, a loss of your own, the vLLM engine's import, and the environment
    with its env.args. Light: no torch import (but what a loss or environment of your own imports)."""
    from rlcli.config.infer import check_engine_installed
    from rlcli.config.train import check_loss_importable
    from rlcli.envs import make_env
    from rlcli.models.config import ModelArgs
    from rlcli.models.tokenizer import load_tokenizer
    from rlcli.parallel.dims import resolve_dims

    args = ModelArgs.from_dir(cfg.model.path)
    processes = cfg.up.processes
    if cfg.up.teacher:
        t = cfg.orchestrate.teacher
        if t.connect or (t.run_dir and os.path.abspath(t.run_dir) != os.path.join(os.path.abspath(cfg.run_dir),
                                                                                 "teacher")):
            raise ConfigError("up.teacher serves the teacher itself: leave orchestrate.teacher.connect and run_dir "
                              "unset")
        teacher = ModelArgs.from_dir(cfg.up.teacher)
        if teacher.vocab_size != args.vocab_size:
            raise ConfigError(f"up.teacher {cfg.up.teacher}: its vocabulary ({teacher.vocab_size} tokens) is not the "
                              f"student's ({args.vocab_size}); a teacher must share the student's tokenizer")
        if not any(Path(cfg.up.teacher).glob("*.safetensors")):
            raise ConfigError(f"up.teacher {cfg.up.teacher} has no safetensors weights; a teacher needs trained "
                              "weights (a model directory, or RUN/weights/step_N of a run)")
    if "train" in processes:
        resolve_dims(cfg.train.parallel, cfg.up.train_nproc_per_node, args.num_experts,
                     cfg.orchestrate.num_train_ranks, cfg.train.micro_batch_tokens)
        check_loss_importable(cfg.train.loss)
    if "infer" in processes:
        check_engine_installed(cfg.infer.engine.name)
    if "orchestrate" in processes:
        load_tokenizer(cfg.model.path)
        env = make_env(cfg.env)
        close = getattr(env, "close", None)
        if callable(close):
            close()


def closing_error(log_path: Path) -> str:
    """The last ``<command>: error: ...`` line a child wrote to its log (rlcli.cli._errors), or ""."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    return next((line.strip() for line in reversed(lines) if ": error: " in line), "")


class Launcher:
    def __init__(self, cfg: RecipeConfig, run: RunDir):
        self.cfg = resolved_recipe(cfg)
        self.run = run
        self.recipe_path = run.config_file("up")
        run.write_config("up", dump_toml(to_dict(self.cfg)))
        if self.cfg.up.teacher:
            self._prepare_teacher()
        self.children: list[Child] = []
        self.started = time.monotonic()

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        placed = place_gpus(self.cfg, visible_gpus())
        if placed:
            log.info("GPUs: %s", ", ".join(f"{label} {gpus}" for label, gpus in placed.items()))
        for name in ORDER:
            if name not in self.cfg.up.processes and not (name == "teacher" and self.cfg.up.teacher):
                continue
            for i in range(self.cfg.up.num_infer if name == "infer" else 1):
                recipe = self.run.config_file("teacher") if name == "teacher" else self.recipe_path
                cmd = [sys.executable, "-m", *MODULES[name], "--config", str(recipe)]
                if name == "infer":
                    cmd += ["--id", str(i), *self.role_args(i)]
                if name == "train" and self.cfg.up.train_nproc_per_node > 1:
                    cmd += ["--nproc-per-node", str(self.cfg.up.train_nproc_per_node)]
                log_path = self.run.log_file(name, i)
                log_path.parent.mkdir(parents=True, exist_ok=True)
                label = f"infer-{i}" if name == "infer" else name
                child_env = {**env, "CUDA_VISIBLE_DEVICES": placed[label]} if label in placed else env
                with open(log_path, "ab") as f:
                    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=child_env, start_new_session=True,
                                            preexec_fn=stop_with_parent(os.getpid()))
                self.children.append(Child(name, i, proc, log_path))

    def _prepare_teacher(self) -> None:
        """RUN/config/teacher.toml, and RUN/teacher/weights/step_0 pointing at the teacher's model, which its
        rl-infer serves (as policy 0 of an unmodified base model is served)."""
        from rlcli.transport.atomic import atomic_dir, is_stable

        self.run.write_config("teacher", dump_toml(to_dict(teacher_recipe(self.cfg))))
        step_0 = Path(self.cfg.orchestrate.teacher.run_dir) / "weights" / "step_0"
        if not is_stable(step_0):
            with atomic_dir(step_0, {"step": 0, "source": self.cfg.up.teacher}):
                pass

    def role_args(self, i: int) -> list[str]:
        """Split roles (``up.num_prefill``): the first servers prefill, the others decode."""
        if not self.cfg.up.num_prefill:
            return []
        if not self.cfg.infer.kv_cache.endpoint and "cache" not in self.cfg.up.processes:
            raise ConfigError("up.num_prefill needs a shared KV store: add \"cache\" to up.processes or set "
                             "infer.kv_cache.endpoint")
        role = "prefill" if i < self.cfg.up.num_prefill else "decode"
        return ["--role", role, *([] if self.cfg.infer.kv_cache.endpoint else ["--kv-cache", "registry"])]

    def rows(self) -> list[ProcessRow]:
        out = []
        for c in self.children:
            code = c.proc.poll()
            out.append(ProcessRow(c.label, c.proc.pid, "running" if code is None else f"exit {code}",
                                  str(c.log_path.relative_to(self.run.root))))
        return out

    def failed(self) -> Child | None:
        for c in self.children:
            code = c.proc.poll()
            if code is not None and (code != 0 or c.name not in FINITE):
                return c
        return None

    def finished(self) -> bool:
        finite = [c for c in self.children if c.name in FINITE]
        return all(c.proc.poll() == 0 for c in finite)

    def stop_all(self, grace_s: float = 10.0) -> None:
        for c in reversed(self.children):
            if c.proc.poll() is None:
                try:
                    os.killpg(c.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for c in self.children:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) did not stop; killing it", c.label, c.proc.pid)
                try:
                    os.killpg(c.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                c.proc.wait()

    def summary(self) -> dict:
        orch = self.run.read_metrics("orchestrate")
        rewards = [m["reward_mean"] for m in orch]
        k = min(5, len(rewards))
        return {
            "run_dir": str(self.run.root), "steps": len(rewards), "wall_s": round(time.monotonic() - self.started, 1),
            "reward_first5": round(sum(rewards[:k]) / k, 4) if k else None,
            "reward_last5": round(sum(rewards[-k:]) / k, 4) if k else None,
            "tokens_generated": sum(int(m["completion_len_mean"] * m["num_samples"]) for m in orch),
        }

    def plot(self) -> str | None:
        """RUN/reward.png from the metrics, or None (with one log line) when there is nothing to draw."""
        from rlcli.orchestrate.plot import PlotUnavailable, plot_run

        sft = self.run.read_metrics("sft")
        title = f"{self.cfg.name}" + (f" (after {sft[-1]['step']} SFT steps)" if sft else "")
        try:
            return str(plot_run(self.run, title=title))
        except PlotUnavailable as e:
            log.info("no reward.png: %s", e)
        except Exception as e:  # a plot is a convenience; never fail the run for it
            log.warning("could not write reward.png: %s", e)
        return None


def up(cfg: RecipeConfig, run: RunDir) -> tuple[int, dict]:
    launcher = Launcher(cfg, run)
    stop = {"signal": None}

    def on_signal(signum, frame):
        stop["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    launcher.start()
    console.print(f"rl-orchestrate up: {len(launcher.children)} processes, run directory {run.root}")
    try:
        with LiveView(run) as view:
            while True:
                view.update(launcher.rows())
                if stop["signal"] is not None:
                    console.print("interrupted; stopping every process")
                    code = 130
                    break
                bad = launcher.failed()
                if bad is not None:
                    child_code, said = bad.proc.poll(), closing_error(bad.log_path)
                    console.print(f"[red]error:[/] {bad.label} exited with code {child_code}"
                                  + (f": {said}" if said else "") + f"; see {bad.log_path}", highlight=False)
                    code = 2 if child_code == 2 else 1  # a child's usage or config error is the run's
                    break
                if launcher.finished():
                    break
                time.sleep(0.5)
            view.update(launcher.rows())
    finally:
        launcher.stop_all()
    summary = launcher.summary()
    summary["plot"] = launcher.plot() if cfg.up.plot and summary["steps"] else None
    return code, summary
