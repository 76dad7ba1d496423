"""`testing.sass_hashes`: the default kernel builds it hashes (every one built as the layer
builds it, on the CPU) and the hash of a SASS listing, which ignores the kernels' symbol names
(they spell the module and class) but nothing else."""

from __future__ import annotations

from cute_megamoe.testing import sass_hashes


def test_every_default_build_is_made_once_as_the_layer_makes_it():
    builds = list(sass_hashes.builds())
    names = [b.name for b in builds]
    assert len(names) == len(set(names)) >= 100
    kinds = {name.split("/")[1] for name in names}
    assert kinds == {"staging", "dispatch", "combine", "gemm", "fused"}
    for arch in ("sm_90a", "sm_100a"):
        assert any(name.startswith(f"{arch}/fused/") for name in names)
    kernels = {b.name: b.make()[0] for b in builds}  # (kernel objects: nothing compiled)
    by_name = {b.name: b for b in builds}
    assert all(getattr(k, "config", None) is not None for name, k in kernels.items()
               if "/gemm/" in name or "/fused/" in name)
    # (the heuristics' choices: the transposed mainloop at decode sizes, the MXFP4 clusters
    # that share the decode at large ones, the fused kernel's local dispatch at R = 1)
    gemm, _ = by_name["sm_90a/gemm/fp8xfp8/bm64/tokens8/l1"].make()
    assert gemm.transposed and not by_name["sm_90a/gemm/fp8xfp8/bm64/tokens32/l1"] \
        .make()[0].transposed
    assert by_name["sm_90a/gemm/fp8xfp4_sm90/bm128/tokens256/l2-out"].make()[0].cluster_m == 2
    fused, _ = by_name["sm_90a/fused/fp8xfp8/bm64/decode"].make()
    assert fused.local_dispatch and fused.stages_inputs
    staged_x, _ = by_name["sm_90a/fused/fp8xfp8/bm64/decode/x-staged"].make()
    assert not staged_x.local_dispatch and not staged_x.stages_inputs


def test_sass_hash_ignores_the_kernel_symbols_only():
    listing = ("\t.text.kernel_cutlass_kernel_modA_Kernel_object_at_0:\n"
               "        /*0000*/                   MOV R1, c[0x0][0x28] ;\n"
               "        CALL kernel_cutlass_kernel_modA_Kernel_object_at_0 ;\n")
    renamed = listing.replace("modA", "modB")
    assert sass_hashes.sass_hash(listing) == sass_hashes.sass_hash(renamed)
    assert sass_hashes.sass_hash(listing) != sass_hashes.sass_hash(listing.replace("R1", "R2"))
