"""The training batch: what rl-orchestrate writes to RUN/rollouts/step_N/<rank>.msgpack
and rl-train reads.

Samples are packed into rows of ``micro_batch_tokens`` tokens: several sequences per
row, each starting at position 0, so attention is block-diagonal causal within a row.
Every per-token array has the row's length. ``num_loss_tokens`` counts loss tokens over
all ranks, so each rank can normalize the token-level loss globally without a collective.
"""

from typing import Optional

import msgspec

from rlcli.protocol.messages import WireTensor


class MicroBatch(msgspec.Struct, kw_only=True):
    input_ids: WireTensor
    """int32 [T] tokens of several packed sequences."""
    position_ids: WireTensor
    """int32 [T] position within its own sequence (0 starts a new sequence)."""
    loss_mask: WireTensor
    """bool [T]: True where the token is a completion token the loss trains on."""
    advantages: WireTensor
    """float32 [T] advantage of the sequence each token belongs to."""
    inference_logprobs: WireTensor
    """float32 [T] logprob the inference engine gave each completion token (0 elsewhere)."""
    versions: WireTensor
    """int32 [T] policy version that produced each completion token (-1 on prompt tokens)."""
    routed_experts: Optional[WireTensor] = None
    """uint8/int16 [T, num_moe_layers, top_k] experts chosen at inference (R3), when recorded."""
    temperature: float = 1.0
    """Sampling temperature; the trainer scales its logits by it before log-softmax."""
    num_samples: int = 0
    """Sequences packed in this micro-batch."""


class TrainingBatch(msgspec.Struct, kw_only=True):
    step: int
    """Trainer step this batch is for."""
    rank: int
    """Data-parallel rank that reads it."""
    micro_batches: list[MicroBatch]
    """Packed rows for this rank."""
    num_loss_tokens: int
    """Loss tokens in the whole step, across all ranks (the loss normalizer)."""
    num_samples: int
    """Sequences in the whole step, across all ranks."""
    min_version: int
    """Oldest policy version of any token in the step."""
    max_version: int
    """Newest policy version of any token in the step."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(TrainingBatch)


def encode_batch(batch: TrainingBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(data: bytes) -> TrainingBatch:
    return _decoder.decode(data)
