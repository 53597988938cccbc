"""
Stochastic rounding to FP8 (compress.GeoOptions(stochastic=True), two-stage collective only):
each value rounds to one of its two FP8 neighbours with probability proportional to closeness,
so the rounding is unbiased, E[decode] = x, at the price of a larger variance than rounding to
nearest. compress.encode_groups calls it; the random stream of each rank and stage comes from
compress.rng, so the simulator draws exactly what the ranks draw.
"""
import torch

FP8_MAX_CODE = {torch.float8_e4m3fn: 0x7E, torch.float8_e5m2: 0x7B}  # largest finite magnitude


def stochastic_fp8(y, dtype, generator=None):
    """Cast y (already within the format's range) to an fp8 dtype, stochastically."""
    nearest = y.to(dtype)
    # the other neighbour of y: one step away from `nearest` on the far side of y, found by
    # stepping the 7-bit magnitude code (fp8 magnitudes are ordered like their codes)
    near_val = nearest.float()
    mag = (nearest.view(torch.uint8) & 0x7F).int()
    overshoot = near_val.abs() > y.abs()
    other_mag = torch.where(overshoot, mag - 1, (mag + 1).clamp(max=FP8_MAX_CODE[dtype])).clamp(min=0)
    sign = torch.where(y < 0, 0x80, 0)
    other = (other_mag | sign).to(torch.uint8).view(dtype)
    gap = (other.float() - near_val).abs()
    p_other = torch.where(gap > 0, (y - near_val).abs() / gap, torch.zeros_like(y))
    draw = torch.rand(y.shape, generator=generator, device=y.device)
    return torch.where(draw < p_other, other, nearest.view(torch.uint8).view(dtype))
