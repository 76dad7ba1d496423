"""The cuda-gdb parsers of `testing.gpu_snapshot` on output that cuda-gdb printed on the H200
(2026-12-04, a hung two-rank loopback: one kernel on the GPU, its warps at two PCs; runs of
spaces shortened)."""

from cute_megamoe.testing.gpu_snapshot import parse_kernels, parse_sms, parse_warps

KERNELS = """\
  Kernel Parent Dev Grid Status                             SMs Mask GridDim  BlockDim Invocation
*      0      -   0  617 Active 0x0ff0055555555555555555555555555555 (1,1,1) (512,1,1) \
kernel_cutlass_kernel_cute_megamoekernelscombineCombineKernel_object_at__tensorptri64_0()
"""

WARPS = """\
  Wp Active Lanes Mask Divergent Lanes Mask  Active PC Kernel BlockIdx First Active ThreadIdx
Device 0 SM 0
*  0  0xffffffff  0x00000000 0x00007f7c056a5b30  0 (54,0,0)  (64,0,0)
  1  0xffffffff  0x00000000 0x00007f7c056a5b30  0 (54,0,0)  (96,0,0)
  2  0x000000ff  0xffffff00 0x00007f7c056a5950  0 (54,0,0)  (0,0,0)
Device 0 SM 2
*  0  0xffffffff  0x00000000 0x00007f7c056a5b30  0 (55,0,0)  (64,0,0)
Device 0 SM 0
*  0  0xffffffff  0x00000000 0x00007f7c056a5b30  0 (54,0,0)  (64,0,0)
"""

SMS = """\
  SM Active Warps Mask
Device 0
*  0 0x000000000000ffff
   1 0x0000000000000000
   2 0x000000000000ffff
"""


def test_parse_kernels():
    kernels = parse_kernels(KERNELS)
    assert list(kernels) == [0]
    assert kernels[0].startswith("kernel_cutlass_kernel_cute_megamoekernelscombineCombineKernel")
    assert "block (512,1,1)" in kernels[0] and "SMs 0x0ff0055555" in kernels[0]


def test_parse_sms_keeps_the_sms_with_warps():
    assert parse_sms(SMS) == [(0, 0), (0, 2)]


def test_parse_warps_groups_by_kernel_slot_and_pc_once_per_sm():
    groups = parse_warps(WARPS)
    assert groups == {
        (0, 0, "0x00007f7c056a5b30"): [(0, 0, "(54,0,0)"), (0, 2, "(55,0,0)")],
        (0, 1, "0x00007f7c056a5b30"): [(0, 0, "(54,0,0)")],
        (0, 2, "0x00007f7c056a5950"): [(0, 0, "(54,0,0)")],
    }


def test_parse_kernels_keeps_a_demangled_invocation_whole():
    # (what cuda-gdb printed for torch's spin kernel, the tool's check on the H200)
    line = ("*      0      -   0    5 Active 0x0010000000000000000000000000000000 (1,1,1) (1,1,1) "
            "at::cuda::(anonymous namespace)::spin_kernel(long)")
    assert parse_kernels(line)[0].startswith(
        "at::cuda::(anonymous namespace)::spin_kernel(long) grid (1,1,1) block (1,1,1)")


def test_the_cli_takes_a_pid_or_a_command(monkeypatch):
    import pytest

    from cute_megamoe.testing import gpu_snapshot

    for argv in (["gpu_snapshot"], ["gpu_snapshot", "--pid", "1", "--", "true"]):
        monkeypatch.setattr("sys.argv", argv)
        with pytest.raises(SystemExit, match="either --pid or the command"):
            gpu_snapshot.main()
    seen = []
    monkeypatch.setattr(gpu_snapshot, "snapshot", lambda pid, gdb: seen.append(pid) or "report")
    monkeypatch.setattr("sys.argv", ["gpu_snapshot", "--pid", "4242", "--gdb", "/bin/sh"])
    gpu_snapshot.main()
    assert seen == [4242]
