"""
Routing replay (R3) and indexer replay, the wire and micro-batch side. The rollout engine reports, for every position
of a sample, the experts each MoE layer routed the token to and the compressed entries each CSA layer's lightning
indexer picked; the trainer's forward takes those instead of its own picks, so it scores each token through the experts
and the context that produced it. The mechanism itself sits in two places: Gate.forward's `replay` (moe.py: EP dispatch
follows the replayed experts, weighted by the trainer's router scores at them, so the router still learns) and
Indexer.forward's (model_dsv4.py); Transformer.replay_kwargs hands each layer its slice.

SGLang 0.5.23's fields, which server.py answers and rollout.py asks for:
  return_routed_experts (server flag --enable-return-routed-experts), routed_experts_start_len (default 0, at most the
      prompt's length) -> meta_info.routed_experts: base64 of raw int32 [seqlen - 1 - start_len, num_hidden_layers,
      num_experts_per_tok]; hash layers included (their tid2eid rows), MTP layers not;
  return_indexer_topk (server flag --enable-return-indexer-topk) -> meta_info.indexer_topk: base64 of raw int32
      [seqlen - 1, CSA layers (compress ratio 4), index_topk], ascending here, -1 where fewer entries were visible.
Row p is the token at position p; seqlen = prompt + output, and the last output token is sampled but never fed. A
micro-batch's row for position p (make_microbatches) holds the same ids, and a pipeline stage keeps its own layers.
"""
import base64

import torch

FIELDS = {"routed_experts": "return_routed_experts", "indexer_topk": "return_indexer_topk"}  # meta_info <- request
FLAGS = {"routed_experts": "--enable-return-routed-experts", "indexer_topk": "--enable-return-indexer-topk"}


def fields(routing_replay, indexer_replay):
    """The meta_info fields a run replays (train_grpo's routing_replay / indexer_replay)."""
    return tuple(f for f, on in zip(FIELDS, (routing_replay, indexer_replay)) if on)


def csa_layers(args):
    """The trunk layers with an indexer, in order: indexer_topk's second axis."""
    return [i for i in range(args.num_hidden_layers) if args.compress_ratios[i] == 4]


def encode(t):
    """int tensor -> base64 of its raw int32 bytes (this machine's byte order, little-endian on every target)."""
    return base64.b64encode(t.to(torch.int32).contiguous().numpy().tobytes()).decode()


def decode(payload, rows):
    """base64 of raw int32 -> int32 [rows, -1]; ValueError unless it holds `rows` equal rows."""
    raw = base64.b64decode(payload, validate=True)
    n = len(raw) // 4
    if len(raw) % 4 or (n % rows if rows else n):
        raise ValueError(f"{len(raw)} bytes are not {rows} rows of int32")
    return torch.frombuffer(bytearray(raw), dtype=torch.int32).view(rows, n // rows if rows else 0)


def columns(a, layers, names):
    """What a pipeline stage holding `layers` (their ids: a stage's model.layers) of a model of ModelArgs `a` keeps of
    each replayed field: {name: (its layers' columns, a row's shape)}."""
    layers, csa = [int(i) for i in layers], csa_layers(a)
    spec = {"routed_experts": (layers, (a.num_hidden_layers, a.num_experts_per_tok)),
            "indexer_topk": ([csa.index(i) for i in layers if i in csa], (len(csa), a.index_topk))}
    return {n: spec[n] for n in names}


def sample_ids(sample, name, rows, shape, args):
    """A sample's decoded field (rollout.py: int32 [rows, -1]) as [rows, *shape], checked: rows = prompt + output - 1,
    experts in [0, n_routed_experts), indexer picks in [-1, entries visible at the position). ValueError naming the
    server otherwise: a server of another model, or a bad answer."""
    t = sample[name]
    where = f"{sample.get('url', 'the server')}: meta_info.{name}"
    if t.shape[0] != rows or t.numel() != rows * shape[0] * shape[1]:
        raise ValueError(f"{where} has {t.numel()} ids in {t.shape[0]} rows, the model wants [{rows}, {shape[0]}, "
                         f"{shape[1]}] (is it serving this model?)")
    t = t.view(rows, *shape)
    high = (torch.full((rows, 1, 1), args.n_routed_experts) if name == "routed_experts"
            else (torch.arange(rows) + 1)[:, None, None] // 4)  # compressed entries complete at each position
    if ((t < (0 if name == "routed_experts" else -1)) | (t >= high)).any():
        raise ValueError(f"{where} holds ids out of range (experts: [0, {args.n_routed_experts}); indexer: entries "
                         f"visible at the position, or -1)")
    return t


def asked(body, recorded, items, check):
    """A /generate body's replay fields (server.py) -> (the fields asked for, routed_experts_start_len), each checked
    with check(ok, message), the server's 400. recorded: the fields its engine keeps; items: the request's sequences,
    (prompt, engine.SamplingParams, ...)."""
    shortest_prompt, fewest_new = min(len(i[0]) for i in items), min(i[1].max_new_tokens for i in items)
    out = []
    for f, key in FIELDS.items():
        on = body.get(key)
        check(on is None or isinstance(on, bool), f"{key} must be true or false, got {on!r}")
        check(not on or f in recorded, f"{key}: this server does not record them (start it with {FLAGS[f]})")
        out += [f] if on else []
    start = body.get("routed_experts_start_len")
    start = 0 if start is None else start
    check(type(start) is int and 0 <= start <= shortest_prompt, f"routed_experts_start_len must be an int in [0, "
          f"prompt tokens = {shortest_prompt}], got {start!r}")
    check(not out or fewest_new > 0, f"{[FIELDS[f] for f in out]} need max_new_tokens >= 1 on the embedded server")
    return tuple(out), start


def meta_info(req, start):
    """A finished engine.Request's recorded ids (none for None) as SGLang's meta_info carries them: routed_experts from
    position start on."""
    recorded = getattr(req, "recorded", None) or {}
    return {f: encode(t[start if f == "routed_experts" else 0:]) for f, t in recorded.items()}
