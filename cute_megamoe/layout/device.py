"""Device-side addresses of the buffer's regions, for use inside CuTe DSL kernels.

`BufferRegions(layout)` is captured by a kernel at compile time; inside the kernel
`regions.ptr(base, "x")` turns a rank's buffer base address (an `Int64`, e.g. `peer_bases[r]`)
into a typed `cute.Pointer` to the region, and `regions.tensor(base, "x")` into a tensor with the
region's static shape and strides. Offsets are compile-time constants taken from the host
`MegaMoELayout`, so host and device can never disagree about where a byte lives. All offsets are
64-bit: buffers for large configs pass 2**31 bytes.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int64

from ..runtime import cutlass_dtype
from .mega_moe import MegaMoELayout


class BufferRegions:
    """Compile-time view of a `MegaMoELayout` that builds pointers from a runtime base."""

    def __init__(self, layout: MegaMoELayout):
        self.layout = layout

    def offset(self, name: str) -> int:
        return self.layout.offset(name)

    def dtype(self, name: str):
        return cutlass_dtype(self.layout.region(name).dtype)

    def ptr(self, base: Int64, name: str, dtype=None, align: int = 16) -> cute.Pointer:
        """Pointer to the first element of region `name` in the buffer at address `base`."""
        return cute.make_ptr(dtype or self.dtype(name), Int64(base) + self.offset(name),
                             cute.AddressSpace.gmem, assumed_align=align)

    def tensor(self, base: Int64, name: str) -> cute.Tensor:
        """Region `name` as a tensor with its static shape and element strides."""
        region = self.layout.region(name)
        layout = cute.make_layout(region.shape, stride=region.strides)
        return cute.make_tensor(self.ptr(base, name), layout)
