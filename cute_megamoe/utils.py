"""Small helpers shared by the host-side modules."""

from .tables import ARCHS, normalize_arch

__all__ = ["ARCHS", "align", "ceil_div", "normalize_arch"]


def ceil_div(x: int, y: int) -> int:
    return (x + y - 1) // y


def align(x: int, y: int) -> int:
    return ceil_div(x, y) * y
