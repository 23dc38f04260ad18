"""verifiers multi-turn episodes through rl-infer's HTTP API: prefix-cache reuse across turns.

Two rl-infer processes serve the same random-weights Llama (ChatML byte tokenizer): one
with its prefix cache (the project), one with ``infer.enable_prefix_caching = false`` (the
baseline). The same verifiers environment (``tests/vf_modules.py``: a taskset plus an env whose ``run``
answers each reply with feedback for ``--turns`` model turns; verifiers' chat program as harness,
its training client on ``/inference/v1/generate``, a bridging ChatML renderer) runs
``--episodes`` concurrent episodes against each, every episode under one cache salt.
Printed per arm: model turns after the first, the share of their prompt tokens served
from the prefix cache, the KV reuse (cached tokens / the earlier turns' prompt +
completion - 1), and wall time; then baseline/project wall time.

    python bench/verifiers_http.py --smoke
    python bench/verifiers_http.py                 # the docs/benchmarks.md figures
"""

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from chat_tokenizer import write_chat_tokenizer  # noqa: E402
from procs import Procs, wait_until, write_recipe  # noqa: E402
from tiny import write_tiny_model  # noqa: E402
from vf_modules import write_vf_modules  # noqa: E402

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    a = ap.parse_args()
    if a.smoke:
        a.episodes, a.turns, a.max_tokens = 2, 2, 8
    shape = ({} if a.smoke else dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=64))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = write_tiny_model(root / "model", max_position_embeddings=1024, **shape)
        (model / "tokenizer_config.json").unlink()
        write_chat_tokenizer(model)
        write_vf_modules(root)
        sys.path.insert(0, str(root))
        from rlcli.envs.verifiers_adapter import VerifiersEnv
        from rlcli.models import load_model, save_model
        from rlcli.transport.atomic import atomic_dir
        from rlcli.transport.registry import list_entries

        procs = Procs(root / "logs")
        arms = {}
        try:
            for arm, caching in (("prefix cache", True), ("no prefix cache", False)):
                run_dir = root / arm.replace(" ", "-")
                with atomic_dir(run_dir / "weights" / "step_0") as w:
                    save_model(load_model(model, seed=1), w, source_dir=model)
                recipe = write_recipe(root / f"{run_dir.name}.toml", model, run_dir,
                                      model={"path": str(model), "max_seq_len": 1024},
                                      train={"micro_batch_tokens": 1024},
                                      infer={"http_port": 0, "enable_prefix_caching": caching,
                                             "engine": {"name": "native", "kv_cache_memory_mb": 256}})
                procs.start(f"infer-{run_dir.name}", recipe, "--id", "0")
                entry = wait_until(lambda: next(iter(list_entries(run_dir / "registry", "infer")), None), 120,
                                   "rl-infer registered", procs)
                arms[arm] = entry.endpoints["http"]
            renderer = {"name": "custom", "import_path": "chat_tokenizer.ChatMLRenderer"}
            env = VerifiersEnv(taskset="vf_echo", env_id="vf-feedback", renderer=renderer,
                               env_config={"rounds": a.turns})
            results = {}
            task = env.sample_task(random.Random(0))
            sampling = {"temperature": 1.0, "max_tokens": a.max_tokens}
            for url in arms.values():  # warm-up (verifiers' serving, the renderer, first requests), untimed
                env.run_group(task, 1, url, model.name, str(model), sampling, "warm-up", 0).result(timeout=600)
            for arm, url in arms.items():
                start = time.perf_counter()
                episodes = env.run_group(task, a.episodes, url, model.name, str(model), sampling, f"bench-{arm}",
                                         0).result(timeout=1800)
                wall = time.perf_counter() - start
                turns = prompt = cached = earlier = 0
                for s in (s for samples in episodes for s in samples):
                    for k in range(1, len(s.turn_prompt_tokens)):
                        turns += 1
                        prompt += s.turn_prompt_tokens[k]
                        cached += s.turn_cached_tokens[k]
                        earlier += s.turn_prompt_tokens[k - 1] + s.turn_completion_tokens[k - 1] - 1
                results[arm] = (turns, cached / max(prompt, 1), cached / max(earlier, 1), wall)
            env.close()
        finally:
            procs.stop_all()
    print(f"{a.episodes} episodes x {a.turns} model turns, max_tokens {a.max_tokens}")
    print(f"{'arm':<18}{'later turns':>12}{'cached share':>14}{'KV reuse':>10}{'wall s':>9}")
    for arm, (turns, share, reuse, wall) in results.items():
        print(f"{arm:<18}{turns:>12}{share:>14.3f}{reuse:>10.3f}{wall:>9.1f}")
    print(f"baseline / project wall time: {results['no prefix cache'][3] / results['prefix cache'][3]:.2f}x")


if __name__ == "__main__":
    main()
