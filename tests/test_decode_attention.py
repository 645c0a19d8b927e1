"""dsv4_kernels.decode_attention.decode_attention_triton against model_dsv4.sink_attention on the gathered keys (with
Attention.output's inverse RoPE), alone and in the engine's decode. Without a GPU, Triton's interpreter runs it on CPU
tensors (the package's __init__ turns it on); test_kernel_builds.py compiles it for sm_90 and gfx950."""
import copy
from dataclasses import replace

import pytest
import torch

from dsv4_kernels.decode_attention import decode_attention_triton  # before triton: turns on the interpreter
import kv_cache
from conftest import TINY, randomize_
from model_dsv4 import Transformer, apply_rope, rope_cos_sin, sink_attention

pytest.importorskip("triton", reason="Triton comes with torch's GPU builds; requirements.txt installs it for the CPU")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("H,D,compressed,dtype,splits,rope", [(3, 40, "picked", torch.float32, 1, False),
                                                               (20, 32, None, torch.float32, 1, True),
                                                               (16, 64, "all", torch.bfloat16, 1, True),
                                                               (3, 40, "picked", torch.float32, 2, True),
                                                               (20, 32, "all", torch.float32, 3, False),
                                                               (16, 64, "picked", torch.bfloat16, 2, True)])
def test_decode_attention_triton_equals_sink_attention(H, D, compressed, dtype, splits, rope):
    """One query token per sequence against its cache rows (slots out of order, one cache row never read): the
    window's 8 keys, at positions in the window, past it, ahead of the sequence's position or none (-1); compressed
    entries (ratio 2) up to each sequence's count, of 60 ("all", as an HCA layer) or of the first 50 where an
    indexer picked them ("picked", a CSA layer; two blocks of keys: one row attends nothing in the second), or none;
    one row attends nothing at all. Against sink_attention on the keys gathered and concatenated, masked as
    KVCache._attn_decode masks them, and exact attention in fp64. Heads 3 and 20 (padded to blocks of 16), head dims
    40 and 32 (padded to a power of two). fp32: to 1e-5 of the largest output. bf16 (the engine's): the reference to
    a rounding, the kernel to two (the interpreter truncates where the GPU rounds: probabilities and output). Split
    over 2 programs a sequence (a block each) and 3 (the third with no block), as over 1. rope: RoPE undone on the
    output's last 16 dims (as Attention.output does), each sequence at its own position."""
    g = torch.Generator().manual_seed(H)
    B, W, n_comp, ratio = 5, 8, 60, 2
    S = {None: 0, "all": n_comp, "picked": 50}[compressed]
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(DEV, dtype)
    q, win, comp, sink = rnd(B, H, D) * 2, rnd(B + 1, W, D), rnd(B + 1, n_comp, D) if compressed else None, rnd(H)
    slots = torch.randperm(B + 1, generator=g)[:B]
    pos = torch.tensor([90, 0, 101, 40, 119])
    win_pos = torch.randint(-1, 120, (B + 1, W), generator=g)
    win_pos[slots] = pos[:, None] - torch.randint(-2, 12, (B, W), generator=g)  # in the window, past it, ahead
    win_pos[torch.rand(B + 1, W, generator=g) < 0.2] = -1
    win_pos[slots[1]] = -1  # row 1 (position 0: no compressed entry either) attends nothing
    cmask = torch.rand(B, S, generator=g) < 0.6
    cmask[2, 24:] = False  # row 2: nothing in the second block of 32 keys (8 window keys, then entries 0-23)
    wp = win_pos[slots]
    mask = (wp >= 0) & (wp > pos[:, None] - W) & (wp <= pos[:, None])
    visible = (torch.arange(S)[None] < ((pos + 1) // ratio)[:, None]) & (cmask if compressed == "picked" else True)
    mask = torch.cat([mask, visible], 1)
    assert not mask[1].any() and mask[0, :W].any() and (not compressed or mask[0, W:].any())
    assert compressed != "picked" or (mask[2, W:].any() and not mask[2, 32:].any())
    slots, pos, win_pos, cmask, mask = (t.to(DEV) for t in (slots, pos, win_pos, cmask, mask))
    cos, sin = rope_cos_sin(replace(TINY, qk_rope_head_dim=16), 4, torch.tensor([[3], [70], [5], [0], [999]]).to(DEV))
    turn = {"cos": cos[:, 0], "sin": sin[:, 0]} if rope else {}
    out = decode_attention_triton(q, win, win_pos, comp, slots, pos, ratio if compressed else 0, sink.float(),
                                  D ** -0.5, **turn, cmask=cmask if compressed == "picked" else None, splits=splits)
    keys = torch.cat([win[slots], comp[slots, :S]], 1) if compressed else win[slots]
    ref = sink_attention(q[:, None], keys, mask[:, None], sink.float(), D ** -0.5)
    exact = sink_attention(q[:, None].double(), keys.double(), mask[:, None], sink.double(), D ** -0.5)
    if rope:
        ref, exact = apply_rope(ref, cos[:, None], -sin[:, None]), apply_rope(exact, cos[:, None], -sin[:, None])
    ref, exact = ref[:, 0], exact[:, 0]
    assert out.shape == ref.shape and out.dtype == dtype and (out[1] == 0).all()  # the sink took all of row 1
    top = exact.abs().max()
    if dtype == torch.float32:
        assert (out.double() - exact).abs().max() <= 1e-5 * top
    else:
        assert (ref.double() - exact).abs().max() <= 2 ** -7 * top  # two roundings with RoPE undone
        assert (out.double() - exact).abs().max() <= 2 ** -6 * top


@pytest.mark.slow
def test_engine_decode_on_triton_attention_equals_reference(monkeypatch):
    """The engine's decode with the kernel (static caches, read whole and masked, as under CUDA graphs) against the
    reference path (each sequence's entries up to its own count, gathered): TINY's window, CSA and HCA layers decode
    8 tokens in cache rows 2, 0, 3 after prompts of 10, 26 and 44 tokens (past the 32-token window, and each one
    completes a CSA and an HCA entry), both sides fed the same tokens. fp32, so that a wrong key or mask is not lost
    in bf16's noise (which this random model amplifies: the bf16 reference alone, static against not, parts by 0.7
    on logits of 4.8); 9e-6 apart on the CPU. (The experts' kernels in the interpreter would make this a minute: the
    next test.)"""
    monkeypatch.setattr(kv_cache, "has_triton", lambda t: True)
    model = randomize_(Transformer(copy.deepcopy(TINY), dtype=torch.float32), TINY.n_routed_experts,
                       TINY.num_experts_per_tok, seed=2).to(DEV)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, TINY.vocab_size, (n,), generator=g).tolist() for n in (10, 26, 44)]
    tokens = torch.randint(2, TINY.vocab_size, (8, 3), generator=g).to(DEV)
    slots = torch.tensor([2, 0, 3], device=DEV)
    logits = []
    for fast in (True, False):
        for layer in model.layers.values():
            layer.attn.fast = layer.attn.fast_decode = fast
        cache = kv_cache.KVCache(model, 4, 64, DEV, static=fast)
        out = []
        with torch.no_grad():
            cache.prefill(model, slots.tolist(), prompts)
            for i, t in enumerate(tokens):
                out.append(cache.decode(model, slots, t, torch.tensor([len(p) + i for p in prompts], device=DEV)))
        logits.append(torch.stack(out).float())
    fast, ref = logits
    assert (fast - ref).abs().max() <= 1e-5 * ref.abs().max(), ((fast - ref).abs().max(), ref.abs().max())
