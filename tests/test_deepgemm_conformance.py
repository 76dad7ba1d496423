"""Conformance against DeepGEMM itself (deepseek-ai/DeepGEMM at commit 54e2261).

Skipped unless a CUDA GPU is present and ``import deep_gemm`` works (on the GPU machine:
``source .device/env.sh && source .device/deepgemm/env.sh``). Three comparisons:

1. **Bit-exact** (``deep_gemm.utils`` and DeepGEMM's layout helpers), on random and adversarial
   inputs (ties at the group amax, rounding ties of e4m3 / e2m1, all-zero and negative-zero
   groups, values near the dtype's max, subnormals, amax at the 1e-4 floor, inf / NaN), on CPU
   and CUDA tensors: ``per_token_cast_to_fp8`` / ``per_token_cast_to_fp4`` (every valid
   ``use_ue8m0`` x ``gran_k`` x ``use_packed_ue8m0``), ``per_channel_cast_to_fp8``,
   ``per_block_cast_to_fp8``, ``cast_back_from_fp4``, ``transpose_packed_fp4``,
   ``ceil_to_ue8m0``, UE8M0 pack / unpack, the TMA-aligned MN-major scale layouts
   (``get_tma_aligned_size``, ``get_mn_major_tma_aligned_tensor``,
   ``get_mn_major_tma_aligned_packed_ue8m0_tensor``) against our pool scale regions and
   ``weight_sf_for_sm100``, ``transform_weights_for_mega_moe`` for DeepGEMM's two weight
   formats (FP8xFP4 and BF16; DeepGEMM has no FP8xFP8 weight transform), and our GPU staging
   kernel (``stage_inputs``) against DeepGEMM's casts. Bytes are compared exactly (uint8 /
   int32 views); float outputs bit for bit, two NaNs counting as equal.
2. **Our grouped GEMMs against DeepGEMM's** (``m_grouped_fp8_gemm_nt_contiguous``,
   ``m_grouped_bf16_gemm_nt_contiguous``; on SM100 also ``m_grouped_fp8_fp4_gemm_nt_contiguous``)
   on the same pool rows and the same weight bytes our kernels read. Our L1 kernel never writes
   its pre-activation accumulator (SwiGLU, routing weight and requantization are fused into its
   epilogue), so L1 is compared through DeepGEMM's L1 output -> ``reference.swiglu_reference``
   -> ``quant.requant_fp8_pow2`` (what our epilogue computes from its accumulator) against our
   L2 input; L2 alone as DeepGEMM's L2 on *our* L2 input against our output; and the whole
   chain (DeepGEMM L1 -> reference SwiGLU/requant -> DeepGEMM L2) against our output. Error
   statistics are printed for each.
3. **SM100 only** (marked ``sm100``): our layer (``stage_inputs`` + ``mega_moe``) against
   ``deep_gemm.fp8_fp4_mega_moe`` / ``bf16_mega_moe`` on the same inputs; staged inputs,
   weights and receive statistics bit-exact, ``y`` within tolerance.

Each tolerance comparison prints ``[deepgemm] <name>: <error statistics>`` (so does a bit-exact
comparison that fails), and the module ends with a summary: per comparison, how many cases
were bit-exact. Run with ``-s`` to see it:

    source .device/env.sh && source .device/deepgemm/env.sh && \\
        python3 -m pytest -q -s -m deepgemm tests/test_deepgemm_conformance.py
"""

from __future__ import annotations

import math
import zlib
from collections import defaultdict

import pytest
import torch

from cute_megamoe import quant, reference
from cute_megamoe.utils import align


def _import_deep_gemm():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (DeepGEMM is CUDA-only)", allow_module_level=True)
    try:
        import deep_gemm
    except Exception as exc:  # ImportError, or a broken build failing in `_C.init`
        pytest.skip(f"deep_gemm cannot be imported ({type(exc).__name__}: {exc})",
                    allow_module_level=True)
    return deep_gemm


deep_gemm = _import_deep_gemm()
dgu = deep_gemm.utils

pytestmark = [pytest.mark.deepgemm, pytest.mark.gpu]

DEVICES = ("cpu", "cuda")
DTYPES = (torch.bfloat16, torch.float32)
E4M3_MAX, E2M1_MAX = 448.0, 6.0


# ----------------------------------------------------------------------------------------------
# Reporting: one line per comparison, a summary at the end of the module
# ----------------------------------------------------------------------------------------------

_EXACT: dict[str, list[bool]] = defaultdict(list)  # asserted bit-exact
_OBSERVED: dict[str, list[bool]] = defaultdict(list)  # within tolerance; bit-exact or not
_NOTES: list[str] = []


def _note(line: str) -> None:
    line = f"[deepgemm] {line}"
    print(line)
    _NOTES.append(line)


@pytest.fixture(scope="module", autouse=True)
def _summary():
    yield
    print("\n======== DeepGEMM conformance summary ========")
    print("asserted bit-exact:")
    for name, results in sorted(_EXACT.items()):
        state = "bit-exact" if all(results) else "DIFFERS"
        print(f"  {name}: {sum(results)}/{len(results)} cases bit-exact -> {state}")
    print("compared within tolerance (how many cases happened to be bit-exact):")
    for name, results in sorted(_OBSERVED.items()):
        print(f"  {name}: {sum(results)}/{len(results)} cases bit-exact")
    print("details:")
    for line in _NOTES:
        print(f"  {line}")


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A row-major copy on the CPU (``contiguous()`` may keep odd strides of size-1 dims)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return _dense(t).view(torch.uint8)


def _num_diff(ours: torch.Tensor, theirs: torch.Tensor) -> int:
    """Elements that differ: raw bytes for integer / FP8 tensors, bits for float tensors with
    two NaNs equal. Shapes and dtypes must agree."""
    assert ours.dtype == theirs.dtype, (ours.dtype, theirs.dtype)
    assert ours.shape == theirs.shape, (tuple(ours.shape), tuple(theirs.shape))
    a, b = _dense(ours), _dense(theirs)
    if a.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        ints = {4: torch.int32, 2: torch.int16, 8: torch.int64}[a.element_size()]
        same = (a.view(ints) == b.view(ints)) | (torch.isnan(a) & torch.isnan(b))
        return int((~same).sum())
    if a.element_size() == 1:
        return int((a.view(torch.uint8) != b.view(torch.uint8)).sum())
    ints = {4: torch.int32, 2: torch.int16, 8: torch.int64}[a.element_size()]
    return int((a.view(ints) != b.view(ints)).sum())


def _exact(name: str, case: str, pairs: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
    """Assert every (what, ours, theirs) pair bit-exact; record and print the outcome."""
    diffs = {what: _num_diff(o, t) for what, o, t in pairs}
    ok = not any(diffs.values())
    _EXACT[name].append(ok)
    if not ok:
        _note(f"{name} [{case}]: DIFFERS {diffs}")
    assert ok, f"{name} [{case}]: elements differing from DeepGEMM: {diffs}"


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) % 100_000


# ----------------------------------------------------------------------------------------------
# Adversarial inputs
# ----------------------------------------------------------------------------------------------

PATTERNS = ("random", "zeros", "neg_zeros", "amax_ties", "rounding_ties", "raw_scale_ties",
            "huge", "tiny", "tiny_with_one", "amax_at_floor", "scale_near_pow2")


def _e4m3_midpoints() -> torch.Tensor:
    """Midpoints between neighbouring e4m3 values (normal and subnormal), in (0, 448)."""
    normal = [(1 + (2 * k + 1) / 16) * 2.0**e for e in range(-6, 9) for k in range(8)]
    sub = [(2 * k + 1) * 2.0**-10 for k in range(8)]
    return torch.tensor([v for v in normal + sub if v < E4M3_MAX])


def _e2m1_ties() -> torch.Tensor:
    t = torch.tensor(quant.E2M1_THRESHOLDS)
    return torch.cat([t, torch.nextafter(t, t + 1), torch.nextafter(t, t - 1)])


def _pattern(kind: str, size: int, qmax: float, dtype: torch.dtype,
             gen: torch.Generator) -> torch.Tensor:
    """One quantization group of ``size`` float32 values (representable or not in ``dtype``:
    the cast to ``dtype`` happens later and may round them)."""
    fmax, tiny = torch.finfo(dtype).max, torch.finfo(dtype).smallest_normal
    sign = torch.where(torch.rand(size, generator=gen) < 0.5, -1.0, 1.0)
    scale = 2.0 ** float(torch.randint(-30, 31, (1,), generator=gen))
    if kind == "random":
        exps = torch.randint(-20, 21, (size,), generator=gen).float()
        return torch.randn(size, generator=gen) * torch.exp2(exps)
    if kind == "zeros":
        return torch.zeros(size)
    if kind == "neg_zeros":
        return torch.where(torch.rand(size, generator=gen) < 0.7, -0.0, 0.0)
    if kind == "amax_ties":  # several elements at +amax and -amax
        v = (torch.rand(size, generator=gen) * 1.8 - 0.9) * scale
        hit = torch.rand(size, generator=gen) < 0.25
        hit[:2] = True
        return torch.where(hit, sign * scale, v)
    if kind == "rounding_ties":  # amax = qmax * 2^j: the scale is exactly 2^j, values at ties
        ties = _e4m3_midpoints() if qmax == E4M3_MAX else _e2m1_ties()
        v = ties[torch.randint(0, len(ties), (size,), generator=gen)] * sign * scale
        v[0] = qmax * scale
        return v
    if kind == "raw_scale_ties":  # a scale that is no power of two, values at tie * scale:
        # x * (1 / sf) and x / sf land on either side of a tie (float32 inputs)
        ties = _e4m3_midpoints() if qmax == E4M3_MAX else _e2m1_ties()
        sf = (1 + torch.rand(1, generator=gen)) * scale
        v = ties[torch.randint(0, len(ties), (size,), generator=gen)] * sf * sign
        v[0] = qmax * sf
        return v
    if kind == "huge":  # near the dtype's max (bf16 max for bf16 inputs)
        v = torch.rand(size, generator=gen) * fmax * sign
        v[: min(size, 3)] = torch.tensor([fmax, -fmax, fmax / 2])[: min(size, 3)]
        return v
    if kind == "tiny":  # subnormals of the dtype only
        return sign * tiny * torch.rand(size, generator=gen) * 2.0**-3
    if kind == "tiny_with_one":  # one normal value among subnormals and zeros
        v = sign * tiny * torch.rand(size, generator=gen)
        v[size // 2] = 1.0
        return v
    if kind == "amax_at_floor":  # amax within float32 rounding of the 1e-4 clamp
        v = (torch.rand(size, generator=gen) * 2 - 1) * 1e-4
        up = bool(torch.rand(1, generator=gen) < 0.5)
        v[0] = float(torch.nextafter(torch.tensor(1e-4), torch.tensor(1.0 if up else 0.0)))
        return v
    if kind == "scale_near_pow2":  # amax / qmax one float32 ulp either side of 2^j
        target = torch.tensor(qmax * scale)
        v = (torch.rand(size, generator=gen) * 2 - 1) * qmax * scale * 0.5
        up = bool(torch.rand(1, generator=gen) < 0.5)
        v[0] = float(torch.nextafter(target, target * (2 if up else 0)))
        return v
    raise ValueError(kind)


def _nonfinite_group(size: int, gen: torch.Generator) -> torch.Tensor:
    v = torch.randn(size, generator=gen)
    v[torch.randint(0, size, (3,), generator=gen)] = torch.tensor(
        [float("inf"), float("-inf"), float("nan")])
    return v


def _token_input(m_random: int, n: int, gran: int, qmax: float, dtype: torch.dtype, seed: int,
                 nonfinite: bool = False) -> torch.Tensor:
    """``[len(PATTERNS) + m_random (+1), n]``: each row one pattern per group of ``gran``
    columns (the last group may be partial), then random rows (magnitudes 2^-20 .. 2^20)."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-n // gran)
    rows = []
    for kind in PATTERNS + ("random",) * m_random:
        rows.append(torch.cat([_pattern(kind, gran, qmax, dtype, gen)
                               for _ in range(groups)])[:n])
    if nonfinite:
        rows.append(torch.cat([_nonfinite_group(gran, gen) for _ in range(groups)])[:n])
    return torch.stack(rows).to(dtype)


def _block_input(m: int, n: int, gran: int, qmax: float, dtype: torch.dtype,
                 seed: int) -> torch.Tensor:
    """``[m, n]`` whose ``gran x gran`` blocks cycle through the patterns."""
    gen = torch.Generator().manual_seed(seed)
    bm, bn = -(-m // gran), -(-n // gran)
    x = torch.empty(bm * gran, bn * gran)
    for i in range(bm):
        for j in range(bn):
            kind = PATTERNS[(i * bn + j) % len(PATTERNS)]
            block = _pattern(kind, gran * gran, qmax, dtype, gen).view(gran, gran)
            x[i * gran:(i + 1) * gran, j * gran:(j + 1) * gran] = block
    return x[:m, :n].contiguous().to(dtype)


# ----------------------------------------------------------------------------------------------
# 1. Bit-exact: casts, UE8M0, layouts, weight transforms
# ----------------------------------------------------------------------------------------------

CAST_FLAGS = [(False, False), (True, False), (True, True)]  # (use_ue8m0, use_packed_ue8m0)


def _packed_from_dg_sf(sf: torch.Tensor) -> torch.Tensor:
    """DeepGEMM's own packing of float UE8M0 scales, the row padded with 1.0 scales to a
    multiple of four (what its FP4 cast does; its FP8 cast asserts instead)."""
    pad = -sf.shape[-1] % 4
    return dgu.pack_ue8m0_to_int(torch.nn.functional.pad(sf, (0, pad), value=1.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gran_k", (32, 64, 128))
@pytest.mark.parametrize("use_ue8m0,use_packed", CAST_FLAGS)
@pytest.mark.parametrize("n,nonfinite", [(512, False), (200, False), (96, True)])
def test_per_token_cast_to_fp8(device, dtype, gran_k, use_ue8m0, use_packed, n, nonfinite):
    x = _token_input(3, n, gran_k, E4M3_MAX, dtype, _seed("fp8", dtype, gran_k, n),
                     nonfinite).to(device)
    case = f"{device} {dtype} gran_k={gran_k} ue8m0={use_ue8m0} packed={use_packed} n={n}"
    ours = quant.per_token_cast_to_fp8(x, use_ue8m0, gran_k, use_packed)
    if use_packed and (-(-n // gran_k)) % 4 != 0:
        # DeepGEMM's FP8 cast asserts when the scale row is not a multiple of 4 groups; ours
        # pads it with 1.0 scales as DeepGEMM's FP4 cast does (a documented difference)
        theirs_q, theirs_sf = dgu.per_token_cast_to_fp8(x, use_ue8m0, gran_k, False)
        theirs_sf = _packed_from_dg_sf(theirs_sf)
    else:
        theirs_q, theirs_sf = dgu.per_token_cast_to_fp8(x, use_ue8m0, gran_k, use_packed)
    _exact("per_token_cast_to_fp8", case, [("q", ours[0], theirs_q), ("sf", ours[1], theirs_sf)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gran_k", (32, 64, 128))
@pytest.mark.parametrize("use_ue8m0,use_packed", CAST_FLAGS)
@pytest.mark.parametrize("n,nonfinite", [(512, False), (200, False), (96, True)])
def test_per_token_cast_to_fp4_and_back(device, dtype, gran_k, use_ue8m0, use_packed, n,
                                        nonfinite):
    x = _token_input(3, n, gran_k, E2M1_MAX, dtype, _seed("fp4", dtype, gran_k, n),
                     nonfinite).to(device)
    case = f"{device} {dtype} gran_k={gran_k} ue8m0={use_ue8m0} packed={use_packed} n={n}"
    ours_q, ours_sf = quant.per_token_cast_to_fp4(x, use_ue8m0, gran_k, use_packed)
    theirs_q, theirs_sf = dgu.per_token_cast_to_fp4(x, use_ue8m0, gran_k, use_packed)
    _exact("per_token_cast_to_fp4", case, [("packed", ours_q, theirs_q),
                                           ("sf", ours_sf, theirs_sf)])
    back = quant.cast_back_from_fp4(ours_q, ours_sf, gran_k, use_packed)
    theirs_back = dgu.cast_back_from_fp4(theirs_q, theirs_sf, gran_k, use_packed)
    _exact("cast_back_from_fp4", case, [("x", back, theirs_back)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gran_k", (32, 128))
@pytest.mark.parametrize("use_packed", (False, True))
def test_cast_back_from_fp4_every_code(device, gran_k, use_packed):
    """Every byte (two e2m1 codes, both signs, code 8 = -0) under random scales."""
    gen = torch.Generator().manual_seed(_seed("back", gran_k, use_packed))
    m, n = 6, 512
    packed = torch.arange(m * n // 2, dtype=torch.int32).remainder(256).to(torch.uint8)
    packed = packed.view(m, n // 2)[:, torch.randperm(n // 2, generator=gen)]
    packed = packed.contiguous().view(torch.int8).to(device)
    groups = n // gran_k
    if use_packed:  # exponent bytes 1..254 (0 is never produced by a cast, see quant docs)
        sf = torch.randint(1, 255, (m, groups), generator=gen).to(torch.uint8)
        sf = sf.view(torch.int32).to(device)  # groups is a multiple of 4 here
    else:
        sf = (torch.rand(m, groups, generator=gen) * 2.0 ** torch.randint(
            -40, 40, (m, groups), generator=gen).float()).to(device)
    ours = quant.cast_back_from_fp4(packed, sf, gran_k, use_packed)
    theirs = dgu.cast_back_from_fp4(packed, sf, gran_k, use_packed)
    _exact("cast_back_from_fp4", f"{device} every code gran_k={gran_k} packed={use_packed}",
           [("x", ours, theirs)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_ue8m0", (False, True))
@pytest.mark.parametrize("shape,gran_k", [((256, 384), 128), ((200, 300), 128),
                                          ((130, 70), 64), ((5, 7), 128)])
def test_per_block_cast_to_fp8(device, dtype, use_ue8m0, shape, gran_k):
    x = _block_input(*shape, gran_k, E4M3_MAX, dtype, _seed("block", shape, dtype)).to(device)
    ours = quant.per_block_cast_to_fp8(x, use_ue8m0, gran_k)
    theirs = dgu.per_block_cast_to_fp8(x, use_ue8m0, gran_k)
    _exact("per_block_cast_to_fp8", f"{device} {dtype} {shape} gran_k={gran_k} "
           f"ue8m0={use_ue8m0}", [("q", ours[0], theirs[0]), ("sf", ours[1], theirs[1])])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_ue8m0", (False, True))
@pytest.mark.parametrize("gran_k", (32, 128))
def test_per_channel_cast_to_fp8(device, dtype, use_ue8m0, gran_k):
    # the token patterns along the rows of x^T are the channel groups of x
    x = _token_input(2, 2 * gran_k, gran_k, E4M3_MAX, dtype,
                     _seed("channel", dtype, gran_k)).t().contiguous().to(device)
    ours = quant.per_channel_cast_to_fp8(x, use_ue8m0, gran_k)
    theirs = dgu.per_channel_cast_to_fp8(x, use_ue8m0, gran_k)
    _exact("per_channel_cast_to_fp8", f"{device} {dtype} gran_k={gran_k} ue8m0={use_ue8m0}",
           [("q", ours[0], theirs[0]), ("sf", ours[1], theirs[1])])


@pytest.mark.parametrize("device", DEVICES)
def test_transpose_packed_fp4(device):
    gen = torch.Generator().manual_seed(_seed("transpose"))
    for m, half_n in ((2, 1), (64, 48), (130, 17)):
        a = torch.randint(-128, 128, (m, half_n), generator=gen, dtype=torch.int8).to(device)
        _exact("transpose_packed_fp4", f"{device} {m}x{2 * half_n}",
               [("t", quant.transpose_packed_fp4(a), dgu.transpose_packed_fp4(a))])


def _special_floats() -> torch.Tensor:
    bits = torch.randint(-(2**31), 2**31 - 1, (4096,), generator=torch.Generator().manual_seed(5),
                         dtype=torch.int64).to(torch.int32)
    special = torch.tensor([0.0, -0.0, 1.0, 3.0, 2.0**-126, 2.0**-127, 1e-45, 2.0**127, 3e38,
                            float("inf"), float("-inf"), float("nan"), -5.0, 448.0, 1e-4 / 448])
    pow2 = torch.exp2(torch.arange(-149, 128).float())
    near = torch.cat([torch.nextafter(pow2, pow2 * 2), torch.nextafter(pow2, pow2 * 0)])
    return torch.cat([bits.view(torch.float32), special, pow2, near])


@pytest.mark.parametrize("device", DEVICES)
def test_ceil_to_ue8m0(device):
    v = _special_floats().to(device)
    _exact("ceil_to_ue8m0", device, [("sf", quant.ceil_to_ue8m0(v), dgu.ceil_to_ue8m0(v))])
    for dtype in (torch.bfloat16, torch.float16):
        w = v.to(dtype)
        _exact("ceil_to_ue8m0", f"{device} {dtype}",
               [("sf", quant.ceil_to_ue8m0(w), dgu.ceil_to_ue8m0(w))])


@pytest.mark.parametrize("device", DEVICES)
def test_ue8m0_pack_unpack(device):
    # every exponent byte as a float32 power of two (byte 0 as +0.0, byte 255 as +inf)
    byte = torch.arange(256, dtype=torch.int32).roll(17)
    sf = (byte << 23).view(torch.float32).view(8, 32).to(device)
    ours = quant.pack_ue8m0_to_int(sf)
    _exact("pack_ue8m0_to_int", device, [("words", ours, dgu.pack_ue8m0_to_int(sf))])
    # random words: every byte decodes to 2^(b - 127) in both, except byte 0: 2^-127 in ours
    # (the UE8M0 meaning), 0.0 in DeepGEMM's (documented in quant's module docstring)
    words = torch.randint(-(2**31), 2**31 - 1, (16, 8), dtype=torch.int64,
                          generator=torch.Generator().manual_seed(9)).to(torch.int32)
    words = torch.cat([words, ours.view(-1, 8).cpu()]).to(device)
    unpacked, theirs = quant.unpack_ue8m0_from_int(words), dgu.unpack_ue8m0_from_int(words)
    byte0 = (_bytes(words).view(unpacked.shape) == 0).to(device)
    assert bool(byte0.any())
    assert bool((theirs[byte0] == 0.0).all()) and bool((unpacked[byte0] == 2.0**-127).all())
    _exact("unpack_ue8m0_from_int", f"{device} (bytes != 0)",
           [("sf", unpacked[~byte0], theirs[~byte0])])
    _note(f"unpack_ue8m0_from_int [{device}]: byte 0 -> 2^-127 (ours) vs 0.0 (DeepGEMM), "
          f"{int(byte0.sum())} such bytes; deliberate difference, never produced by a cast")


def test_tma_aligned_size():
    for x in (1, 3, 4, 7, 100, 4097, 8192):
        for elem in (1, 2, 4):
            got = deep_gemm.get_tma_aligned_size(x, elem)
            assert got == align(x, 16 // elem), (x, elem, got)
    _EXACT["get_tma_aligned_size"].append(True)


@pytest.mark.parametrize("recipe", ("fp8xfp8", "fp8xfp4"))
def test_pool_scale_layout_is_deep_gemm_tma_aligned_mn_major(recipe):
    """Our pool scale region (``l1_acts_sf``, what the dispatch fills and the GEMMs read) has
    the strides and words of DeepGEMM's TMA-aligned MN-major scale tensor of the same rows."""
    from cute_megamoe.layout import MegaMoELayout

    layout = MegaMoELayout(1, 8, 96, 4, 1024, 256, recipe)
    p, h = layout.num_pool_rows, layout.hidden
    region = layout.view(torch.zeros(layout.num_bytes, dtype=torch.uint8, device="cuda"),
                         "l1_acts_sf")
    x = _token_input(p - len(PATTERNS), h, 32 if recipe == "fp8xfp4" else 128, E4M3_MAX,
                     torch.bfloat16, _seed("pool", recipe)).cuda()
    _, ours_sf = quant.quantize_activations_for_recipe(x, recipe)
    region.copy_(ours_sf)
    if recipe == "fp8xfp8":
        theirs = deep_gemm.get_mn_major_tma_aligned_tensor(dgu.per_token_cast_to_fp8(
            x, use_ue8m0=True, gran_k=128)[1])
    else:
        theirs = deep_gemm.get_mn_major_tma_aligned_packed_ue8m0_tensor(
            dgu.per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=32)[1])
    assert region.stride() == theirs.stride() == (1, p), (region.stride(), theirs.stride())
    _exact("pool scale layout (get_mn_major_tma_aligned*)", recipe, [("sf", region, theirs)])


@pytest.mark.parametrize("mn,n", [(98, 224), (256, 512), (4097, 128)])
def test_packed_ue8m0_tma_layout_words(mn, n):
    """DeepGEMM's packing kernel against our packed cast, for MN not a multiple of 4 and scale
    rows not a multiple of 4 groups: the words agree on every real group; the pad bytes of the
    last word are 0 in DeepGEMM's layout kernel and 1.0 (byte 127) in ours (and in DeepGEMM's
    FP4 cast), never read by a kernel."""
    x = _token_input(mn - len(PATTERNS), n, 32, E4M3_MAX, torch.bfloat16,
                     _seed("tma", mn, n)).cuda()
    theirs = deep_gemm.get_mn_major_tma_aligned_packed_ue8m0_tensor(
        dgu.per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=32)[1])
    _, ours = quant.per_token_cast_to_fp8(x, True, 32, use_packed_ue8m0=True)
    assert theirs.shape == ours.shape and theirs.stride() == (1, align(mn, 4))
    groups = n // 32
    ours_b, theirs_b = _bytes(ours), _bytes(theirs)
    _exact("get_mn_major_tma_aligned_packed_ue8m0_tensor", f"mn={mn} groups={groups}",
           [("bytes", ours_b[:, :groups], theirs_b[:, :groups])])
    if groups % 4:
        assert bool((theirs_b[:, groups:] == 0).all()) and bool((ours_b[:, groups:] == 127).all())
        _note(f"get_mn_major_tma_aligned_packed_ue8m0_tensor [mn={mn} groups={groups}]: pad "
              f"bytes 0 (DeepGEMM layout kernel) vs 127 (ours, DeepGEMM's FP4 cast); never read")


def _random_fp4_weights(e: int, n: int, k: int, gen: torch.Generator, mn_major: bool):
    w = torch.randint(-128, 128, (e, n, k // 2), generator=gen, dtype=torch.int8)
    sf = torch.randint(-(2**31), 2**31 - 1, (e, n, k // 128), generator=gen,
                       dtype=torch.int64).to(torch.int32)
    if mn_major:
        sf = sf.transpose(1, 2).contiguous().transpose(1, 2)
    return w, sf


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mn_major", (False, True))
def test_transform_weights_for_mega_moe(device, mn_major):
    """FP8xFP4 (L1 gate/up interleave of weight and scales, UTCCP transpose of both scale
    tensors; ours with arch='sm100') and BF16 (L1 interleave), on arbitrary bytes; strides
    (K-major or MN-major scales) preserved as DeepGEMM preserves them."""
    gen = torch.Generator().manual_seed(_seed("transform", mn_major))
    e, inter, hidden = 3, 256, 384
    l1 = tuple(t.to(device) for t in _random_fp4_weights(e, 2 * inter, hidden, gen, mn_major))
    l2 = tuple(t.to(device) for t in _random_fp4_weights(e, hidden, inter, gen, mn_major))
    ours = quant.transform_weights_for_mega_moe(l1, l2, arch="sm100")
    theirs = deep_gemm.transform_weights_for_mega_moe(l1, l2)
    for (o, t) in zip((*ours[0], *ours[1]), (*theirs[0], *theirs[1]), strict=True):
        assert o.stride() == t.stride(), (o.stride(), t.stride())
    _exact("transform_weights_for_mega_moe", f"fp8xfp4 {device} mn_major={mn_major}",
           [("l1 w", ours[0][0], theirs[0][0]), ("l1 sf", ours[0][1], theirs[0][1]),
            ("l2 w", ours[1][0], theirs[1][0]), ("l2 sf", ours[1][1], theirs[1][1])])
    b1 = torch.randn(e, 2 * inter, hidden, generator=gen).to(torch.bfloat16).to(device)
    b2 = torch.randn(e, hidden, inter, generator=gen).to(torch.bfloat16).to(device)
    ours_b = quant.transform_weights_for_mega_moe(b1, b2, arch="sm100")
    theirs_b = deep_gemm.transform_weights_for_mega_moe(b1, b2)
    _exact("transform_weights_for_mega_moe", f"bf16xbf16 {device}",
           [("l1", ours_b[0], theirs_b[0]), ("l2", ours_b[1], theirs_b[1])])


def _dg_fp4_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepGEMM's own preparation of FP4 expert weights (as its Mega MoE test does it): per
    expert FP4 cast with float UE8M0 scales per 32, then packed MN-major by its layout kernel."""
    qs, sfs = zip(*(dgu.per_token_cast_to_fp4(w[i], use_ue8m0=True, gran_k=32)
                    for i in range(w.shape[0])), strict=True)
    return torch.stack(qs), deep_gemm.get_mn_major_tma_aligned_packed_ue8m0_tensor(
        torch.stack(sfs).contiguous())


def test_sm100_fp4_weights_as_the_kernels_read_them():
    """``ExpertWeights.from_bf16(..., 'fp8xfp4', arch='sm_100a')`` against DeepGEMM's whole
    weight pipeline (FP4 cast, packed MN-major TMA-aligned scales, transform): same weight
    bytes, and our ``[E, K/128, N]`` scale tensor is DeepGEMM's ``[E, N, K/128]`` MN-major
    tensor's memory (``quant.weight_sf_for_sm100``)."""
    from cute_megamoe.expert_gemm import ExpertWeights

    gen = torch.Generator().manual_seed(_seed("sm100 weights"))
    e, inter, hidden = 3, 256, 384
    w1 = (torch.randn(e, 2 * inter, hidden, generator=gen) * 0.05).to(torch.bfloat16).cuda()
    w2 = (torch.randn(e, hidden, inter, generator=gen) * 0.05).to(torch.bfloat16).cuda()
    w1[0, :3, :32] = 0.0  # an all-zero scale group
    ours = ExpertWeights.from_bf16(w1, w2, "fp8xfp4", arch="sm_100a")
    l1, l2 = deep_gemm.transform_weights_for_mega_moe(_dg_fp4_weights(w1), _dg_fp4_weights(w2))
    for sf in (l1[1], l2[1]):
        assert sf.transpose(1, 2).is_contiguous()
    _exact("transform_weights_for_mega_moe", "fp8xfp4 from bf16, as the sm100 kernels read it",
           [("w1", ours.w1, l1[0]), ("w1_sf", ours.w1_sf, l1[1].transpose(1, 2)),
            ("w2", ours.w2, l2[0]), ("w2_sf", ours.w2_sf, l2[1].transpose(1, 2))])


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability()


@pytest.mark.parametrize("recipe", ("fp8xfp4", "fp8xfp8"))
def test_staging_kernel_matches_deep_gemm_casts(recipe):
    """Our GPU staging kernel (``stage_inputs``) writes exactly DeepGEMM's cast of ``x``:
    ``per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=32, use_packed_ue8m0=True)`` for
    fp8xfp4 (what DeepGEMM's Mega MoE test copies into its buffer), ``gran_k=128`` with float
    scales for fp8xfp8. Finite inputs (the kernel's NaN handling is its own)."""
    import cute_megamoe as cm

    if _capability()[0] not in (9, 10):
        pytest.skip("staging kernels are built for sm_90a / sm_100a")
    gran = 32 if recipe == "fp8xfp4" else 128
    hidden, topk, experts = 1024, 4, 8
    x = _token_input(60, hidden, gran, E4M3_MAX, torch.bfloat16, _seed("stage", recipe)).cuda()
    n = x.shape[0]
    buf = cm.get_symm_buffer_for_mega_moe(None, experts, align(n, 64), topk, hidden, 256,
                                          mma_type=recipe)
    gen = torch.Generator().manual_seed(_seed("stage idx", recipe))
    idx = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(n)]).cuda()
    weights = torch.rand(n, topk, generator=gen).cuda()
    cm.stage_inputs(buf, x, idx, weights)
    torch.cuda.synchronize()
    q, sf = dgu.per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=gran,
                                      use_packed_ue8m0=recipe == "fp8xfp4")
    _exact("stage_inputs kernel vs DeepGEMM casts", recipe,
           [("x", buf.x[:n], q), ("x_sf", buf.x_sf[:n], sf)])


# ----------------------------------------------------------------------------------------------
# 2. Grouped GEMMs: ours against DeepGEMM's, on the same pool and weights
# ----------------------------------------------------------------------------------------------

COUNTS = {"random": [300, 41, 129, 1, 77, 256, 5, 200], "skewed": [700, 3, 0, 1, 2, 0, 9, 4]}
#: requantization granularity of the L2 input per recipe
L2_GRAN = {"fp8xfp8": 128, "fp8xfp4": 32}


def _arch_for(recipe: str) -> str | None:
    major = _capability()[0]
    if major == 9 and recipe in ("fp8xfp8", "bf16xbf16"):
        return "sm_90a"
    if major == 10 and recipe in ("fp8xfp4", "bf16xbf16"):
        return "sm_100a"
    return None


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t[index]`` for any dtype (FP8 gathered as bytes)."""
    return _u8(t)[index].view(t.dtype) if t.element_size() == 1 else t[index]


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    return quant.deinterleave_gate_up(_u8(t)).view(t.dtype) if t.element_size() == 1 \
        else quant.deinterleave_gate_up(t)


class _Pool:
    """A pool as the dispatch lays it out (expert-major, padded to ``block_m``, random
    garbage in pad rows), its quantized operands, and DeepGEMM's contiguous layout of the same
    valid rows (each expert from a multiple of DeepGEMM's M alignment, pad rows -1)."""

    def __init__(self, recipe: str, arch: str, counts: list[int], block_m: int, hidden: int,
                 inter: int, seed: int):
        from cute_megamoe.expert_gemm import ExpertWeights
        from cute_megamoe.scheduler.host_model import pool_block_offsets

        dev = torch.device("cuda")
        gen = torch.Generator().manual_seed(seed)
        self.recipe, self.block_m, self.counts = recipe, block_m, counts
        self.hidden, self.inter = hidden, inter
        e_l = len(counts)
        offsets = pool_block_offsets(counts, block_m)
        self.pool_rows = (offsets[-1] + 1) * block_m
        x = (torch.randn(self.pool_rows, hidden, generator=gen) * 2).to(torch.bfloat16).to(dev)
        if recipe == "bf16xbf16":
            self.acts, self.acts_sf = x, None
        else:
            q, sf = quant.quantize_activations_for_recipe(x, recipe)
            self.acts, self.acts_sf = q, sf.t().contiguous().t()  # MN-major, as the pool
        self.topk_weights = torch.rand(self.pool_rows, generator=gen).to(dev)
        w1 = (torch.randn(e_l, 2 * inter, hidden, generator=gen) / hidden**0.5)
        w2 = (torch.randn(e_l, hidden, inter, generator=gen) / inter**0.5)
        w1, w2 = w1.to(torch.bfloat16).to(dev), w2.to(torch.bfloat16).to(dev)
        self.weights = ExpertWeights.from_bf16(w1, w2, recipe, arch=arch, tiled=False)
        q1 = quant.quantize_weights_for_recipe(w1, recipe)
        q2 = quant.quantize_weights_for_recipe(w2, recipe)
        self.w1_deq = quant.dequantize_weights_for_recipe(q1, recipe).float()  # gate | up
        self.w2_deq = quant.dequantize_weights_for_recipe(q2, recipe).float()
        if recipe == "bf16xbf16":
            self.x_deq = x.float()
        else:
            self.x_deq = quant.dequantize_activations_for_recipe(
                (self.acts, self.acts_sf.contiguous()), recipe).float()

        # our valid pool rows (src) and their DeepGEMM rows (dst), expert by expert
        self.m_align = deep_gemm.get_mk_alignment_for_contiguous_layout()
        src, dst, m_indices, start = [], [], [], 0
        for e, c in enumerate(counts):
            src.append(torch.arange(offsets[e] * block_m, offsets[e] * block_m + c))
            dst.append(torch.arange(start, start + c))
            m_indices += [e] * c + [-1] * (align(c, self.m_align) - c)
            start += align(c, self.m_align)
        self.src, self.dst = torch.cat(src).to(dev), torch.cat(dst).to(dev)
        self.dg_rows = start
        self.m_indices = torch.tensor(m_indices, dtype=torch.int32, device=dev)

    # DeepGEMM's operands ------------------------------------------------------------------

    def dg_weights(self):
        """The weight bytes our kernels read, in DeepGEMM's formats ([gate | up] rows)."""
        w = self.weights
        h, i = self.hidden, self.inter
        if self.recipe == "bf16xbf16":
            return _deinterleave(w.w1), w.w2
        if self.recipe == "fp8xfp8":  # per-128x128-block f32 scales [E, N/128, K/128]
            sf1 = w.w1_sf[:, :, :2 * i // 128].transpose(1, 2).contiguous()
            sf2 = w.w2_sf[:, :, :h // 128].transpose(1, 2).contiguous()
            return (_deinterleave(w.w1), sf1), (w.w2, sf2)
        # fp8xfp4: packed UE8M0 per 32, [E, N, K/128] MN-major, no UTCCP transpose
        sf1 = _deinterleave(quant.untranspose_sf_for_utccp(w.w1_sf.transpose(1, 2)))
        sf2 = quant.untranspose_sf_for_utccp(w.w2_sf.transpose(1, 2))
        return (_deinterleave(w.w1), sf1), (w.w2, sf2)

    def to_dg(self, rows: torch.Tensor, sf: torch.Tensor | None, src_index: torch.Tensor):
        """Rows (and their scales, any layout) placed at DeepGEMM's rows; pad rows zero (scales
        1.0 / byte 127)."""
        m = self.dg_rows
        if rows.element_size() == 1:
            a = torch.zeros(m, rows.shape[1], dtype=torch.uint8, device=rows.device)
            a = a.view(rows.dtype)
        else:
            a = torch.zeros(m, rows.shape[1], dtype=rows.dtype, device=rows.device)
        _u8(a)[self.dst] = _u8(rows)[src_index]
        if sf is None:
            return a
        if sf.dtype == torch.float32:
            out = torch.ones(m, sf.shape[1], device=sf.device)
        else:  # packed UE8M0 words, MN-major and TMA aligned (DeepGEMM checks, no transform)
            out = torch.full((sf.shape[1], align(m, 4)), 0x7F7F7F7F, dtype=torch.int32,
                             device=sf.device).t()[:m]
        out[self.dst] = sf[src_index]
        return a, out

    def dg_gemm(self, a, b, n: int) -> torch.Tensor:
        d = torch.empty(self.dg_rows, n, dtype=torch.bfloat16, device="cuda")
        if self.recipe == "bf16xbf16":
            deep_gemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, self.m_indices)
        elif self.recipe == "fp8xfp8":
            deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, d, self.m_indices)
        else:
            deep_gemm.m_grouped_fp8_fp4_gemm_nt_contiguous(a, b, d, self.m_indices,
                                                           recipe=(1, 1, 32))
        return d

    # ours ---------------------------------------------------------------------------------

    def run_ours(self, activation_clamp, fast_math):
        from cute_megamoe.expert_gemm import expert_ffn

        p, i, h = self.pool_rows, self.inter, self.hidden
        fp8 = self.recipe != "bf16xbf16"
        act_dtype = self.acts.dtype
        # poison: NaN everywhere (0x7F e4m3, 0x7FFF bf16, NaN f32, byte 255 UE8M0)
        l2 = torch.full((p, i), 0x7F if fp8 else 0x7FFF, dtype=torch.uint8 if fp8 else torch.int16,
                        device="cuda").view(act_dtype)
        l2_sf = None
        if self.recipe == "fp8xfp8":
            l2_sf = torch.full((i // 128, p), float("nan"), device="cuda").t()
        elif self.recipe == "fp8xfp4":
            l2_sf = torch.full((i // 128, p), -1, dtype=torch.int32, device="cuda").t()
        out = torch.full((p, h), 0x7FFF, dtype=torch.int16, device="cuda").view(torch.bfloat16)
        counts = torch.tensor(self.counts, dtype=torch.int32, device="cuda")
        expert_ffn(self.acts, self.acts_sf, self.topk_weights, counts, self.weights,
                   block_m=self.block_m, activation_clamp=activation_clamp,
                   fast_math=fast_math, l2_acts=l2, l2_acts_sf=l2_sf, out=out)
        torch.cuda.synchronize()
        return l2, l2_sf, out


def _bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """One BF16 ulp at ``|v|`` (2^(floor(log2|v|) - 7), at least that of the smallest normal)."""
    a = v.abs().float().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)


def _stats(ours: torch.Tensor, theirs: torch.Tensor, bf16_ulps: bool = True) -> dict:
    """Error statistics of ``ours`` against ``theirs`` (same shape and dtype): elements whose
    bits differ, max abs, mean relative (mean |d| / mean |theirs|), norm-relative error and,
    for BF16 results, the largest difference in BF16 ulps and the fraction over one ulp."""
    o, t = ours.float(), theirs.float()
    d = (o - t).abs()
    st = {"n": d.numel(), "differ": _num_diff(ours, theirs) if d.numel() else 0,
          "max_abs": float(d.max()) if d.numel() else 0.0,
          "mean_rel": float(d.mean() / t.abs().mean().clamp_min(1e-30)) if d.numel() else 0.0,
          "rel_norm": float(d.norm() / t.norm().clamp_min(1e-30)) if d.numel() else 0.0}
    if bf16_ulps:
        ulp = d / _bf16_ulp(torch.maximum(o.abs(), t.abs()))
        st["max_ulp"] = float(ulp.max()) if d.numel() else 0.0
        st["frac_gt_1ulp"] = float((ulp > 1).float().mean()) if d.numel() else 0.0
    return st


def _fmt(stats: dict) -> str:
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in stats.items())


# Tolerances, ours against DeepGEMM on the same operands (see each assertion for why):
#: DeepGEMM's L1 against the float64 product of the same dequantized operands, BF16 output:
#: its rounding alone is up to half a BF16 ulp (2^-9 relative), 2^-9 / sqrt(3) in the norm;
#: FP32 accumulation (Hopper FP8 tensor cores keep ~14 bits between promotions) adds less.
DG_L1_REL = 2.0**-8
#: L2 alone (identical e4m3 / BF16 inputs and weights): both accumulate every 128-deep k-block
#: in FP32 and (FP8) promote it with sa * sb, in the same k order; only the FP32 rounding of the
#: order inside / across blocks may differ, which can move the BF16 output by one ulp where the
#: FP32 sum sits at a BF16 rounding boundary. So: no element more than 1 BF16 ulp off, beyond
#: an absolute floor for cancellation (2^-14 of the sum of |products|, the ~14-bit FP8
#: accumulator), and the norm of the difference under a quarter BF16 ulp.
L2_MAX_ULP = 1.0
L2_REL = 2.0**-10
#: L1 through DeepGEMM's accumulator -> reference SwiGLU -> requant against our L2 input: the
#: accumulators differ as above; the BF16 rounding of gate / up then differs where they sit at a
#: rounding boundary, and SiLU (fast: ex2.approx / rcp.approx; precise: expf) differs from
#: torch.exp by a few float32 ulp, so an e4m3 (BF16 for bf16xbf16) code may move by one step.
#: At most 1 % of the L2-input values may move, none by more than that propagated difference
#: plus one rounding step (``delta_h`` in the test), and a scale may differ only where the
#: group amax can cross a power of two within it.
L1_FLIP_FRAC = 1e-2
#: whole chain against our output: the L2 inputs that moved (a fraction f, each by at most one
#: step: 2^-3 of itself for e4m3, 2^-7 for BF16) move the outputs by about sqrt(f) * step in
#: the norm (uncorrelated positions), plus the L2 difference and BF16 output rounding (<= 2^-9):
#: asserted with a factor 2 over that, ``2 * (sqrt(f) * STEP_REL + 2^-9)`` for the measured f.
STEP_REL = {"fp8xfp8": 2.0**-3, "fp8xfp4": 2.0**-3, "bf16xbf16": 2.0**-7}
#: the layer (SM100) against the reference: the project's bound
#: (`testing.dispatch_checks.LAYER_TOLERANCE`), so ours and DeepGEMM's within twice it.
LAYER_REL = 1e-2


def _abs_products(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Sum over k of |x_k w_k| per output (the scale of FP32 accumulation error)."""
    return (x.abs().double() @ w.abs().double().T).float()


def _compare_expert_ffn(recipe: str, counts: list[int], block_m: int, hidden: int, inter: int,
                        activation_clamp, fast_math: bool) -> None:
    arch = _arch_for(recipe)
    if arch is None:
        pytest.skip(f"our {recipe} grouped GEMMs do not run on compute capability "
                    f"{_capability()}")
    name = f"{recipe} bm={block_m} H={hidden} I={inter} counts={counts} clamp={activation_clamp}"
    pool = _Pool(recipe, arch, counts, block_m, hidden, inter,
                 seed=_seed("gemm", recipe, counts, block_m, hidden, inter))
    fp8 = recipe != "bf16xbf16"
    b1, b2 = pool.dg_weights()

    # the operands handed to DeepGEMM are bit for bit the weights the reference dequantizes
    if fp8:
        assert torch.equal(quant.dequantize_weights_for_recipe(b1, recipe), pool.w1_deq)
        assert torch.equal(quant.dequantize_weights_for_recipe(b2, recipe), pool.w2_deq)
    else:
        assert torch.equal(b1.float(), pool.w1_deq) and torch.equal(b2.float(), pool.w2_deq)

    l2_ours, l2_sf_ours, out_ours = pool.run_ours(activation_clamp, fast_math)
    src, dst = pool.src, pool.dst

    # --- DeepGEMM L1 (pre-activation, [gate | up], BF16) against float64
    a1 = pool.to_dg(pool.acts, pool.acts_sf, src)
    d1 = pool.dg_gemm(a1, b1, 2 * inter)
    acc_dg = d1[dst].float()
    acc_ref = torch.cat([(pool.x_deq[src[r.start:r.stop]].double()
                          @ pool.w1_deq[e].double().T).float() for e, r in _local_rows(pool)]) \
        if len(src) else acc_dg
    st = _stats(d1[dst], acc_ref.to(torch.bfloat16))
    _note(f"DeepGEMM L1 vs float64 [{name}]: {_fmt(st)}")
    assert st["rel_norm"] <= DG_L1_REL, st

    # --- L1: DeepGEMM accumulator -> reference SwiGLU + requant, against our L2 input
    w_rows = pool.topk_weights[src]
    h_dg = reference.swiglu_reference(acc_dg, w_rows, activation_clamp, fast_math)
    ours_rows = _rows(l2_ours, src)
    # How far our h may be from h_dg: each gate / up accumulator may round to BF16 one ulp apart
    # (plus the cancellation floor 2^-14 * sum |x w|, as for L2 below), SiLU's approximations
    # add a few float32 ulps; |silu'| <= 1.1 and the clamp only shrinks differences.
    s1 = torch.cat([_abs_products(pool.x_deq[src[r.start:r.stop]], pool.w1_deq[e])
                    for e, r in _local_rows(pool)]) if len(src) else acc_dg.abs()
    g = acc_dg[:, :inter].to(torch.bfloat16).float()
    u = acc_dg[:, inter:].to(torch.bfloat16).float()
    dg_, du = _bf16_ulp(g) + 2.0**-14 * s1[:, :inter], _bf16_ulp(u) + 2.0**-14 * s1[:, inter:]
    delta_h = w_rows[:, None] * (1.1 * dg_ * (u.abs() + du) + ((g * torch.sigmoid(g)).abs()
                                                                + 1.1 * dg_) * du)
    delta_h = delta_h + 2.0**-20 * h_dg.abs()
    if fp8:
        gran = L2_GRAN[recipe]
        q_dg, sf_dg = quant.requant_fp8_pow2(h_dg, gran)
        sf_o = l2_sf_ours[src].contiguous()
        if recipe == "fp8xfp4":
            sf_o = quant.unpack_ue8m0_from_int(sf_o)[:, : inter // gran]
        assert bool(torch.isfinite(sf_o).all()), "our L2 input scales were not all written"
        in_o = quant.cast_back_from_fp8(ours_rows, sf_o, gran)
        in_dg = quant.cast_back_from_fp8(q_dg, sf_dg, gran)
        sf_mismatch = sf_o != sf_dg
        # a scale may differ only where the group amax of h, moved by up to delta_h, crosses
        # 448 * 2^k (its power-of-two scale changes there)
        amax = h_dg.abs().view(len(src), -1, gran).amax(dim=2)
        moved = delta_h.view(len(src), -1, gran).amax(dim=2)
        near_tie = quant.ceil_to_ue8m0((amax - moved).clamp_min(0) * (1.0 / 448.0)) != \
            quant.ceil_to_ue8m0((amax + moved) * (1.0 / 448.0) * (1 + 2.0**-20))
        # one e4m3 step: 2^-3 relative (normals), sf * 2^-9 (subnormals), at the larger scale
        sf_max = torch.maximum(sf_o, sf_dg).repeat_interleave(gran, dim=1)
        step = torch.maximum(torch.maximum(in_dg.abs(), in_o.abs()) * 2.0**-3,
                             sf_max * 2.0**-9)
        codes_same = float((_bytes(ours_rows) == _bytes(q_dg)).float().mean()) if len(src) else 1.
        extra = (f"scales bit-exact={float((~sf_mismatch).float().mean()) if len(src) else 1.:.4g}"
                 f" ({int(sf_mismatch.sum())} differ, {int((sf_mismatch & near_tie).sum())} "
                 f"at power-of-two ties), codes bit-exact={codes_same:.4g}")
        assert bool((~sf_mismatch | near_tie).all()), f"L1 requant scale mismatch: {extra}"
    else:
        in_o, in_dg = ours_rows.float(), h_dg.to(torch.bfloat16).float()
        step = _bf16_ulp(torch.maximum(in_o.abs(), in_dg.abs()))
        extra = ""
    # |q(h_ours) - q(h_dg)| <= |h_ours - h_dg| + half a step of each rounding
    diff = (in_o - in_dg).abs()
    flips = float((diff > 0).float().mean()) if diff.numel() else 0.0
    big = int((diff > delta_h + step).sum())
    st = _stats(in_o, in_dg, bf16_ulps=not fp8)
    _OBSERVED["L1 (+ SwiGLU/requant) vs DeepGEMM L1 + reference epilogue"].append(st["differ"] == 0)
    _note(f"L1 (ours vs DeepGEMM L1 + reference SwiGLU/requant) [{name}]: {_fmt(st)}, "
          f"flip_frac={flips:.3g}, over_bound={big} {extra}")
    assert big == 0, f"L1: {big} L2-input values further from DeepGEMM's than the bound"
    assert flips <= L1_FLIP_FRAC, f"L1: {flips:.3g} of the L2-input values moved"

    # --- L2 alone: DeepGEMM's L2 on *our* L2 input against our output
    a2 = pool.to_dg(l2_ours, l2_sf_ours, src) if fp8 else pool.to_dg(l2_ours, None, src)
    d2 = pool.dg_gemm(a2, b2, hidden)
    o_dg, o_ours = d2[dst], out_ours[src]
    assert bool(torch.isfinite(o_ours.float()).all()), "our L2 output has non-finite rows"
    st = _stats(o_ours, o_dg)
    exact_l2 = st["differ"] == 0
    _OBSERVED["L2 grouped GEMM (same inputs) vs DeepGEMM"].append(exact_l2)
    _note(f"L2 alone (ours vs DeepGEMM on our L2 input) [{name}]: {_fmt(st)}")
    if len(src):
        floor = 2.0**-14 * torch.cat([_abs_products(in_o[r.start:r.stop], pool.w2_deq[e])
                                      for e, r in _local_rows(pool)])
        excess = (o_ours.float() - o_dg.float()).abs() - L2_MAX_ULP * _bf16_ulp(
            torch.maximum(o_ours.float().abs(), o_dg.float().abs()))
        assert bool((excess <= floor).all()), \
            f"L2: {int((excess > floor).sum())} outputs more than {L2_MAX_ULP} BF16 ulp off"
    assert st["rel_norm"] <= L2_REL, st

    # --- the chain: DeepGEMM L1 -> reference SwiGLU/requant -> DeepGEMM L2, against ours
    if fp8:
        q_dg, sf_dg_l2 = quant.requant_fp8_pow2(h_dg, L2_GRAN[recipe],
                                                use_packed_ue8m0=recipe == "fp8xfp4")
        a2c = pool.to_dg(q_dg, sf_dg_l2, torch.arange(len(src), device="cuda"))
    else:
        a2c = pool.to_dg(h_dg.to(torch.bfloat16), None, torch.arange(len(src), device="cuda"))
    d2c = pool.dg_gemm(a2c, b2, hidden)
    st = _stats(o_ours, d2c[dst])
    _OBSERVED["whole FFN vs DeepGEMM chain"].append(st["differ"] == 0)
    bound = 2 * (math.sqrt(flips) * STEP_REL[recipe] + 2.0**-9)
    _note(f"whole FFN (ours vs DeepGEMM chain) [{name}]: {_fmt(st)} (bound {bound:.3g})")
    assert st["rel_norm"] <= bound, st


def _local_rows(pool: _Pool):
    """(expert, positions of its rows in the src / dst order) for non-empty experts."""
    pos = 0
    for e, c in enumerate(pool.counts):
        if c:
            yield e, range(pos, pos + c)
        pos += c


@pytest.mark.parametrize("recipe", ("fp8xfp8", "bf16xbf16", "fp8xfp4"))
@pytest.mark.parametrize("pattern", ("random", "skewed"))
@pytest.mark.parametrize("hidden,inter", [(1024, 512), (640, 384)])
def test_expert_ffn_against_deep_gemm(recipe, pattern, hidden, inter):
    _compare_expert_ffn(recipe, COUNTS[pattern], 128, hidden, inter, activation_clamp=10.0,
                        fast_math=True)


@pytest.mark.parametrize("recipe", ("fp8xfp8", "bf16xbf16", "fp8xfp4"))
def test_expert_ffn_against_deep_gemm_block_m_64_precise(recipe):
    """BLOCK_M 64 pool (DeepGEMM still takes its own 128-aligned layout), no clamp, precise
    SiLU."""
    _compare_expert_ffn(recipe, [130, 64, 1, 0, 65, 200, 3, 17], 64, 1024, 256,
                        activation_clamp=None, fast_math=False)


@pytest.mark.parametrize("recipe", ("fp8xfp8", "bf16xbf16", "fp8xfp4"))
def test_expert_ffn_against_deep_gemm_deepseek_shape(recipe):
    """H 7168, I 2048."""
    _compare_expert_ffn(recipe, COUNTS["random"], 128, 7168, 2048, activation_clamp=10.0,
                        fast_math=True)


# ----------------------------------------------------------------------------------------------
# 3. SM100: our layer against DeepGEMM's Mega MoE
# ----------------------------------------------------------------------------------------------


def _single_rank_group():
    """DeepGEMM's buffer needs a process group; a one-rank NCCL group (created here if none
    exists). Returns (group, created)."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            pytest.skip("the SM100 comparison runs on one rank")
        return dist.group.WORLD, False
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    return dist.group.WORLD, True


@pytest.mark.sm100
@pytest.mark.parametrize("recipe", ("fp8xfp4", "bf16xbf16"))
@pytest.mark.parametrize("activation_clamp,fast_math", [(10.0, True), (None, False)])
def test_layer_against_deep_gemm_mega_moe(recipe, activation_clamp, fast_math):
    import torch.distributed as dist

    import cute_megamoe as cm
    from cute_megamoe.expert_gemm import ExpertWeights

    if _capability()[0] != 10:
        pytest.skip("DeepGEMM's Mega MoE runs on SM100 only")
    group, created = _single_rank_group()
    try:
        experts, tokens, topk, hidden, inter = 16, 200, 6, 1024, 512
        gen = torch.Generator().manual_seed(_seed("layer", recipe, activation_clamp))
        x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).cuda()
        scores = torch.randn(tokens, experts, generator=gen)
        topk_w, topk_idx = torch.topk(scores, topk, dim=-1)
        masked = torch.rand(tokens, topk, generator=gen) < 0.1
        masked[:3] = True  # tokens with every slot masked: y must be exactly 0
        topk_idx = topk_idx.masked_fill(masked, -1).cuda()
        topk_w = topk_w.masked_fill(masked, 0.0).float().cuda()
        w1 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5)
        w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5)
        w1, w2 = w1.to(torch.bfloat16).cuda(), w2.to(torch.bfloat16).cuda()
        stats0 = torch.randint(0, 100, (experts,), dtype=torch.int32, generator=gen).cuda()

        # ours
        ours_w = ExpertWeights.from_bf16(w1, w2, recipe, arch="sm_100a")
        buf = cm.get_symm_buffer_for_mega_moe(None, experts, tokens, topk, hidden, inter,
                                              mma_type=recipe)
        cm.stage_inputs(buf, x, topk_idx, topk_w)
        y_ours = torch.full_like(x, float("nan"))
        stats_ours = stats0.clone()
        cm.mega_moe(y_ours, ours_w, buf, cumulative_local_expert_recv_stats=stats_ours,
                    activation_clamp=activation_clamp, fast_math=fast_math)

        # DeepGEMM, prepared as its own Mega MoE test does
        dg_buf = deep_gemm.get_symm_buffer_for_mega_moe(group, experts, tokens, topk, hidden,
                                                        inter, mma_type=recipe)
        if recipe == "bf16xbf16":
            l1, l2 = deep_gemm.transform_weights_for_mega_moe(w1, w2)
            dg_buf.x[:tokens].copy_(x)
            pairs = [("w1", ours_w.w1, l1), ("w2", ours_w.w2, l2)]
        else:
            l1, l2 = deep_gemm.transform_weights_for_mega_moe(_dg_fp4_weights(w1),
                                                              _dg_fp4_weights(w2))
            xq, xsf = dgu.per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=32,
                                                use_packed_ue8m0=True)
            dg_buf.x[:tokens].copy_(xq)
            dg_buf.x_sf[:tokens].copy_(xsf)
            pairs = [("w1", ours_w.w1, l1[0]), ("w1_sf", ours_w.w1_sf, l1[1].transpose(1, 2)),
                     ("w2", ours_w.w2, l2[0]), ("w2_sf", ours_w.w2_sf, l2[1].transpose(1, 2)),
                     ("staged x", buf.x[:tokens], xq), ("staged x_sf", buf.x_sf[:tokens], xsf)]
        dg_buf.topk_idx[:tokens].copy_(topk_idx)
        dg_buf.topk_weights[:tokens].copy_(topk_w)
        y_dg = torch.zeros_like(x)  # DeepGEMM need not write tokens with every slot masked
        stats_dg = stats0.clone()
        mega = deep_gemm.bf16_mega_moe if recipe == "bf16xbf16" else deep_gemm.fp8_fp4_mega_moe
        mega(y_dg, l1, l2, dg_buf, cumulative_local_expert_recv_stats=stats_dg,
             activation_clamp=activation_clamp, fast_math=fast_math)
        torch.cuda.synchronize()
        dg_buf.destroy()

        case = f"{recipe} clamp={activation_clamp} fast_math={fast_math}"
        _exact("Mega MoE inputs, weights and recv stats vs DeepGEMM (sm100)", case,
               pairs + [("recv stats", stats_ours, stats_dg)])
        ref = reference.mega_moe_reference([x], [topk_idx], [topk_w], [w1], [w2], recipe=recipe,
                                           activation_clamp=activation_clamp,
                                           fast_math=fast_math)
        y_ref = ref.y[0]
        st = _stats(y_ours, y_dg)
        err_ours = _stats(y_ours, y_ref)["rel_norm"]
        err_dg = _stats(y_dg, y_ref)["rel_norm"]
        _OBSERVED["Mega MoE y vs DeepGEMM (sm100)"].append(st["differ"] == 0)
        _note(f"Mega MoE y (ours vs DeepGEMM) [{case}]: {_fmt(st)}; vs reference: ours "
              f"{err_ours:.3g}, DeepGEMM {err_dg:.3g}")
        assert bool(torch.isfinite(y_ours.float()).all()) and bool(
            torch.isfinite(y_dg.float()).all())
        all_masked = (topk_idx < 0).all(dim=1)
        assert bool((y_ours[all_masked] == 0).all())
        assert err_ours <= LAYER_REL and err_dg <= LAYER_REL, (err_ours, err_dg)
        assert st["rel_norm"] <= 2 * LAYER_REL, st
    finally:
        if created:
            dist.destroy_process_group()
