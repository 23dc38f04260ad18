"""Fetch and publish bandwidth between an engine's connector and rl-cache: the old path
(blocks kept as Python bytes, copied through /dev/shm mailboxes) against the shared arena
(the engine copies straight from and into the store's slots), side by side in one run.

Two real ``rl-cache serve`` processes (``--cache.backend.arena false`` and the default
arena), one connector each in this process (as an engine holds one), the same blocks
(``--mb`` MiB of ``--block-kb`` KiB blocks): each round publishes a fresh set of keys
(publish + flush: the put path) and then fetches them back ``--fetches`` times into a
preallocated destination (as the engine copies fetched blocks into its KV blocks: on CUDA a
device tensor), checking the bytes. Printed: GB/s per put and per fetch, and their ratio.
``--device cuda`` adds a raw probe: host-to-device GB/s from the arena's registered /dev/shm
mapping and from torch's pinned memory.

    python bench/kv_fetch_bandwidth.py --smoke          # seconds
    python bench/kv_fetch_bandwidth.py                  # CPU, 128 MiB of 96 KiB blocks (docs/benchmarks.md)
    python bench/kv_fetch_bandwidth.py --device cuda    # bench/README.md
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def start_cache(tmp: Path, capacity_mb: int, arena: bool) -> tuple[subprocess.Popen, str]:
    from rlcli.transport.registry import list_entries

    run_dir = tmp / f"cache-{arena}"
    proc = subprocess.Popen([sys.executable, "-m", "rlcli.cli.cache", "serve", "--run-dir", str(run_dir),
                             "--capacity-mb", str(capacity_mb), "--backend", "memory",
                             "--cache.backend.arena", str(arena).lower()],
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (entries := list_entries(run_dir / "registry", "cache")):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("rl-cache did not start")
        time.sleep(0.1)
    return proc, entries[0].endpoints["rpc"]


def measure(conn, device: torch.device, num_blocks: int, rounds: int, fetches: int, seed: int) -> dict:
    nbytes = conn.meta.nbytes
    dst = torch.zeros(num_blocks, nbytes, dtype=torch.uint8, device=device)  # faulted in, as KV blocks are
    puts, gets = [], []
    for r in range(rounds):
        gen = torch.Generator().manual_seed(seed + r)
        payload = torch.randint(0, 256, (num_blocks, nbytes), dtype=torch.uint8, generator=gen).to(device)
        keys = [f"{seed}-{r}-{i}".encode().ljust(32, b".") for i in range(num_blocks)]
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        assert conn.publish(keys, payload) and conn.flush(600)
        puts.append(payload.numel() / (time.perf_counter() - t0) / 1e9)
        for _ in range(fetches):
            t0 = time.perf_counter()
            ticket = conn.fetch_async(keys)
            ticket.event.wait()
            data = ticket.take()
            assert data.shape[0] == num_blocks, f"fetched {data.shape[0]} of {num_blocks} blocks"
            dst.copy_(data)  # into the engine's blocks
            ticket.release()
            if device.type == "cuda":
                torch.cuda.synchronize()
            gets.append(dst.numel() / (time.perf_counter() - t0) / 1e9)
        assert torch.equal(dst, payload), "fetched bytes differ from the published ones"
    return {"put": puts, "get": gets}


def probe(conn, device: torch.device, mb: int) -> str:
    """Host-to-device GB/s from the arena's (registered) mapping and from pinned memory."""
    n = mb << 20
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    out = []
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    for name, src in (("arena mapping", conn.slots[:n]), ("pinned", pinned)):
        rates = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dev.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            rates.append(n / (time.perf_counter() - t0) / 1e9)
        out.append(f"{name} {statistics.median(rates):.1f}")
    return f"# raw H2D of {mb} MiB, GB/s (median of 5): " + ", ".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--mb", type=int, default=None, help="MiB of blocks per round")
    p.add_argument("--block-kb", type=int, default=None, help="KiB per block")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--fetches", type=int, default=4, help="fetches of each round's blocks")
    args = p.parse_args()
    from rlcli.config.infer import KVCacheConfig
    from rlcli.infer.kv_connector import make_kv_connector
    from rlcli.protocol import BlockMeta

    mb = args.mb or (8 if args.smoke else 256 if args.device == "cuda" else 128)
    block_kb = args.block_kb or (512 if args.device == "cuda" else 96)
    num_blocks = max(1, (mb << 10) // block_kb)
    meta = BlockMeta(fingerprint="bench", dtype="uint8", shape=[block_kb << 10])
    device = torch.device(args.device)
    capacity_mb = max(64, 2 * (args.rounds + 1) * mb)
    print(f"# kv_fetch_bandwidth: device={args.device} {num_blocks} blocks of {block_kb} KiB "
          f"({num_blocks * block_kb / 1024:.0f} MiB) x {args.rounds} rounds x {args.fetches} fetches; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arena in (False, True):
            proc, endpoint = start_cache(Path(tmp), capacity_mb, arena)
            conn = None
            try:
                conn = make_kv_connector(KVCacheConfig(endpoint=endpoint, timeout_s=120), meta, device)
                via = getattr(conn, "via", "") or ("shm" if conn.via_shm else "zeromq")
                name = f"{'arena' if arena else 'bytes + mailboxes'} (via {via})"
                rows[name] = measure(conn, device, num_blocks, args.rounds, args.fetches, seed=int(arena))
                if arena and args.device == "cuda" and hasattr(conn, "slots"):
                    print(probe(conn, device, min(mb, 256)), flush=True)
            finally:
                if conn is not None:
                    conn.close()
                proc.terminate()
                proc.wait(timeout=30)
    print(f"{'path':<34} {'put GB/s (per round)':<24} {'fetch GB/s (each)':<40} {'fetch median':>12}")
    for name, r in rows.items():
        print(f"{name:<34} {' '.join(f'{x:.2f}' for x in r['put']):<24} "
              f"{' '.join(f'{x:.2f}' for x in r['get']):<40} {statistics.median(r['get']):>12.2f}")
    old, new = list(rows.values())
    print(f"arena / old: fetch {statistics.median(new['get']) / statistics.median(old['get']):.2f}x, "
          f"put {statistics.median(new['put']) / statistics.median(old['put']):.2f}x (medians); "
          f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
