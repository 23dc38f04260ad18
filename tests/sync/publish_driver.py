"""A stand-in for rl-train's publishing side, run as its own process by the sync tests.

It publishes through the real ``WeightPublisher`` of the recipe's ``sync.backend`` and the
trainer's announcement socket, with deterministic weights: version N is the tiny model
initialized from seed 1000 + N. Reads one step number per stdin line, prints
"published N" once ``publish`` returned (for the async backend: once it is durable).
"""

import select
import sys
import threading

import torch

from rlcli.config import load_recipe
from rlcli.models import load_model
from rlcli.protocol import WeightsPublished
from rlcli.train.publish import make_publisher
from rlcli.transport.registry import Registration
from rlcli.transport.rundir import RunDir
from rlcli.transport.zmq import Publisher


def weights(cfg, version: int):
    return load_model(cfg.model.path, seed=1000 + version)


def main() -> None:
    torch.set_num_threads(1)
    cfg = load_recipe(sys.argv[1])
    run = RunDir(cfg.run_dir)
    pub = Publisher(cfg.infer.host, 0)
    lock = threading.Lock()
    reg = Registration(run.registry_dir(), "train", 0, {"pub": pub.endpoint})

    def announce(step, path, timing):
        with lock:
            pub.publish(WeightsPublished(step=step, path=path, timing=timing))

    publisher = make_publisher(cfg, run.root, announce, torch.device("cpu"))
    model = weights(cfg, 0)
    while True:  # the work loop: beats while waiting for the next step, as rl-train's does
        reg.beat()
        if not select.select([sys.stdin], [], [], 0.2)[0]:
            continue
        line = sys.stdin.readline()
        if not line:
            break
        step = int(line)
        with torch.no_grad():
            for p, q in zip(model.parameters(), weights(cfg, step).parameters()):
                p.copy_(q)
        publisher.publish(step, model)
        publisher.wait()
        print(f"published {step}", flush=True)
    publisher.close()
    reg.close()
    pub.close()


if __name__ == "__main__":
    main()
