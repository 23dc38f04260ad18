"""Helpers of the shared-KV tests: a real rl-cache process and engines with connectors."""

import subprocess
import sys
import time

from rlcli.config.infer import KVCacheConfig
from rlcli.infer.engine import NativeEngine
from rlcli.infer.kv_connector import make_kv_connector
from rlcli.protocol import GenerateRequest, SamplingParams
from rlcli.transport.registry import list_entries


def start_cache(tmp_path, *args: str):
    """``rl-cache serve`` as a child process (its stderr in a file: Mooncake logs a lot); (proc, endpoint)."""
    run_dir = tmp_path / f"cache-run-{len(list(tmp_path.iterdir()))}"
    log = run_dir.with_suffix(".log")
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "rlcli.cli.cache", "serve", "--run-dir", str(run_dir),
                                 "--capacity-mb", "64", *args], stdout=subprocess.DEVNULL, stderr=f)
    deadline = time.monotonic() + 60
    while not (entries := list_entries(run_dir / "registry", "cache")):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(f"rl-cache did not register: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    return proc, entries[0].endpoints["rpc"]


def engine(model, endpoint: str | None, role: str = "mixed", transfer: str = "auto", seed: int = 0) -> NativeEngine:
    e = NativeEngine(model, eos_token_ids=[], max_model_len=256, block_size=4, kv_cache_memory_mb=2, seed=seed,
                     role=role)
    if endpoint:
        e.kv = make_kv_connector(KVCacheConfig(endpoint=endpoint, transfer=transfer), e.block_meta(), e.device)
    return e


def run(e: NativeEngine, requests: list[GenerateRequest]) -> dict:
    for r in requests:
        e.add_request(r)
    out = {}
    while e.has_work():
        for resp in e.step():
            out[resp.request_id] = resp
    return out


def requests(prefix: list[int], tails: list[list[int]], max_tokens=8, seed=7, temperature=1.0):
    return [GenerateRequest(request_id=str(i), prompt_ids=prefix + t, cache_salt="3",
                            sampling=SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i))
            for i, t in enumerate(tails)]


PREFIX = [256] + list(range(20, 60))  # 41 tokens: 10 full blocks of 4
TAILS = [[61, 62, 63], [70, 71], [80, 81, 82, 83, 84]]


