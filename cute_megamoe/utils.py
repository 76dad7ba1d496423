"""Small helpers shared by the host-side modules."""


def ceil_div(x: int, y: int) -> int:
    return (x + y - 1) // y


def align(x: int, y: int) -> int:
    return ceil_div(x, y) * y


ARCHS = ("sm90", "sm100")


def normalize_arch(arch: str) -> str:
    """`'sm_90a'`, `'sm90a'`, `'sm90'` -> `'sm90'`; likewise `'sm100'` (and its `f` family)."""
    if not isinstance(arch, str):
        raise TypeError(f"arch must be a str, got {type(arch).__name__}")
    key = arch.lower().replace("_", "")
    if key.endswith(("a", "f")):
        key = key[:-1]
    if key not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    return key
