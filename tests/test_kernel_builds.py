"""Every Triton kernel of the project (dsv4_kernels/: mhc_triton.py, decode.py, decode_attention.py, route.py)
compiled to machine code for the H200 and the MI355X, without a GPU. Their values are tested against their references
in test_mhc_kernels.py, test_decode_kernels.py, test_decode_attention.py and test_routing_kernels.py."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="Triton comes with torch's GPU builds; requirements.txt installs it for the CPU")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_kernels_compile_for_h200_and_mi355x():
    """Triton's interpreter runs code that its compiler refuses (an `if` whose branches give two shapes passes the tests
    on the CPU and fails to compile for the GPU). So every kernel is also compiled here, without a GPU, to machine code
    for the H200 (sm_90, a cubin) and the MI355X (gfx950, a hsaco), as the launchers call them: Sinkhorn on 4 x 4
    matrices, 20 iterations; hc_post on bf16 streams of bench_2b's width (D 1536: a block of 2048, a token a program);
    decode attention at head dim 512 (one program a sequence, and split; RoPE undone on the output; with the indexer's
    picks and without); the experts' two kernels, with the shared expert and without; the compressor's step with and
    without overlap; the sampler's two kernels; hc_pre's two at bench_2b's sizes (the mixes' tl.dot in each backend's
    precision, mhc_triton.hc_dot; the second with the sublayer's norm and without); the router (hash and learned, 256
    experts) and the pairs' ordering (with the rows' copy and without); the query's norm and RoPE and the window key's
    write at head dim 512. In a subprocess per backend: this process's kernels are interpreted."""
    code = """
import sys
import dsv4_kernels.decode_attention as ka, dsv4_kernels.decode as kd, dsv4_kernels.route as kr
import dsv4_kernels.mhc_triton as kt, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
# (kernel, constexprs, scalar arguments, bf16 pointers (the others fp32), warps)
kernels = [(fn, {"STEPS": 39, "N": 4, "NP": 4, "BLOCK": kt.BLOCK}, {"n_tok": "i32", "eps": "fp32"}, (), 1)
           for fn in (kt._sinkhorn_fwd, kt._sinkhorn_bwd)]
kernels += [(fn, {"N": 4, "NP": 4, "BLOCK_D": 2048}, {"D": "i32"}, ("f_ptr", "x_ptr", "y_ptr", "dy_ptr", "df_ptr"),
             8) for fn in (kt._hc_post_fwd, kt._hc_post_bwd)]
attn = {"HEADS": ka.HEADS, "DP": 512, "BLOCK_N": ka.DECODE_BLOCK_N, "F32": False, "RH": 32}
attn_sizes = {a: "i32" for a in ("H", "D", "W", "S", "n_comp", "ratio", "SPLITS", "B")}
attn_sizes |= {"scale": "fp32", **{a: "*i64" for a in ("slot_ptr", "wpos_ptr", "pos_ptr")}, "cmask_ptr": "*u8"}
passes = ((ka._decode_attn, {}), (ka._decode_attn_stats, {}), (ka._decode_attn_part, {"SP": 4}))
kernels += [(fn, consts, attn_sizes, ("q_ptr", "win_ptr", "comp_ptr", "out_ptr"), 4)
            for fn, consts in (*((f, {**attn, **sp, "CMASK": c}) for c in (False, True) for f, sp in passes),
                               (ka._decode_attn_sum, {a: attn[a] for a in ("HEADS", "DP", "RH")}))]
blocks = {"F32": False, "BLOCK_M": 16, "BLOCK_N": kd.EXPERTS_BLOCK_N, "BLOCK_K": kd.EXPERTS_BLOCK_K}
kernels += [(kd._compress_step, {"OVERLAP": o, "WP": 1024 if o else 512, "DP": 512, "MP": m,
                                  "BR": min(m, kd.COMPRESS_ROWS), "RH": 32},
             {**{a: "i32" for a in ("row", "m", "d", "n_out")}, "eps": "fp32", "slot_ptr": "*i64", "pos_ptr": "*i64"},
             ("out_ptr",), 4) for o, m in ((True, 4), (False, 128))]
kernels += [(fn, {**consts, "SHARED": sh}, {**{a: "i32" for a in ("D", "I", "R", "NT", "SB")}, "limit": "fp32",
                                          "offs_ptr": "*i32"},
             ("x_ptr", "w13_ptr", "h_ptr", "w2_ptr", "out_ptr", "tok_ptr", "s1_ptr", "s3_ptr", "s2_ptr"), 4)
            for fn, consts in ((kd._experts_up, {"CLAMP": True, **blocks}), (kd._experts_down, blocks))
            for sh in (False, True)]
kernels += [(kt._hc_mix_parts, {"R": 24, "RP": 32, "BT": kt.HC_BT, "BK": kt.HC_BK, "DOT": None},
             {"T": "i32", "K": "i32"}, ("x_ptr",), 4),
            *((kt._hc_pre, {"N": 4, "NP": 4, "RP": 32, "STEPS": 39, "SB": 64, "BLOCK_D": 2048, "NORM": norm},
               {a: "i32" for a in ("T", "S", "D")} | {a: "fp32" for a in ("norm_eps", "hc_eps", "out_eps")},
               ("x_ptr", "h_ptr"), 4) for norm in (False, True))]
route = {"N": "i32", "E": "i32", "row": "i32", "scale": "fp32", "ids_ptr": "*i64", "idx_ptr": "*i64"}
kernels += [(kr._route, {"K": 6, "KP": 8, "EP": 256, "BT": kr.ROUTE_BT, "FUNC": 2, "HASH": h, "NORM": True},
             {**route, "table_ptr": "*i64" if h else "*fp32"}, (), 4) for h in (True, False)]
kernels += [(kr._pair_order, {"BP": kr.ORDER_BP, "BQ": kr.ORDER_BQ, "COPY": c, "BLOCK_D": 1024},
             {**{a: "i32" for a in ("P", "E", "PAIR_PROGRAMS", "K", "D")},
              **{a: "*i64" for a in ("flat_ptr", "order_ptr", "inv_ptr", "count_ptr")}}, ("x_ptr", "xs_ptr"), 4)
            for c in (False, True)]
kernels += [(kd._q_norm_rope, {"RH": 32, "DP": 512, "HB": 4}, {"H": "i32", "d": "i32", "eps": "fp32"},
             ("q_ptr", "out_ptr"), 4),
            (kd._window_kv, {"RH": 32, "DP": 512}, {**{a: "i32" for a in ("row", "W", "d")}, "eps": "fp32",
             **{a: "*i64" for a in ("wpos_ptr", "slot_ptr", "pos_ptr")}}, ("kv_ptr", "win_ptr"), 4)]
sizes = {"V": "i32", "CHUNK": "i32", "S": "i32"}
kernels += [(kd._sample_sums, {"BLOCK": kd.SAMPLE_BLOCK}, sizes, (), 4),
            (kd._sample_pick, {"SP": 16, "BLOCK": kd.SAMPLE_BLOCK}, {**sizes, "greedy_ptr": "*u8", "draws_ptr": "*i64",
             "best_ptr": "*fp64", "idx_ptr": "*i64"}, (), 4)]
target, binary = {"cuda": (GPUTarget("cuda", 90, 32), "cubin"),
                  "hip": (GPUTarget("hip", "gfx950", 64), "hsaco")}[sys.argv[1]]  # the backend this process builds for
for fn, consts, scalars, bf16, warps in kernels:
    ptrs = {a: "*bf16" if a in bf16 else scalars.get(a, "*fp32") for a in fn.arg_names if a.endswith("_ptr")}
    sig = {**ptrs, **{a: t for a, t in scalars.items() if a in fn.arg_names}}
    consts = {**consts, "DOT": kt.hc_dot(target.backend)} if "DOT" in consts else consts  # per backend
    sig.update({a: "constexpr" for a in consts})
    src = ASTSource(fn, sig, constexprs=consts)
    asm = triton.compile(src, target=target, options={"num_warps": warps}).asm
    assert binary in asm, (target, fn)
    print(target.arch, fn.__name__, "compiled")
"""
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # a process per backend, side by side (~85 s one after the other)
    runs = [subprocess.Popen([sys.executable, "-c", code, backend], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for backend in ("cuda", "hip")]
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-3000:]
        assert out.count("compiled") == 28, out
