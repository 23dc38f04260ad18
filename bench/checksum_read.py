"""Read-time cost of the checksums on durable files: checked reads against unchecked ones.

Two readers, each timed with and without its check, alternating, in one run:

  weights     a ~``--mb`` MB safetensors file copied into preallocated parameters, as rl-infer's
              in-place load does (``rlcli.infer.receiver``): the checked arm hashes the file
              through the mapping before the copy (``SafetensorsFile(path, expected)``)
  checkpoint  a ~``--mb`` MB DCP checkpoint loaded into a state dict, as rl-train resumes:
              DCP's ``FileSystemReader`` against ``rlcli.train.checkpoint.VerifyingReader``
              (each file hashed through a read-only mapping that DCP then parses)

The files are written once and read ``--repeats`` times per arm from the page cache (a
warm read: the check's cost is the hashing, the worst case for its ratio; a cold read
from disk would add the same I/O to both arms). Printed: the hash rates of xxh3_64,
crc32, sha256 and blake2b on one buffer of that size (why XXH3-64), then per reader the
median seconds of each arm and the checked/unchecked ratio.

    python bench/checksum_read.py --smoke      # 16 MB, seconds
    python bench/checksum_read.py              # 270 MB, the docs/benchmarks.md figures
"""

import argparse
import hashlib
import statistics
import tempfile
import time
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from safetensors.torch import save_file
from torch.distributed.checkpoint.filesystem import FileSystemReader

from rlcli.models.safetensors_io import SafetensorsFile
from rlcli.train.checkpoint import VerifyingReader
from rlcli.transport.atomic import atomic_dir, checksums_of


def tensors(total_mb: int) -> dict[str, torch.Tensor]:
    """bf16 matrices of 4 MiB each (like a model's linears), ``total_mb`` MB in all."""
    gen = torch.Generator().manual_seed(0)
    n = max(1, total_mb * (1 << 20) // (1024 * 2048 * 2))
    return {f"layers.{i}.weight": torch.randn(1024, 2048, generator=gen).to(torch.bfloat16) for i in range(n)}


def hash_rates(buf: bytes) -> dict[str, float]:
    out = {}
    for name, fn in (("xxh3_64", xxhash.xxh3_64_digest), ("crc32", zlib.crc32), ("sha256", lambda b: hashlib.sha256(b).digest()),
                     ("blake2b", lambda b: hashlib.blake2b(b).digest())):
        t0 = time.perf_counter()
        fn(buf)
        out[name] = len(buf) / (time.perf_counter() - t0) / 1e9
    return out


def read_weights(path: Path, dests: dict[str, torch.Tensor], expected: str | None) -> float:
    t0 = time.perf_counter()
    f = SafetensorsFile(path, expected)
    for name in f.keys():
        dests[name].copy_(f.tensor(name))
    return time.perf_counter() - t0


def read_checkpoint(path: Path, state: dict, checked: bool) -> float:
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=VerifyingReader(path) if checked else FileSystemReader(path))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=270, help="size of each file in MB")
    ap.add_argument("--repeats", type=int, default=5, help="reads per arm (alternating)")
    ap.add_argument("--smoke", action="store_true", help="16 MB, 2 repeats")
    args = ap.parse_args()
    if args.smoke:
        args.mb, args.repeats = 16, 2
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        ts = tensors(args.mb)
        with atomic_dir(d / "weights", {"step": 1}) as tmp:
            save_file(ts, str(tmp / "model.safetensors"))
        shard = d / "weights" / "model.safetensors"
        size_mb = shard.stat().st_size / 1e6
        rates = hash_rates(shard.read_bytes())
        print(f"file {size_mb:.0f} MB; hash rates on one buffer: "
              + ", ".join(f"{k} {v:.2f} GB/s" for k, v in rates.items()))
        with atomic_dir(d / "ckpt", {"step": 1}) as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"model": ts}, checkpoint_id=str(tmp))
        expected = checksums_of(d / "weights")["model.safetensors"]
        dests = {k: torch.empty_like(v) for k, v in ts.items()}
        state = {"model": {k: torch.empty_like(v) for k, v in ts.items()}}
        rows = []
        for reader, run in (("weights", lambda checked: read_weights(shard, dests, expected if checked else None)),
                            ("checkpoint", lambda checked: read_checkpoint(d / "ckpt", state, checked))):
            run(False), run(True)  # warm the page cache and the allocator
            times = {False: [], True: []}
            for _ in range(args.repeats):
                for checked in (False, True):
                    times[checked].append(run(checked))
            got = dests if reader == "weights" else state["model"]
            assert all(torch.equal(got[k], v) for k, v in ts.items()), reader
            base, checked = statistics.median(times[False]), statistics.median(times[True])
            rows.append((reader, base, checked))
    print(f"\n{'reader':<11} {'unchecked s':>12} {'checked s':>12} {'checked/unchecked':>18}")
    for reader, base, checked in rows:
        print(f"{reader:<11} {base:>12.3f} {checked:>12.3f} {checked / base:>17.2f}x")


if __name__ == "__main__":
    main()
