"""Block quantization to float8_e4m3fn: 1x128 tiles for activations, 128x128 blocks for weights.

Every block gets its own fp32 scale ``s = amax(|block|) / 448`` (448 is e4m3fn's largest
finite value); the data is ``clamp(x * r, -448, 448)`` cast to e4m3fn, which rounds to
nearest-even, with ``r = 448 / amax`` (``1 / s`` for UE8M0): one multiply per element, not a
division, which keeps the GPU kernels memory-bound (DeepGEMM's casts do the same).
Dequantization is ``fp8 * s``, so ``s`` is what DeepSeek-V3 checkpoints store as
``weight_scale_inv``. With ``ue8m0`` the scale is rounded *up* to a power of two (the
UE8M0 format of DeepGEMM's Blackwell kernels and MX formats): block maxima then land in
[224, 448] and ``r`` is exact.

Layouts (shapes are the tensor's own; nothing is transposed behind the caller's back):
    activations  x [..., K]  -> data [..., K], scales [..., ceil(K/128)]
    weights      w [N, K]    -> data [N, K],   scales [ceil(N/128), ceil(K/128)]
    experts      w [E, N, K] -> data [E, N, K], scales [E, ceil(N/128), ceil(K/128)]
Scales are plain row-major fp32; the GEMM backends re-lay them out for their kernels.

Shapes that are not multiples of 128 are zero padded, conceptually: the edge block holds
fewer elements, its amax is taken over those, and the missing ones count as zeros. This
is exactly DeepSeek-V3's checkpoint layout (``weight_scale_inv`` is
``[ceil(N/128), ceil(K/128)]``) and what DeepGEMM's casting helpers do, and a zero times
anything adds nothing to a GEMM, so backends whose kernels need multiples of 128 pad the
FP8 data with zeros and get the same result.

A 128x128 block is symmetric: the transpose of a block-quantized W is the block
quantization of W^T with transposed scales. The backward pass uses this to get W^T in FP8
without quantizing again (:func:`transpose_blocks`).
"""

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
_TINY = 1e-12  # amax floor: an all-zero block gets a finite scale and quantizes to zeros


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _scale(amax: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale s, multiplier r) of blocks whose max |value| is ``amax``. Both are IEEE divisions by a
    device tensor: torch turns ``t / 448.0`` into ``t * (1 / 448)`` on CUDA and ``448.0 / t`` into
    ``448 * reciprocal(t)``, which round differently from the kernels (and from each other)."""
    amax = amax.float().clamp(min=_TINY)
    fmax = torch.full((), FP8_MAX, device=amax.device)
    s = amax / fmax
    if ue8m0:  # round up to a power of two on the bits (log2/ceil/exp2 can round down at the edge)
        s = ((s.view(torch.int32) + 0x7FFFFF) & 0x7F800000).view(torch.float32)
        return s, torch.ones((), device=s.device) / s
    return s, fmax / amax


def _cast(x_scaled: torch.Tensor) -> torch.Tensor:
    # Explicit clamp: CUDA casts saturate to NaN, CPU casts to +-448; both must see the same input.
    return x_scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _pad_last(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x.shape[-1]) % multiple
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def quantize_1x128(x: torch.Tensor, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row tiles of 128 along the last dim: ``x [..., K]`` -> (fp8 [..., K], fp32 scales [..., ceil(K/128)])."""
    K = x.shape[-1]
    xp = _pad_last(x.float(), BLOCK)
    tiles = xp.unflatten(-1, (-1, BLOCK))  # [..., Kb, 128]
    s, r = _scale(tiles.abs().amax(dim=-1), ue8m0)
    q = _cast(tiles * r[..., None]).flatten(-2)[..., :K]
    return q.contiguous(), s


def quantize_128x128(w: torch.Tensor, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 blocks over the last two dims: ``w [..., N, K]`` -> (fp8 [..., N, K], fp32 [..., ceil(N/128), ceil(K/128)])."""
    N, K = w.shape[-2:]
    wp = _pad_last(_pad_last(w.float(), BLOCK).transpose(-1, -2), BLOCK).transpose(-1, -2)  # [..., Np, Kp]
    Np, Kp = wp.shape[-2:]
    blocks = wp.reshape(*wp.shape[:-2], Np // BLOCK, BLOCK, Kp // BLOCK, BLOCK)
    s, r = _scale(blocks.abs().amax(dim=(-3, -1)), ue8m0)  # [..., Nb, Kb]
    q = _cast(blocks * r[..., :, None, :, None]).reshape(wp.shape)[..., :N, :K]
    return q.contiguous(), s


def expand_scales(s: torch.Tensor, shape: torch.Size | tuple[int, ...], block_rows: int) -> torch.Tensor:
    """Per-element scales of ``shape`` from block scales (``block_rows`` 1 for 1x128, 128 for 128x128)."""
    rows, cols = shape[-2] if len(shape) >= 2 else 1, shape[-1]
    if block_rows == 1:
        return s.repeat_interleave(BLOCK, dim=-1)[..., :cols]
    out = s.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    return out[..., :rows, :cols]


def dequantize_1x128(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_1x128` (up to the rounding): ``q * s`` per tile."""
    return (q.float() * expand_scales(s, q.shape, 1)).to(dtype)


def dequantize_128x128(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_128x128` (up to the rounding): ``q * s`` per block."""
    return (q.float() * expand_scales(s, q.shape, BLOCK)).to(dtype)


def transpose_blocks(q: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 128x128 quantization of W^T, read off that of W (no second rounding)."""
    return q.transpose(-1, -2).contiguous(), s.transpose(-1, -2).contiguous()


def check_fp8_weight(q: torch.Tensor, s: torch.Tensor, name: str) -> None:
    """Raise ValueError unless ``s`` has the 128x128 block-scale shape of ``q`` (a checkpoint's ``weight_scale_inv``)."""
    want = (*q.shape[:-2], ceil_div(q.shape[-2], BLOCK), ceil_div(q.shape[-1], BLOCK))
    if q.dtype != FP8_DTYPE:
        raise ValueError(f"{name}: expected float8_e4m3fn data, got {q.dtype}")
    if tuple(s.shape) != want:
        raise ValueError(f"{name}: weight_scale_inv has shape {list(s.shape)}, 128x128 blocks of "
                         f"{list(q.shape)} need {list(want)}")


def rounding_cases() -> torch.Tensor:
    """Rows of 128 (fp32, CPU) holding every finite e4m3 value, every rounding midpoint and its
    two neighbours, subnormals and signed zeros, each row ending in 448 so its 1x128 scale is 1
    (the quantized value is the input rounded): the bit-for-bit check of a quantizer."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat([grid, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9)),
                      torch.tensor([-0.0, 0.0, 2.0 ** -10, -(2.0 ** -10), 3 * 2.0 ** -11, 1e-30])])
    vals = vals[vals.abs() <= 448]
    rows = -(-vals.numel() // 127)
    x = torch.zeros(rows * 127)
    x[:vals.numel()] = vals
    return torch.cat([x.view(rows, 127), torch.full((rows, 1), 448.0)], 1)
