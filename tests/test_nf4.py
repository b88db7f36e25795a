"""NF4 storage (dist_llm.peft.nf4): the published levels, exact round trips, bitwise agreement with torchao's
`to_nf4` reference, the storage cost, and NF4Linear as a frozen layer under LoRA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_llm.peft.nf4 import NF4_CODE, NF4Linear, NF4Weight

try:  # torchao >= 0.13 moved NF4 under quantize_/workflows; older releases had it in torchao.dtypes
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
except ImportError:
    from torchao.dtypes.nf4tensor import to_nf4

PUBLISHED_NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]


def _weight(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_code_is_the_published_nf4_table():
    assert list(NF4_CODE) == PUBLISHED_NF4
    assert NF4_CODE[7] == 0.0 and sorted(NF4_CODE) == list(NF4_CODE)


def test_code_values_times_a_uniform_scale_round_trip_exactly():
    # every block holds all 16 levels, so every block absmax is the scale; a power of two keeps all products
    # exact, and with identical absmaxes the double quantisation stores the mean exactly and int8 zeros
    code = torch.tensor(NF4_CODE)
    for scale in (0.25, 2.0):
        w = (code.repeat(4 * 512) * scale).view(512, 64)
        q = NF4Weight.quantize(w)
        assert torch.equal(q.indices(), torch.arange(16).repeat(4 * 512))
        assert torch.equal(q.dequantize(), w)


def test_code_values_times_varied_scales_keep_their_levels():
    g = torch.Generator().manual_seed(1)
    n_blocks = 3 * 256 + 10  # the last group of scales is short
    scales = torch.rand(n_blocks, generator=g) * 3 + 0.01
    code = torch.tensor(NF4_CODE)
    w = (code.repeat(4)[None, :] * scales[:, None]).reshape(-1, 128)
    q = NF4Weight.quantize(w)
    assert torch.equal(q.indices(), torch.arange(16).repeat(4 * n_blocks))
    # the one loss is the int8 absmax: at most one step of (group's largest |absmax - mean|) / 128
    err = (q.block_scales() - scales).abs()
    assert err.max() <= (scales - scales.mean()).abs().max() / 128 * 1.001
    assert torch.equal(q.dequantize(), (code[q.indices()].view(n_blocks, 64) * q.block_scales()[:, None]).view_as(w))


def test_dequantised_weight_equals_torchao_fp32():
    w = _weight(256, 512)
    ref = to_nf4(w)
    # torchao hard-codes the levels to 4 decimals; with its table the algorithm matches bit for bit
    q = NF4Weight.quantize(w, code=ref.nf4)
    assert torch.equal(q.packed, ref.quantized_data)
    assert torch.equal(q.scale_q, ref.quantized_scalers)
    assert torch.equal(q.scale_factor, ref.quantization_factor)
    assert torch.equal(q.scale_mean, ref.scaler_mean)
    assert torch.equal(q.dequantize(), ref.get_original_weight())


def test_published_levels_differ_from_torchao_only_by_its_table_rounding():
    w = _weight(256, 512)
    ref = to_nf4(w)
    exact = NF4Weight.quantize(w, code=ref.nf4)
    q = NF4Weight.quantize(w)
    table_gap = (torch.tensor(NF4_CODE) - ref.nf4).abs().max().item()
    assert 0 < table_gap <= 5e-5
    # the scale path does not involve the table: identical
    assert torch.equal(q.scale_q, exact.scale_q) and torch.equal(q.scale_factor, exact.scale_factor)
    # a level flips only for a value within the table rounding of a midpoint between two levels (14 of 131072)
    flips = q.indices() != exact.indices()
    assert flips.float().mean() < 1e-3
    normalised = (w.view(-1, 64) / w.view(-1, 64).abs().amax(1, keepdim=True)).view(-1)
    mids = (torch.tensor(NF4_CODE)[1:] + torch.tensor(NF4_CODE)[:-1]) / 2
    assert (normalised[flips, None] - mids).abs().amin(dim=1).max() <= table_gap
    # elsewhere the values differ by at most the table rounding times the block scale
    scale = q.block_scales().repeat_interleave(64)
    diff = (q.dequantize() - ref.get_original_weight()).view(-1).abs()
    assert (diff[~flips] <= table_gap * scale[~flips] * 1.001).all()


def test_dequantised_bf16_weight_equals_torchao_on_the_fp32_values():
    w = _weight(256, 512).bfloat16()
    # here the arithmetic is fp32 whatever the input; torchao computes in the input dtype, so the exact
    # reference is torchao run on the same values in fp32, cast back
    ref = to_nf4(w.float())
    q = NF4Weight.quantize(w, code=ref.nf4)
    out = q.dequantize()
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref.get_original_weight().bfloat16())


def test_bf16_weight_is_close_to_torchao_native_bf16():
    # torchao on a bf16 tensor rounds the mean, factors, scales and normalised values to bf16 as it goes:
    # block scales then differ by bf16 rounding (< 1%) and ~0.2% of values land on a neighbouring level
    w = _weight(256, 512).bfloat16()
    ref = to_nf4(w)
    q = NF4Weight.quantize(w, code=ref.nf4)
    ref_scales = ref.dequantize_scalers(ref.quantized_scalers, ref.quantization_factor, 256).float()
    assert ((q.block_scales() - ref_scales).abs() / q.block_scales()).max() < 1e-2
    ref_idx = torch.stack((ref.quantized_data >> 4, ref.quantized_data & 15), 1).view(-1).long()
    assert (q.indices() != ref_idx).float().mean() < 5e-3
    ours, theirs, wf = q.dequantize().float(), ref.get_original_weight().float(), w.float()
    assert (ours - theirs).abs().mean() / wf.std() < 5e-3
    assert (ours - wf).abs().mean() <= (theirs - wf).abs().mean() * 1.01


def test_short_scale_group_equals_torchao_with_that_group_size():
    # 64 x 128 (e.g. a GQA key projection) has 128 blocks: one short group, which is torchao with group 128
    w = _weight(64, 128, seed=3)
    ref = to_nf4(w, 64, 128)
    assert torch.equal(NF4Weight.quantize(w, code=ref.nf4).dequantize(), ref.get_original_weight())


def test_shapes_not_divisible_by_the_block_are_zero_padded():
    w = _weight(3, 100, seed=4)  # 300 values: four whole blocks and 44 values
    padded = F.pad(w.reshape(-1), (0, 20))
    assert torch.equal(NF4Weight.quantize(w).dequantize(), NF4Weight.quantize(padded).dequantize()[:300].view(3, 100))
    lin = NF4Linear(w)
    assert lin(torch.ones(2, 100)).shape == (2, 3)


def test_nbytes_is_the_exact_formula():
    w = _weight(256, 512)
    n = w.numel()
    q = NF4Weight.quantize(w)
    assert q.nbytes == n // 2 + n // 64 + 4 * n // (64 * 256) + 4 == 67620
    per_weight = q.nbytes / n
    assert 0.5 < per_weight < 0.52  # 4.127 bits, vs 4 bytes in fp32 and 2 in bf16
    assert q.packed.dtype == torch.uint8 and q.scale_q.dtype == torch.int8
    assert q.scale_factor.dtype == q.scale_mean.dtype == torch.float32


def test_round_trip_error_of_a_normal_weight_is_small():
    w = _weight(256, 512, seed=5) * 0.02
    err = NF4Weight.quantize(w).dequantize() - w
    # measured: mean |err| / std = 0.073, RMS err / std = 0.092
    assert err.abs().mean() / w.std() < 0.08
    assert err.pow(2).mean().sqrt() / w.std() < 0.1


def test_error_is_below_int4_absmax_at_the_same_block_size():
    """NF4's levels follow the normal distribution; uniform int4 levels (-7..7 times absmax/7 per block of
    64) waste range on the tails, so on Gaussian weights NF4 is closer."""
    w = _weight(256, 512, seed=6) * 0.02
    nf4_err = (NF4Weight.quantize(w).dequantize() - w).pow(2).mean()
    blocks = w.reshape(-1, 64)
    scale = blocks.abs().amax(dim=1, keepdim=True) / 7
    int4 = (blocks / scale).round().clamp(-7, 7) * scale
    int4_err = (int4.reshape(w.shape) - w).pow(2).mean()
    assert nf4_err < 0.8 * int4_err


def test_frozen_storage_is_at_most_0_53_bytes_a_weight():
    for shape in [(768, 2304), (2048, 2048), (64, 96)]:
        q = NF4Weight.quantize(_weight(*shape, seed=7))
        assert q.nbytes / q.numel <= 0.53, shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_linear_forward_and_gradients(dtype):
    base = nn.Linear(128, 64)
    lin = NF4Linear.from_linear(base)
    assert (lin.in_features, lin.out_features, lin.weight_dtype) == (128, 64, torch.float32)
    # the NF4 storage is frozen parameters (so that FSDP2 shards them), none of them trainable
    assert [(name, p.requires_grad) for name, p in lin.named_parameters()] == [
        ("bias", False), ("packed", False), ("scale_q", False), ("scale_factor", False)]
    x = torch.randn(4, 3, 128, dtype=dtype, requires_grad=True)
    w = lin.dequantized_weight(dtype)

    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = lin(x)
    assert out.dtype == dtype
    assert torch.equal(out, F.linear(x, w, lin.bias.to(dtype)))
    # only the 4-bit storage is kept for backward, never a dense weight
    assert not any(t.is_floating_point() and t.shape == (64, 128) for t in saved)

    g = torch.randn_like(out)
    out.backward(g)
    x_ref = x.detach().clone().requires_grad_()
    F.linear(x_ref, w, lin.bias.to(dtype)).backward(g)
    assert torch.equal(x.grad, x_ref.grad)
    assert all(p.grad is None for p in lin.parameters()) and all(b.grad is None for b in lin.buffers())


def test_nf4_linear_bias_gets_a_gradient_if_unfrozen():
    lin = NF4Linear(_weight(64, 64), torch.zeros(64))
    lin.bias.requires_grad_(True)
    lin(torch.ones(5, 64)).sum().backward()
    assert torch.equal(lin.bias.grad, torch.full((64,), 5.0))


def test_nf4_linear_state_dict_and_dtype_casts():
    lin = NF4Linear.from_linear(nn.Linear(128, 64))
    w = lin.dequantized_weight()
    keys = list(lin.state_dict())
    assert keys == ["bias", "packed", "scale_q", "scale_factor", "scale_mean", "code"]
    fresh = NF4Linear(torch.zeros(64, 128), torch.zeros(64))
    fresh.load_state_dict(lin.state_dict())
    assert torch.equal(fresh.dequantized_weight(), w)
    # a model-wide .to(bf16) casts the bias but not the fp32 scale metadata (the group factors are kept as
    # their int32 bit patterns, which no cast touches), so the weight is unchanged
    lin.to(torch.bfloat16)
    assert lin.bias.dtype == torch.bfloat16
    assert lin.scale_mean.dtype == lin.code.dtype == torch.float32 and lin.scale_factor.dtype == torch.int32
    assert list(lin.state_dict()) == keys and list(dict(lin.named_buffers())) == keys[4:]
    assert torch.equal(lin.dequantized_weight(), w)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nf4_linear_moves_to_cuda():
    lin = NF4Linear.from_linear(nn.Linear(128, 64))
    w = lin.dequantized_weight()
    lin = lin.to("cuda", torch.bfloat16)
    assert lin.packed.is_cuda and lin.scale_mean.dtype == torch.float32
    assert torch.equal(lin.dequantized_weight().cpu(), w)
    x = torch.randn(2, 128, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(lin(x), F.linear(x, w.cuda().bfloat16(), lin.bias))
    assert torch.equal(NF4Weight.quantize(w.cuda()).dequantize().cpu(), NF4Weight.quantize(w).dequantize())


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match=r"2-D .*shape \(4, 8, 16\)"):
        NF4Linear(torch.randn(4, 8, 16))
    with pytest.raises(ValueError, match=r"shape \(64,\)"):
        NF4Linear(torch.randn(64))
    with pytest.raises(ValueError, match=r"bias of shape \(3,\)"):
        NF4Linear(torch.randn(4, 64), torch.zeros(3))
    with pytest.raises(ValueError, match="floating-point"):
        NF4Weight.quantize(torch.ones(64, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"empty weight of shape \(0, 64\)"):
        NF4Weight.quantize(torch.ones(0, 64))
    with pytest.raises(ValueError, match="block_size must be even"):
        NF4Weight.quantize(torch.ones(64), block_size=63)
    with pytest.raises(ValueError, match="exactly 16 levels"):
        NF4Weight.quantize(torch.ones(64), code=[0.0, 1.0])
