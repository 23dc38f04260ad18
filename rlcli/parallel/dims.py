"""Parallel degrees checked against the world size, and the device meshes built from them.

torchrun fixes WORLD_SIZE; the recipe (or ``--dp/--ep/--cp``) says how to split it.
Every mismatch a user can cause is a ``ConfigError`` naming the flags, raised before any
process group work, so all ranks fail the same way with the same line.

Meshes: the world mesh has axes ("dp", "cp"), WORLD_SIZE = dp * cp. FSDP2 shards
parameters over the flattened "dp_cp" axis (CP ranks hold disjoint parts of one
sequence, so they need their gradients summed like data-parallel ranks). Expert
parallelism borrows ``ep`` consecutive ranks of that flattened axis: the expert mesh
has axes ("edp", "ep") over the same ranks, experts split along "ep" and FSDP-sharded
along "edp".

One rank computing in a narrower dtype than fp32 (``model.dtype = "bfloat16"``) is FSDP2 over
a mesh of that one rank (``fsdp_one_rank``), as in torchtitan: its parameters stay fp32 masters
and its optimizer steps them, as on every rank of a sharded trainer. Pure bf16 parameters
would lose every AdamW update under half their spacing (2^-8 to 2^-7 of the weight): at lr
1e-6, all but the weights nearest zero.
"""

from dataclasses import dataclass
from typing import Any

from rlcli.errors import ConfigError


@dataclass
class ParallelDims:
    dp: int
    cp: int
    ep: int
    world_size: int
    mesh: Any = None
    """The ("dp", "cp") DeviceMesh (with flattened "dp_cp"), once :meth:`build` ran."""
    fsdp_mesh: Any = None
    """The flattened dp x cp mesh FSDP2 shards over, once :meth:`build` ran."""
    ep_mesh: Any = None
    """The ("edp", "ep") DeviceMesh when ep > 1, once :meth:`build` ran."""
    fsdp_one_rank: bool = False
    """FSDP2 over a world of one rank (its fp32 master weights): set for a mixed-precision trainer
    of one rank, which needs an initialized one-rank default process group."""

    @property
    def fsdp_size(self) -> int:
        """Ranks that shard (and sum gradients of) every non-expert parameter."""
        return self.dp * self.cp

    @property
    def enabled(self) -> bool:
        """More than one rank: data and sequences are split, metrics reduced."""
        return self.world_size > 1

    @property
    def fsdp(self) -> bool:
        """The model is FSDP2-wrapped (fp32 master parameters, compute in the model dtype)."""
        return self.enabled or self.fsdp_one_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, cp_rank) of a global rank on the ("dp", "cp") mesh (row-major)."""
        return rank // self.cp, rank % self.cp

    def build(self, device_type: str) -> "ParallelDims":
        """Create the meshes (needs an initialized default process group when :attr:`fsdp`)."""
        if not self.fsdp:
            return self
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(device_type, (self.dp, self.cp), mesh_dim_names=("dp", "cp"))
        self.fsdp_mesh = self.mesh["dp", "cp"]._flatten("dp_cp")
        if self.ep > 1:
            # Groups of ep consecutive ranks split the experts; "edp" FSDP-shards them.
            self.ep_mesh = init_device_mesh(device_type, (self.fsdp_size // self.ep, self.ep),
                                            mesh_dim_names=("edp", "ep"))
        return self


def resolve_dims(parallel, world_size: int, num_experts: int = 0, num_train_ranks: int | None = None,
                 micro_batch_tokens: int | None = None) -> ParallelDims:
    """Check ``train.parallel`` (a ParallelConfig) against torchrun's WORLD_SIZE and the model.

    ``num_train_ranks`` is ``orchestrate.num_train_ranks`` (rollout files per step), which
    must equal dp; ``micro_batch_tokens`` bounds cp (a row is cut into 2 * cp chunks).
    """
    dp, cp, ep = parallel.dp, parallel.cp, parallel.ep
    if dp == -1:
        if world_size % cp:
            raise ConfigError(f"--cp {cp} does not divide the {world_size} ranks torchrun gave; "
                              f"pick a --cp that divides {world_size}")
        dp = world_size // cp
    if dp * cp != world_size:
        raise ConfigError(f"--dp {dp} --cp {cp} needs {dp * cp} ranks, torchrun gave {world_size}; "
                          f"make --dp x --cp equal --nproc-per-node x --nnodes")
    if ep > 1:
        if not num_experts:
            raise ConfigError(f"--ep {ep} needs a mixture-of-experts model; model.path is dense (drop --ep)")
        if (dp * cp) % ep:
            raise ConfigError(f"--ep {ep} must divide --dp x --cp = {dp * cp}")
        if num_experts % ep:
            raise ConfigError(f"--ep {ep} must divide the model's {num_experts} experts")
    if num_train_ranks is not None and num_train_ranks != dp:
        raise ConfigError(f"orchestrate.num_train_ranks ({num_train_ranks}) must equal train.parallel.dp ({dp}): "
                          f"each data-parallel rank reads its own rollout file")
    if cp > 1 and micro_batch_tokens is not None and 2 * cp > micro_batch_tokens:
        raise ConfigError(f"--cp {cp} cuts each row into {2 * cp} chunks, more than train.micro_batch_tokens "
                          f"({micro_batch_tokens}); lower --cp")
    return ParallelDims(dp=dp, cp=cp, ep=ep, world_size=world_size)
