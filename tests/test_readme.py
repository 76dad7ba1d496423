"""README.md's API example runs as written (on the CPU: the reference; on a GPU: the kernels).

The example is the first ```python block under the README's "## API" heading; it is executed
as a script, and its numbers are checked here: the layer's output has the input's shape, and on
the CPU it equals the reference bit for bit.
"""

import contextlib
import io
import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_api_example() -> str:
    """The source of the first python block of the README's API section."""
    text = README.read_text()
    section = text.split("\n## API\n", 1)
    assert len(section) == 2, "README.md has no '## API' section"
    block = re.search(r"^```python\n(.*?)^```$", section[1], re.S | re.M)
    assert block is not None, "README.md's API section has no ```python block"
    return block.group(1)


def test_readme_api_example_runs_and_matches_the_reference():
    source = readme_api_example()
    namespace: dict = {"__name__": "__readme__"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(source, str(README), "exec"), namespace)  # noqa: S102 (the README's code)
    x, y, ref, layer = namespace["x"], namespace["y"], namespace["ref"], namespace["layer"]
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert torch.isfinite(y.float()).all() and y.float().abs().sum() > 0
    if layer.config.path == "reference":
        assert torch.equal(y, ref)
        assert namespace["error"] == 0.0
    else:  # our kernels against the reference on the same device (fp8xfp8's tolerance)
        assert namespace["error"] < 0.02
    assert "relative error against the reference" in printed.getvalue()
