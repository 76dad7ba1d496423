"""SymmBuffer on the CPU (one rank): views alias the buffer, zeroing, repr, validation."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cute_megamoe.buffer import SymmBuffer, get_symm_buffer_for_mega_moe
from cute_megamoe.layout import REGION_NAMES, AbsentRegionError, MegaMoELayout

ARGS = (8, 100, 2, 256, 128)  # num_experts, num_max_tokens_per_rank, num_topk, hidden, I


def make(recipe: str = "fp8xfp4") -> SymmBuffer:
    return get_symm_buffer_for_mega_moe(None, *ARGS, mma_type=recipe, device="cpu")


@pytest.mark.parametrize("recipe", ["fp8xfp4", "fp8xfp8", "bf16xbf16"])
def test_views_alias_the_buffer(recipe):
    buf = make(recipe)
    lay = buf.layout
    assert lay == MegaMoELayout(1, *ARGS, recipe=recipe)
    assert buf.buffer.dtype == torch.uint8 and buf.buffer.numel() == lay.num_bytes
    assert buf.buffer.device.type == "cpu"
    assert (buf.rank, buf.num_ranks, buf.group, buf.handle) == (0, 1, None, None)
    assert buf.buffer_ptrs == [buf.buffer.data_ptr()]
    for reg in lay.regions:
        v = getattr(buf, reg.name)  # one property per region
        assert v is buf.view(reg.name)
        assert v.data_ptr() == buf.buffer.data_ptr() + reg.offset
        assert (tuple(v.shape), tuple(v.stride()), v.dtype) == (reg.shape, reg.strides, reg.dtype)
    # Write through one view, read back through the raw bytes.
    buf.topk_idx[3, 1] = 0x0102030405060708
    off = lay.offset("topk_idx") + (3 * lay.num_topk + 1) * 8
    assert buf.buffer[off : off + 8].tolist() == [8, 7, 6, 5, 4, 3, 2, 1]  # little-endian
    assert buf.num_tokens == 128 and buf.num_max_tokens_per_rank == 100
    assert buf.recipe == buf.mma_type == recipe
    assert (buf.num_experts, buf.num_topk, buf.hidden, buf.intermediate_hidden) == (8, 2, 256, 128)


def test_zeroed_at_creation():
    buf = make()
    assert int(buf.buffer.count_nonzero()) == 0


def test_repr_mentions_size_and_shape():
    buf = make()
    text = repr(buf)
    assert f"{buf.layout.num_bytes / 2**20:.2f} MiB" in text
    for word in ("fp8xfp4", "num_experts=8", "num_topk=2", "hidden=256", "num_ranks=1"):
        assert word in text


def test_zero_workspace_only_zeroes_the_workspace():
    buf = make()
    buf.buffer.fill_(0xFF)
    assert buf.zero_workspace_() is buf
    lay = buf.layout
    for reg in lay.regions:
        chunk = buf.buffer[reg.offset : reg.end]
        if reg.workspace:
            assert int(chunk.count_nonzero()) == 0, reg.name
        else:
            assert bool((chunk == 0xFF).all()), reg.name
    assert bool((buf.buffer[lay.workspace_nbytes :] == 0xFF).all())


def test_absent_regions_raise():
    buf = make("bf16xbf16")
    assert not buf.has("x_sf")
    for name in ("x_sf", "l1_acts_sf", "l2_acts_sf"):
        with pytest.raises(AbsentRegionError):
            getattr(buf, name)
    assert buf.x.dtype == torch.bfloat16


def test_every_region_name_has_a_property():
    for name in REGION_NAMES:
        assert isinstance(getattr(SymmBuffer, name), property), name


def test_destroy_drops_everything():
    buf = make()
    buf.destroy()
    assert buf.buffer is None and buf.buffer_ptrs == [] and buf.handle is None
    with pytest.raises(RuntimeError):
        _ = buf.x
    assert "destroyed" in repr(buf)


@pytest.mark.parametrize(
    "kwargs, exc, word",
    [
        (dict(mma_type="fp4xfp4"), ValueError, "mma_type"),
        (dict(mma_type=True), TypeError, "mma_type"),
        (dict(num_experts=8.0), TypeError, "num_experts"),
        (dict(hidden=100), ValueError, "hidden"),
        (dict(num_topk=0), ValueError, "num_topk"),
        (dict(group="world"), TypeError, "group"),
    ],
)
def test_bad_arguments(kwargs, exc, word):
    full = dict(
        group=None,
        num_experts=8,
        num_max_tokens_per_rank=100,
        num_topk=2,
        hidden=256,
        intermediate_hidden=128,
        device="cpu",
    )
    full.update(kwargs)
    with pytest.raises(exc, match=word):
        get_symm_buffer_for_mega_moe(**full)


def test_a_received_rows_ring_buffer_is_the_fused_kernels_only():
    """``received_rows``: the buffer's received rows (``l1_acts`` and its scales) in a ring of
    that many rows (`MegaMoELayout.received_rows`), also in a loopback group; the staged
    kernels refuse it before any launch (`staged.check_whole_received_rows`: the dispatch
    gives the call up), and take a whole-pool buffer."""
    from cute_megamoe import staged
    from cute_megamoe.layout import BarrierSlots

    for recipe in ("fp8xfp8", "bf16xbf16"):
        ring = get_symm_buffer_for_mega_moe(None, *ARGS, mma_type=recipe, device="cpu",
                                            received_rows=256)
        assert ring.layout == MegaMoELayout(1, *ARGS, recipe=recipe, received_rows=256)
        assert ring.l1_acts.shape == (256, ARGS[3])
        assert ring.l2_acts.shape[0] == ring.token_src_metadata.shape[0] == (
            ring.layout.num_pool_rows) > 256
        if ring.has("l1_acts_sf"):
            assert ring.l1_acts_sf.stride() == (1, 256)
        with pytest.raises(ValueError, match="received_rows 256"):
            staged.check_whole_received_rows(ring)
        staged.check_whole_received_rows(make(recipe))
        tag = int(ring.barrier[BarrierSlots.CALL_TAG])
        with pytest.raises(ValueError, match="received row per pool row"):
            staged.dispatch(ring, None, None, None, num_tokens=0)
        assert int(ring.barrier[BarrierSlots.CALL_TAG]) == tag + 1  # (given up)
    both = SymmBuffer(None, *ARGS, mma_type="fp8xfp8", device="cpu", l1_output_rows=256,
                      received_rows=512)
    assert (both.l1_acts.shape[0], both.l2_acts.shape[0]) == (512, 256)
    group = SymmBuffer.loopback(2, *ARGS, device="cpu", received_rows=256)
    assert all(buf.layout.num_received_rows == 256 for buf in group)
    assert group[0].layout == group[1].layout


@pytest.fixture
def fake_group():
    """A default process group of the 'fake' backend (no communication) of a given size."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")

    def init(world_size: int):
        dist.init_process_group(backend="fake", store=FakeStore(), rank=0, world_size=world_size)
        return dist.group.WORLD

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def test_group_size_must_divide_num_experts(fake_group):
    group = fake_group(2)
    with pytest.raises(ValueError, match="num_experts"):
        get_symm_buffer_for_mega_moe(group, 7, 100, 2, 256, 128, device="cpu")


def test_group_of_one_rank_is_a_plain_tensor(fake_group):
    group = fake_group(1)
    buf = get_symm_buffer_for_mega_moe(group, *ARGS, device="cpu")
    assert (buf.rank, buf.num_ranks, buf.group) == (0, 1, group)
    assert buf.buffer_ptrs == [buf.buffer.data_ptr()]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error path")
def test_several_ranks_need_cuda(fake_group):
    group = fake_group(2)
    with pytest.raises(RuntimeError, match="CUDA"):
        get_symm_buffer_for_mega_moe(group, 8, 100, 2, 256, 128)
