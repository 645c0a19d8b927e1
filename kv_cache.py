"""
The embedded engine's KV cache, and the model's two steps through it: prefill of a batch of prompts into sequence
slots, and decode of one token per sequence. engine.py schedules requests, samples and replays decode as CUDA graphs;
this file is the model's side.

Per layer and per sequence slot the cache holds what DeepSeek-V4's attention reads:
  - a ring buffer of the last `sliding_window` KV vectors (one shared K=V head) and their positions;
  - for compressed layers, the compressed entries emitted so far (one per `ratio` tokens), and the
    compressor's state: the kv/score rows of the current partial window and, for CSA's overlapping
    windows, the previous window's first-half rows;
  - for CSA layers the same again for the lightning indexer's own compressor;
  - with record (routing and indexer replay, replay.py), the experts each position was routed to and the compressed
    entries each position's indexer picked, for the whole sequence (`recorded` reads a finished one).
A prompt is prefilled with the training forward's functions; decode then feeds one token per step.
Prefill followed by decode equals a full forward (tests/test_engine.py). Decode has no host sync, and with
static=True fixed shapes (compressed caches are read whole, masked), so on a GPU each batch bucket's step is one
CUDA graph.
"""
import torch

from dsv4_kernels import has_triton
from dsv4_kernels.decode import compress_step_triton, window_kv_triton
from dsv4_kernels.decode_attention import decode_attention_triton
from dsv4_kernels.fast import fused_projections
from model_dsv4 import length_multiple, mask_picks, rope_cos_sin, sink_attention, top_k_mask

RECORD = {"routed_experts": "experts", "indexer_topk": "index"}  # replay.py's field -> the cache's buffer


def compressors(attn):
    """A layer's compressors as the cache names them: ("comp", the attention's) and ("idx", its indexer's), those
    it has."""
    pairs = (("comp", attn.compressor), ("idx", attn.indexer.compressor if attn.indexer else None))
    return [(name, comp) for name, comp in pairs if comp is not None]


class KVCache:
    """Fixed-size buffers for max_batch sequence slots (see the module docstring), and the model's prefill and decode
    through them. static: decode reads every compressed entry, masked (fixed shapes, for CUDA graphs and compiled
    code); else only up to the longest sequence's. record: the fields of RECORD to keep, int32 [max_len, K] (experts)
    and [max_len, index_topk] (CSA layers' indexer picks) a slot and layer."""
    pad_prefill = False  # compile_policy.compile_engine sets it: prefill pads its length to length_multiple

    def __init__(self, model, max_batch, max_len, device, static=False, record=()):
        a, dt = model.args, model.dtype
        self.args, self.device, self.static = a, device, static
        self.layers = []
        for layer in model.layers.values():
            attn, c = layer.attn, {}
            c["win"] = torch.zeros(max_batch, a.sliding_window, a.head_dim, dtype=dt, device=device)
            c["win_pos"] = torch.full((max_batch, a.sliding_window), -1, dtype=torch.long, device=device)
            for name, comp in compressors(attn):
                m, d, coff = comp.ratio, comp.head_dim, 2 if comp.overlap else 1
                c[name] = torch.zeros(max_batch, max_len // m + 1, d, dtype=dt, device=device)  # entries
                c[name + "_kv"] = torch.zeros(max_batch, m, coff * d, device=device)  # partial window, fp32
                c[name + "_score"] = torch.zeros(max_batch, m, coff * d, device=device)
                c[name + "_prev_kv"] = torch.zeros(max_batch, m, d, device=device)  # overlap: window before
                c[name + "_prev_score"] = torch.full((max_batch, m, d), float("-inf"), device=device)
            if "routed_experts" in record:
                c["experts"] = torch.zeros(max_batch, max_len, a.num_experts_per_tok, dtype=torch.int32, device=device)
            if "indexer_topk" in record and attn.indexer is not None:
                c["index"] = torch.full((max_batch, max_len, a.index_topk), -1, dtype=torch.int32, device=device)
            self.layers.append(c)

    def reset(self, slots):
        """Empty the cache rows `slots` (a list): no window entries, no overlap state. One op per buffer."""
        idx = torch.tensor(slots, device=self.device)
        for c in self.layers:
            c["win_pos"][idx] = -1
            for k in c:
                if k.endswith("_prev_score"):
                    c[k][idx] = float("-inf")
                elif k.endswith("_prev_kv"):
                    c[k][idx] = 0

    def recorded(self, slot, n, fields):
        """Positions [0, n) of the sequence in `slot`, of the recorded fields (RECORD) -> {field: int32 on the host,
        [n, layers, K] for routed_experts, [n, CSA layers, index_topk] for indexer_topk}."""
        return {f: torch.stack([c[RECORD[f]][slot, :n] for c in self.layers if RECORD[f] in c], 1).cpu()
                for f in fields}

    def copy(self, srcs, dsts):
        """Copy cache rows srcs to rows dsts (lists; the n samples of a prompt share its prefill)."""
        src, dst = torch.tensor(srcs, device=self.device), torch.tensor(dsts, device=self.device)
        for c in self.layers:
            for t in c.values():
                t[dst] = t[src]

    def prefill(self, model, slots, prompts):
        """prompts: token lists, right-padded into one batch (causal: the pads never reach the real tokens)
        -> fp32 logits [B, vocab] at each prompt's last position; fills each slot's cache from position 0. With
        pad_prefill (compiled layers) the batch's length is padded up to a multiple of model_dsv4.length_multiple, so
        that every length runs one compiled graph of each kind of layer."""
        lengths = [len(p) for p in prompts]
        m = length_multiple(self.args) if self.pad_prefill else 1
        T = -(-max(lengths) // m) * m
        ids = torch.tensor([p + [0] * (T - len(p)) for p in prompts], device=self.device)
        x = model.embed_streams(ids)
        slot_t, L = torch.tensor(slots, device=self.device), torch.tensor(lengths, device=self.device)
        for layer, c in zip(model.layers.values(), self.layers):
            x, kv, comps, routed, cmask = self.prefill_layer(layer, x, ids)
            self._fill(c, slot_t, L, kv, [(n, cp, *t) for (n, cp), t in zip(compressors(layer.attn), comps)])
            if "experts" in c:  # recorded: row p for position p (a pad's row is written by decode before it is read)
                c["experts"][slot_t, :T] = routed[:, :c["experts"].shape[1]].int()
            if "index" in c:
                c["index"][slot_t, :T] = mask_picks(cmask, self.args.index_topk)[:, :c["index"].shape[1]]
        return model.logits(x[torch.arange(len(prompts), device=self.device), L - 1][:, None])[:, 0]

    def prefill_layer(self, layer, x, ids):
        # one Block.forward over the batch's prompts x [B, T, n, D] (ids [B, T]), and what decode needs from them: the
        # window's keys kv [B, T, d] and, for each compressor of compressors(attn), (its entries, its kv and score
        # rows); and the experts each token went to [B, T, K] and the compressed entries each query read, the indexer's
        # picks on a CSA layer (Attention.forward's picked). compile_policy.compile_engine compiles this (dynamic batch
        # and length: layers of one kind share it)
        a = self.args
        h, post, comb = layer.hc_pre(x, layer.hc_attn_fn, layer.hc_attn_scale, layer.hc_attn_base, layer.attn_norm)
        attn = layer.attn
        cos, sin = rope_cos_sin(a, attn.ratio, torch.arange(x.shape[1], device=x.device))
        kv = attn.window_kv(h, cos, sin)
        comps = [(cp(h, a), *cp.project(h)) for _, cp in compressors(attn)]
        o, cmask = attn(h, picked=True)
        x = layer.hc_post(o, x, post, comb)
        h, post, comb = layer.hc_pre(x, layer.hc_ffn_fn, layer.hc_ffn_scale, layer.hc_ffn_base, layer.ffn_norm)
        y, routed = layer.ffn(h, ids, routed=True)
        return layer.hc_post(y, x, post, comb), kv, comps, routed, cmask

    def _fill(self, c, slots, L, kv, comps):
        """Write a prefilled batch into cache rows slots (int64 [B]), prompt b being L[b] tokens of the right-padded
        T: in one op per buffer for the whole batch, not a loop over the sequences. Rows past a prompt's end get the
        pads' values, as decode never reads them before it writes them: compressed entries from L // ratio on are masked
        until decode emits them, and a partial window's rows are written by decode before the window is pooled."""
        W = self.args.sliding_window
        b = torch.arange(len(L), device=L.device)[:, None]
        # ring position r holds the last prompt position p < L with p % W == r, if any
        p = L[:, None] - 1 - (L[:, None] - 1 - torch.arange(W, device=L.device)) % W  # [B, W]
        c["win"][slots] = torch.where((p >= 0)[..., None], kv[b, p.clamp(min=0)], 0)
        c["win_pos"][slots] = p.clamp(min=-1)
        T = kv.shape[1]
        for name, comp, entries, ckv, score in comps:
            m, d = comp.ratio, comp.head_dim
            n = L // m  # complete windows: entries 0 .. n - 1, the partial window from position n * m
            k = min(entries.shape[1], c[name].shape[1])  # a padded batch (pad_prefill) may run past the cache
            c[name][slots, :k] = entries[:, :k]
            rows = (n[:, None] * m + torch.arange(m, device=L.device)).clamp(max=T - 1)  # [B, m]
            c[name + "_kv"][slots], c[name + "_score"][slots] = ckv[b, rows], score[b, rows]
            if comp.overlap:  # the last complete window's first-half rows, position bias added
                prev = ((n[:, None] - 1) * m + torch.arange(m, device=L.device)).clamp(min=0)
                some = (n > 0)[:, None, None]
                c[name + "_prev_kv"][slots] = torch.where(some, ckv[b, prev, :d], c[name + "_prev_kv"][slots])
                c[name + "_prev_score"][slots] = torch.where(some, (score[b, prev] + comp.ape)[..., :d],
                                                             c[name + "_prev_score"][slots])

    def decode(self, model, slots, tokens, pos):
        """One token per sequence: slots, tokens, pos int64 [B] on the device -> fp32 logits [B, vocab]."""
        x = model.embed_streams(tokens[:, None])  # [B, 1, n, D]
        rope = self.step_rope(model, pos)
        for layer, c in zip(model.layers.values(), self.layers):
            x = self.decode_layer(layer, c, x, slots, tokens, pos, rope)
        return model.logits(x)[:, 0]

    def step_rope(self, model, pos):
        """The step's RoPE angles, once for all layers (each layer's took ~4 small kernels; compile_engine
        compiles this too): cos/sin [B, 1, rd/2] at each sequence's position for the layers of each base (key
        ("pos", ratio > 0)), and at the first position of the window that ends there for each compress ratio m
        (key ("start", m)), where the compressors' entries are rotated."""
        ratios = {layer.attn.ratio for layer in model.layers.values()}
        rope = {("pos", c): rope_cos_sin(self.args, int(c), pos[:, None]) for c in sorted({r > 0 for r in ratios})}
        return rope | {("start", m): rope_cos_sin(self.args, m, (pos + 1 - m)[:, None]) for m in sorted(ratios) if m}

    def decode_layer(self, layer, c, x, slots, tokens, pos, rope):
        # one Block.forward for one token per sequence, reading and writing the layer's cache c; rope: step_rope's
        # (compile_policy.compile_engine compiles this: layers of one kind share the compiled code)
        h, post, comb = layer.hc_pre(x, layer.hc_attn_fn, layer.hc_attn_scale, layer.hc_attn_base, layer.attn_norm)
        x = layer.hc_post(self._attn_decode(layer.attn, h, c, slots, pos, rope), x, post, comb)
        h, post, comb = layer.hc_pre(x, layer.hc_ffn_fn, layer.hc_ffn_scale, layer.hc_ffn_base, layer.ffn_norm)
        y, routed = layer.ffn(h, tokens[:, None], routed=True)
        if "experts" in c:  # recorded for replay
            c["experts"][slots, pos] = routed[:, 0].int()
        return layer.hc_post(y, x, post, comb)

    def _compressor_step(self, comp, h, c, name, slots, pos, fast, proj, rope):
        """Add one token's kv/score row to its partial window; when the window completes, pool it into a
        new compressed entry (RoPE at the window's first position) and roll the overlap state.
        Every row is pooled and the result kept only where the window is complete: no host sync, fixed shapes.
        fast: dsv4_kernels.decode.compress_step_triton does all of it in one kernel, pooling only the complete windows.
        proj: (kv, score) [B, 1, coff*d] from the layer's fused projections, or None: comp.project here.
        rope: step_rope's tables."""
        m, d = comp.ratio, comp.head_dim
        kv, score = comp.project(h[:, 0]) if proj is None else (proj[0][:, 0], proj[1][:, 0])  # [B, coff*d]
        if fast and not comp.fp8_emu:  # all of it in one kernel (dsv4_kernels.decode.compress_step_triton)
            cos, sin = rope[("start", m)]  # at the window's first position
            compress_step_triton(kv, score, c[name + "_kv"], c[name + "_score"], c[name + "_prev_kv"],
                                 c[name + "_prev_score"], comp.ape, comp.norm.weight, cos[:, 0], sin[:, 0], c[name],
                                 slots, pos, comp.norm.eps)
            return
        j = pos % m
        c[name + "_kv"][slots, j], c[name + "_score"][slots, j] = kv, score
        full = (j == m - 1)[:, None]
        st_kv, st_score = c[name + "_kv"][slots], c[name + "_score"][slots]  # [B, m, coff*d]
        prev_kv, prev_score = c[name + "_prev_kv"][slots], c[name + "_prev_score"][slots]
        pooled = comp.pool(st_kv[:, None], st_score[:, None], prev_kv, prev_score)
        entry = comp.finish(pooled, self.args, (pos + 1 - m)[:, None])[:, 0]
        c[name][slots, pos // m] = torch.where(full, entry, c[name][slots, pos // m])
        if comp.overlap:  # the window's first-half rows become the next one's overlap (ratio 4: a few rows)
            st_kv, st_score = c[name + "_kv"][slots, :, :d], c[name + "_score"][slots, :, :d]
            prev_kv, prev_score = c[name + "_prev_kv"][slots], c[name + "_prev_score"][slots]
            c[name + "_prev_kv"][slots] = torch.where(full[:, None], st_kv, prev_kv)
            c[name + "_prev_score"][slots] = torch.where(full[:, None], st_score + comp.ape[:, :d], prev_score)

    def _attn_decode(self, attn, h, c, slots, pos, rope):
        a = self.args
        cos, sin = rope[("pos", attn.ratio > 0)]  # [B, 1, rd/2]: each sequence at its own position
        p = fused_projections(attn, h)  # the input's projections in one GEMM where the engine fused them, else {}
        comp = lambda n: (p[n + ".wkv"], p[n + ".wgate"]) if p else None
        q, qr = attn.query(h, cos, sin, p.get("wq_a"))
        W = a.sliding_window
        fast = attn.fast_decode and has_triton(h) and not torch.is_grad_enabled()  # dsv4_kernels/decode.py's
        if fast and not attn.wkv.fp8_emu:  # the key's norm and RoPE, its cache row and position: one kernel
            kv = attn.wkv(h) if "wkv" not in p else p["wkv"]
            window_kv_triton(kv[:, 0], attn.kv_norm.weight, cos[:, 0], sin[:, 0], c["win"], c["win_pos"], slots, pos,
                             attn.kv_norm.eps)
        else:
            c["win"][slots, pos % W] = attn.window_kv(h, cos, sin, p.get("wkv"))[:, 0]
            c["win_pos"][slots, pos % W] = pos
        S, visible = 0, None
        if attn.ratio:
            self._compressor_step(attn.compressor, h, c, "comp", slots, pos, fast, comp("compressor"), rope)
            n_vis = (pos + 1) // attn.ratio  # entries whose whole window is at or before pos
            # CUDA graphs and compiled code want fixed shapes: every cache entry, masked; eager reads up to the
            # longest sequence's
            static = self.static or torch.compiler.is_compiling()
            S = c["comp"].shape[1] if static else max(int(n_vis.max()), 1)
            visible = torch.arange(S, device=pos.device)[None] < n_vis[:, None]  # [B, S]
            if attn.indexer is not None:
                index = attn.indexer
                self._compressor_step(index.compressor, h, c, "idx", slots, pos, fast, comp("indexer.compressor"),
                                      rope)
                score = index.scores(h, qr, c["idx"][slots, :S], cos, sin, p.get("indexer.weights_proj"))[:, 0]
                score = score.masked_fill(~visible, float("-inf"))
                visible = visible & top_k_mask(score, attn.indexer.topk)
                if "index" in c:  # recorded for replay
                    c["index"][slots, pos] = mask_picks(visible, attn.indexer.topk)
        if fast:  # dsv4_kernels/decode_attention.py: keys read in place, the mask below worked out inside (but the
            # indexer's picks), the output's RoPE undone inside, as output() rounds
            o = decode_attention_triton(q[:, 0], c["win"], c["win_pos"], c.get("comp"), slots, pos, attn.ratio,
                                        attn.attn_sink, attn.softmax_scale, cos[:, 0], sin[:, 0],
                                        visible if attn.indexer is not None else None)[:, None]
            return attn.output(o, cos, sin, rotated=False)
        wpos = c["win_pos"][slots]  # [B, W]
        mask = ((wpos >= 0) & (wpos > pos[:, None] - W) & (wpos <= pos[:, None]))[:, None]  # [B, 1, W]
        mask = torch.cat([mask, visible[:, None]], dim=-1) if attn.ratio else mask
        keys = c["win"][slots]  # [B, W, d], then the compressed entries
        keys = torch.cat([keys, c["comp"][slots, :S]], dim=1) if S else keys
        return attn.output(sink_attention(q, keys, mask, attn.attn_sink, attn.softmax_scale), cos, sin)
