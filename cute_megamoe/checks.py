"""Host checks of the public entry points: every error a user can cause, raised before a launch.

Each check raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong value, shape,
device or layout) with a message that starts with the offending argument's name. The entry
points run them before any kernel launch; a collective entry point runs them inside
`staged.gives_up_call_on_error`, so that a rank that rejects a call gives it up
(`SymmBuffer.skip_call`) instead of pairing its next call with its peers' current one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .buffer import SymmBuffer
from .runtime import env_choice
from .tables import BLOCK_MS, normalize_arch

__all__ = [
    "MAX_INT32",
    "ROUTING_CHECKS",
    "check_activation",
    "check_activation_clamp",
    "check_block_m",
    "check_choice",
    "check_cuda_buffer",
    "check_cuda_device",
    "check_fast_math",
    "check_gemm_block_m",
    "check_layer_output",
    "check_mn_major",
    "check_routing",
    "check_sym_buffer",
    "check_tensor",
    "check_token_count",
    "routing_check",
]

MAX_INT32 = 2**31 - 1


def check_tensor(name: str, t: object, dtype: torch.dtype | None = None,
                 shape: Sequence[int | None] | None = None,
                 device: torch.device | str | None = None, *,
                 for_kernel: bool = True) -> torch.Tensor:
    """``t`` if it is a tensor of ``dtype``, ``shape`` (None entries: any size) and ``device``
    (each None: any); with ``for_kernel`` (the default) also contiguous with its data 16-byte
    aligned, as the kernels' vector loads and TMA need. The package's one tensor check: the
    entry points, `quant` and `reference` all use it. Cheap where it passes (identity and tuple
    compares; it runs several times per layer call)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype is not dtype and t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if shape is not None:
        got = t.shape
        if not (got == shape if type(shape) is tuple and None not in shape
                else _shape_matches(tuple(got), tuple(shape))):
            raise ValueError(f"{name}: expected shape {_shape_str(shape)}, got {tuple(got)}")
    if device is not None:
        if type(device) is not torch.device:
            device = torch.device(device)
        if t.device != device:
            raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if for_kernel:
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous (strides {t.stride()})")
        if t.numel() > 0 and t.data_ptr() % 16 != 0:
            raise ValueError(f"{name}: data pointer must be 16-byte aligned")
    return t


def _shape_matches(got: tuple[int, ...], want: tuple[int | None, ...]) -> bool:
    return len(got) == len(want) and all(w is None or g == w
                                          for g, w in zip(got, want, strict=True))


def _shape_str(shape: Sequence[int | None]) -> str:
    dims = ["*" if d is None else str(d) for d in shape]
    return f"({dims[0]},)" if len(dims) == 1 else f"({', '.join(dims)})"


def check_mn_major(name: str, t: object, dtype: torch.dtype, rows: int, cols: int,
                   device: torch.device | str) -> torch.Tensor:
    """``t`` if it is a ``[rows, cols]`` view of a contiguous ``[cols, rows]`` tensor (strides
    ``(1, rows)``: MN-major scales), else the error `check_tensor` gives."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    check_tensor(name, t.t(), dtype, (cols, rows), device)
    return t


#: how a layer call checks its routing (`routing_check`)
ROUTING_CHECKS = ("device", "host", "off")


def routing_check(validate_routing: bool | str | None) -> str:
    """How a call checks its routing, one of `ROUTING_CHECKS`: "device" (the dispatch checks
    every slot on the GPU, masks the bad ones and records them; the host raises the record
    after a later call's launch, or at `SymmBuffer.check_routing_errors`; no synchronization),
    "host" (also `check_routing` before the launch: synchronizes, so no CUDA graphs) or "off"
    (nothing raised; the dispatch still masks bad slots). ``validate_routing``: one of those,
    True ("device") or False ("off"); None: the ``CUTE_MEGAMOE_CHECK_ROUTING`` deployment
    setting (`runtime.env_choice`, "device" when unset)."""
    if validate_routing is None:
        return env_choice("CUTE_MEGAMOE_CHECK_ROUTING", ROUTING_CHECKS)
    if validate_routing is True:
        return "device"
    if validate_routing is False:
        return "off"
    if isinstance(validate_routing, str) and validate_routing in ROUTING_CHECKS:
        return validate_routing
    raise ValueError(f"validate_routing: one of {ROUTING_CHECKS}, True, False or None, got "
                     f"{validate_routing!r}")


def check_routing(topk_idx: torch.Tensor, num_experts: int, name: str = "topk_idx") -> None:
    """Raise if a top-k index is outside [-1, num_experts) or a token names one expert twice
    (the buffer holds one slot per token per expert). Synchronizes with the GPU."""
    if topk_idx.numel() == 0:
        return
    lo, hi = int(topk_idx.min()), int(topk_idx.max())
    if lo < -1 or hi >= num_experts:
        bad = lo if lo < -1 else hi
        raise ValueError(
            f"{name}: expert index {bad} is out of range (valid: -1 for a masked slot, "
            f"or 0..{num_experts - 1})")
    check_distinct_experts(topk_idx, name)


def check_distinct_experts(topk_idx: torch.Tensor, name: str = "topk_idx") -> None:
    """Raise `ValueError` naming the token, the two slots and the expert where a token of
    ``topk_idx`` (int64 ``[n, K]``) names one expert twice (-1, a masked slot, may repeat).
    Synchronizes with the GPU."""
    if topk_idx.numel() == 0:
        return
    ordered = topk_idx.sort(dim=1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    if bool(repeated.any()):
        token = int(repeated.any(dim=1).nonzero()[0])
        row = topk_idx[token].tolist()
        first: dict[int, int] = {}
        for slot, expert in enumerate(row):
            if expert >= 0 and expert in first:
                raise ValueError(f"{name}: token {token} names the same expert {expert} in "
                                 f"slots {first[expert]} and {slot} ({row}); a token names an "
                                 f"expert once (mask repeats with -1)")
            first.setdefault(expert, slot)


def check_sym_buffer(sym_buffer: object) -> SymmBuffer:
    """``sym_buffer`` if it is a `SymmBuffer` (checked before anything that could give the
    call up: without a buffer there is no call to give up)."""
    if not isinstance(sym_buffer, SymmBuffer):
        raise TypeError(f"sym_buffer: expected a SymmBuffer, got {type(sym_buffer).__name__}")
    return sym_buffer


def check_cuda_buffer(sym_buffer: SymmBuffer) -> torch.device:
    """The buffer's device, if CUDA is available and the buffer lives on it."""
    if not torch.cuda.is_available():
        raise RuntimeError("sym_buffer: the kernels need a CUDA GPU and none is available "
                           "(on the CPU, cute_megamoe.MegaMoE runs the reference)")
    device = sym_buffer.device
    if device.type != "cuda":
        raise ValueError(f"sym_buffer: must live on a CUDA device to run the kernels, not "
                         f"{device}")
    return device


def check_cuda_device(name: str, device: torch.device) -> torch.device:
    """``device`` (``name``'s) if it is a CUDA device."""
    if device.type != "cuda":
        raise ValueError(f"{name}: expected a CUDA tensor, got device {device}")
    return device


def check_token_count(name: str, n: int, num_tokens: int) -> int:
    """``n`` if ``0 <= n <= num_tokens`` (the buffer's token rows: its
    ``num_max_tokens_per_rank`` rounded up to a multiple of 128)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{name}: expected an int token count, got {type(n).__name__}")
    if not 0 <= n <= num_tokens:
        raise ValueError(f"{name}: {n} tokens; the buffer holds 0..{num_tokens} token rows per "
                         f"rank (its num_max_tokens_per_rank rounded up to a multiple of 128)")
    return n


def check_block_m(block_m: int, block_m_max: int) -> int:
    """A pool block size of the dispatch and combine: a multiple of 16 in [16, block_m_max]."""
    if isinstance(block_m, bool) or not isinstance(block_m, int):
        raise TypeError(f"block_m: expected an int, got {type(block_m).__name__}")
    if block_m % 16 != 0 or not 16 <= block_m <= block_m_max:
        raise ValueError(f"block_m: expected a multiple of 16 in [16, {block_m_max}], "
                         f"got {block_m}")
    return block_m


def check_gemm_block_m(block_m: int, arch: str) -> int:
    """A BLOCK_M the grouped-GEMM kernels of ``arch`` implement (`tables.BLOCK_MS`)."""
    arch = normalize_arch(arch)
    if block_m not in BLOCK_MS[arch]:
        raise ValueError(f"block_m: expected one of {BLOCK_MS[arch]} on {arch}, got {block_m}")
    return block_m


def check_choice(name: str, value: object, choices: Sequence[object]) -> object:
    """``value`` if it is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name}: expected one of {tuple(choices)}, got {value!r}")
    return value


def check_activation(activation: object) -> str:
    """The activation of DeepGEMM's API: ``'swiglu'`` is the only one."""
    if activation != "swiglu":
        raise ValueError(f"activation: only 'swiglu' is implemented, got {activation!r}")
    return "swiglu"


def check_activation_clamp(activation_clamp: object) -> float | None:
    """None (no clamp) or a float ``c >= 0`` (gate ``<= c``, up in ``[-c, c]``)."""
    if activation_clamp is None:
        return None
    if isinstance(activation_clamp, bool) or not isinstance(activation_clamp, (int, float)):
        raise TypeError(f"activation_clamp: expected None or a float, got "
                        f"{type(activation_clamp).__name__}")
    if math.isnan(activation_clamp) or activation_clamp < 0:
        raise ValueError(f"activation_clamp: must be >= 0, got {activation_clamp!r}")
    return float(activation_clamp)


def check_fast_math(fast_math: object) -> bool:
    """A bool (the SiLU flavour: approximate exp / reciprocal or precise)."""
    if not isinstance(fast_math, bool):
        raise TypeError(f"fast_math: expected a bool, got {type(fast_math).__name__}")
    return fast_math


def check_layer_output(y: object, sym_buffer: SymmBuffer) -> int:
    """The layer output ``y``: BF16 ``[n, hidden]``, contiguous, on the buffer's device, with
    ``n`` at most the buffer's token rows. Returns ``n``, the call's token count (DeepGEMM's
    API takes it from ``y``)."""
    if not isinstance(y, torch.Tensor) or y.dim() != 2:
        raise TypeError("y: expected a 2-D BF16 tensor [num_tokens, hidden]")
    n = check_token_count("y.shape[0]", y.shape[0], sym_buffer.layout.num_tokens)
    check_tensor("y", y, torch.bfloat16, (n, sym_buffer.hidden), sym_buffer.device)
    return n
