"""The engine's fused, sampling, FP8 (quantization, grouped GEMM, decode linear) and DSA decode kernels compile for
Hopper (sm_90a), here, without a GPU.

Triton's interpreter (test_fused_kernels.py) checks what the kernels compute, not that they
compile: a construct the interpreter runs can still fail in Triton's compiler or in ``ptxas``.
This compiles each kernel ahead of time for an H100/H200 target, through ``ptxas`` to a cubin, at
the signatures and launch settings the engine uses. It needs Triton (no GPU); the CI's Triton
stage runs it in the vLLM virtualenv (test_triton_stage.py).
"""

import inspect
import os

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles kernels: not under the interpreter", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from rlcli.ops import fused_kernels, sampling_kernel  # noqa: E402
from rlcli.ops.fp8 import grouped_triton, kernels, linear_triton  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_for_hopper(kernel, types: dict[str, str], constants: dict, num_warps: int, num_stages: int = 3) -> None:
    """Compile ``kernel`` for sm_90a, through ``ptxas`` to a cubin, with argument ``types``
    (pointers ``*dtype``, integers ``i32``, floats ``fp32``) and the ``constants`` of its constexprs."""
    names = list(inspect.signature(kernel.fn).parameters)
    signature = {n: "constexpr" if n in constants else types[n] for n in names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants), target=TARGET,
                              options={"num_warps": num_warps, "num_stages": num_stages})
    assert compiled.asm["cubin"], f"{kernel.fn.__name__}: no cubin"


def ints(*names: str) -> dict[str, str]:
    return dict.fromkeys(names, "i32")


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("residual", [False, True])
def test_the_norm_compiles(dtype, residual):
    for block, warps in ((1024, 4), (8192, 8)):
        types = {**dict.fromkeys("XRWYH", f"*{dtype}"), **ints("N", "s_x", "s_r", "s_y", "s_h"), "eps": "fp32"}
        compile_for_hopper(fused_kernels._add_rms_norm_kernel, types,
                                            {"RESIDUAL": residual, "BLOCK": block}, warps)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("store", [False, True])
def test_the_rotary_compiles(norm, store):
    types = {**{n: "*bf16" for n in ("Q", "K", "V", "WQ", "WK", "COS", "SIN", "KC", "VC")},
             "SLOTS": "*i64" if store else "*bf16", "eps": "fp32",
             **ints("HQ", "HK", "HALF", "s_qt", "s_qh", "s_kt", "s_kh", "s_vt", "s_vh", "s_c", "s_kcs", "s_kch",
                    "s_vcs", "s_vch")}
    compile_for_hopper(fused_kernels._rotary_kernel, types,
                                        {"NORM": norm, "STORE": store, "BLOCK": 64}, 1)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_gate_compiles(dtype):
    """SwiGLU's gate and its backward, with libdevice's exp (as they run on a GPU)."""
    types = {**dict.fromkeys("GUO", f"*{dtype}"), **ints("N", "s_g", "s_u", "s_o")}
    compile_for_hopper(fused_kernels._silu_mul_kernel, types,
                                        {"EXACT": True, "BLOCK": fused_kernels.SILU_BLOCK}, 4)
    types = {**dict.fromkeys(("G", "U", "DH", "DG", "DU"), f"*{dtype}"),
             **ints("N", "s_g", "s_u", "s_dh", "s_dg", "s_du")}
    compile_for_hopper(fused_kernels._silu_mul_backward_kernel, types,
                       {"EXACT": True, "BLOCK": fused_kernels.SILU_BLOCK}, 4)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_the_sampling_kernel_compiles(dtype):
    types = {"LOGITS": f"*{dtype}", "TEMP": "*fp32", "U": "*fp64", "TOKENS": "*i64", "LOGPROBS": "*fp32",
             **ints("V", "s_l")}
    compile_for_hopper(sampling_kernel._sample_kernel, types, {"BLOCK": sampling_kernel.BLOCK}, 8)


@pytest.mark.parametrize("launch,mapped", [("rows", False), ("rows", True), ("both", False), ("weight", False)])
def test_the_fp8_quantization_compiles(launch, mapped):
    """The one quantization kernel in each of its uses: 1x128 rows (zero rows appended up to MO, or
    stored to mapped rows), rows and the transpose from one read, 128x128 weight blocks. Only rows
    are ever mapped."""
    bm, warps = kernels.LAUNCH[launch]
    types = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "qt_ptr": "*fp8e4nv", "st_ptr": "*fp32",
             "map_ptr": "*i64", **ints("M", "MO", "K", "sxb", "sxm", "sxk", "sqb", "sqm", "ssb", "ssm", "ssk", "sqtb",
                                       "sqtk", "sstb", "sstk", "sstm")}
    compile_for_hopper(kernels._quant_kernel, types,
                       {"BM": bm, "ROW": launch != "weight", "COL": launch != "rows", "BLOCK2D": launch == "weight",
                        "UE8M0": False, "MAPPED": mapped, "HW_CAST": True}, warps)


@pytest.mark.parametrize("bm", [16, 32, 64])
@pytest.mark.parametrize("out", ["bf16", "fp32"])
def test_the_fp8_grouped_gemm_compiles(bm, out):
    """FP8 operands (e4m3) into Hopper's FP8 tensor-core dot, at each tile height block_m picks."""
    types = {"a_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "b_ptr": "*fp8e4nv", "sb_ptr": "*fp32", "out_ptr": f"*{out}",
             "offs_ptr": "*i32",
             **ints("M", "N", "K", "G", "stride_am", "stride_sam", "stride_sak", "stride_bg", "stride_bn",
                    "stride_sbg", "stride_sbn", "stride_om")}
    compile_for_hopper(grouped_triton._grouped_kernel, types, {"BM": bm, "BN": 128, "BK": 128, "GP": 256}, 4, 3)


@pytest.mark.parametrize("bm", [16, 32, 64])
@pytest.mark.parametrize("bn", [16, 32, 64, 128])
@pytest.mark.parametrize("ue8m0,preq", [(False, False), (True, False), (False, True)])
def test_the_fp8_decode_linear_compiles(bm, bn, ue8m0, preq):
    """bf16 rows quantized in the kernel (the hardware e4m3 cast) into the FP8 dot, or FP8 rows read as
    they are; the split sum of its fp32 partials; every tile shape."""
    ints_ = ints("M", "N", "K", "KB_PER", "stride_xm", "stride_xsm", "stride_xsk", "stride_wn", "stride_wsn",
                 "stride_os", "stride_om")
    types = {"x_ptr": "*fp8e4nv" if preq else "*bf16", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
             "out_ptr": "*fp32", **ints_}
    compile_for_hopper(linear_triton._linear_kernel, types, {"BM": bm, "BN": bn, "UE8M0": ue8m0, "HW_CAST": True,
                                                             "PREQ": preq}, 4, 4)
    compile_for_hopper(linear_triton._sum_splits_kernel, {"part_ptr": "*fp32", "out_ptr": "*bf16", "MN": "i32"},
                       {"SPLITS": 3, "BLOCK_SIZE": 1024}, 4)


def _dsa_kernels():
    from rlcli.ops import dsa_triton_kernels

    return dsa_triton_kernels


def test_the_paged_indexer_scores_compile():
    """DSA's decode scores by block table (DeepSeek-V3.2: 64 indexer heads of 128, 16-token blocks)."""
    types = {"q_ptr": "*bf16", "w_ptr": "*fp32", "k_ptr": "*bf16", "tables_ptr": "*i64", "lens_ptr": "*i32",
             "out_ptr": "*fp32", "scale": "fp32", **ints("S", "sq_t", "sq_h", "sw_t", "sk_s", "st_t", "so_t")}
    compile_for_hopper(_dsa_kernels()._paged_index_scores_kernel, types,
                       {"HI": 64, "DI": 128, "DP": 128, "BT": 16, "BS": 128, "BLOCK": 16, "PREC": "tf32"}, 4)


def test_the_decode_topk_compiles():
    """DSA's decode choice: radix select over each row's context (histograms of uint32 digits)."""
    from rlcli.ops import dsa_triton

    types = {"s_ptr": "*fp32", "lens_ptr": "*i32", "out_ptr": "*i64", **ints("K", "ss_t", "so_t")}
    compile_for_hopper(_dsa_kernels()._topk_rows_kernel, types, {"CHUNK": dsa_triton.TOPK_CHUNK}, 8)


@pytest.mark.parametrize("counts", [False, True])
def test_the_sparse_attention_compiles(counts):
    """DSA's sparse attention over the chosen tokens (latent 512 + rope 64), stopping at each
    query's count of valid entries (the engine's decodes) or walking all of them (training)."""
    types = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i32", "count_ptr": "*i32", "o_ptr": "*bf16",
             "lse_ptr": "*fp32", "scale": "fp32", **ints("H", "K", "sq_t", "sq_h", "skv_s", "si_t", "so_t", "so_h")}
    compile_for_hopper(_dsa_kernels()._sparse_fwd_kernel, types,
                       {"HB": 16, "R": 512, "RP": 512, "DR": 64, "DRP": 64, "BK": 32, "PREC": "tf32",
                        "COUNTS": counts}, 4)
