"""
NVFP4, the 4-bit format of NVIDIA's Blackwell GPUs, as a codec of compress.py (OTHER_CODECS):
blocks of 16 values, each value an e2m1 number (sign, 2 exponent bits, 1 mantissa bit: the
magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), each block scaled by an e4m3 number, and one fp32 scale
per tensor that brings the largest block scale to the top of e4m3's range.

    wire: [tensor scale, fp32][block scale per 16 values, e4m3][two e2m1 values per byte]

About 0.56 bytes a value (against 1.03 for e4m3 with block 128): a quarter of bf16's bytes.
"""
import math

import torch

from compress import NVFP4_BLOCK, Quantized, as_float32, num_groups, on_device, scale_groups

E2M1_MAX = 6.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the 8 magnitudes of a 4-bit e2m1 value
E4M3_MAX = 448.0


def wire_nbytes(shape):
    """fp32 tensor scale + one e4m3 scale per 16 values + two values per byte; 0 if empty."""
    numel = math.prod(shape)
    return 4 + num_groups(shape, NVFP4_BLOCK) + (numel + 1) // 2 if numel else 0


def round_to_e2m1(y, stochastic=False, generator=None):
    """4-bit codes (sign << 3 | magnitude index into E2M1_GRID) of y, |y| <= 6."""
    grid = on_device(E2M1_GRID, y.device)
    a = y.abs()
    if stochastic:
        low = (torch.bucketize(a, grid, right=True) - 1).clamp(0, 6)   # grid[low] <= a
        lo, hi = grid[low], grid[low + 1]
        p_up = ((a - lo) / (hi - lo)).clamp(0, 1)
        draw = torch.rand(a.shape, generator=generator, device=y.device)
        idx = low + (draw < p_up).long()
    else:
        # nearest, ties to the even code: ties at 0.25, 1.25, 2.5, 5 round down, at 0.75, 1.75,
        # 3.5 round up (the even codes are 0, 1, 2, 4)
        ties_down = on_device((0.25, 1.25, 2.5, 5.0), y.device)
        ties_up = on_device((0.75, 1.75, 3.5), y.device)
        idx = (a[..., None] > ties_down).sum(-1) + (a[..., None] >= ties_up).sum(-1)
    return (idx | torch.where(y < 0, 8, 0)).to(torch.uint8)


def quantize(x, stochastic=False, generator=None) -> Quantized:
    """x -> one uint8 wire buffer (the layout above)."""
    numel = x.numel()
    if numel == 0:
        return Quantized(torch.empty(0, dtype=torch.uint8, device=x.device), x.shape, "nvfp4",
                         NVFP4_BLOCK)
    groups = scale_groups(x, NVFP4_BLOCK)                              # (G, 16) fp32
    amax = groups.abs().amax(dim=1)                                    # (G,)
    tensor_amax = amax.max()
    tensor_scale = torch.where(tensor_amax > 0, tensor_amax / (E2M1_MAX * E4M3_MAX),
                               torch.ones_like(tensor_amax)).reshape(1)
    block_scale = (amax / (E2M1_MAX * tensor_scale)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    step = block_scale.float() * tensor_scale                          # (G,) decoded block scale
    y = torch.where(step[:, None] > 0, groups / step[:, None], torch.zeros_like(groups))
    codes = round_to_e2m1(y.clamp(-E2M1_MAX, E2M1_MAX), stochastic, generator).reshape(-1)
    codes = codes[:numel]
    if numel % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    packed = codes[0::2] | (codes[1::2] << 4)                           # low nibble first
    buffer = torch.cat([tensor_scale.float().view(torch.uint8),
                        block_scale.view(torch.uint8), packed])
    return Quantized(buffer, x.shape, "nvfp4", NVFP4_BLOCK)


def dequantize(q: Quantized) -> torch.Tensor:
    """fp32 tensor of q's shape."""
    numel = math.prod(q.shape)
    if numel == 0:
        return torch.zeros(q.shape, device=q.buffer.device)
    n_groups = num_groups(q.shape, NVFP4_BLOCK)
    tensor_scale = as_float32(q.buffer[:4])
    block_scale = q.buffer[4: 4 + n_groups].view(torch.float8_e4m3fn).float()
    packed = q.buffer[4 + n_groups:]
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)[:numel].long()
    grid = on_device(E2M1_GRID, packed.device)
    values = grid[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    step = (block_scale * tensor_scale).repeat_interleave(NVFP4_BLOCK)[:numel]
    return (values * step).view(q.shape)
