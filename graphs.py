"""
Training micro-batches replayed as CUDA graphs: each micro-batch's forward, loss and backward (train_grpo.py,
train_sft.py) and the no-grad logprob pass as one graph, so the host launches one graph where eager launched ~10k
kernels (an eager micro-batch of bench_2b left its H100 idle 65 % of the time). train_graphs='auto' turns it on where
it applies (`why_not`): one CUDA stage holding the whole model and all its experts. The CPU, pipeline and
expert-parallel layouts run the eager schedules of parallel.py, which stay the reference.

How, as Megatron-core's whole-iteration graphs but with the optimizer outside:
- fixed shapes: the trainers lay a step out in micro-batches of a token budget (grpo.plan_microbatches: rows of one
  length, sizes that `bucket` keeps as they are), so a run meets a few shapes; any other micro-batch is padded to a
  bucket, its rows and its length rounded up. Padding is inert: no mask and no loss weight, in rows of its own or past
  a row's last sample (attention is causal), so the loss, the metrics and the gradients are the micro-batch's own;
- the first micro-batch of a bucket runs eagerly on its padded inputs: that is its real work, and it warms up what
  runs lazily once (cuBLAS workspaces, Triton's first launches). The same call is then captured, which runs nothing;
  the bucket's later micro-batches are copied into the graph's inputs and replayed. The routed experts are stacked
  before the first capture (check_params), so the parameters keep the addresses the graphs read;
- gradients accumulate in place into tensors kept from one step to the next, which the graphs write: taken from the
  first backward (the experts' stacked gradients and their views included), zeroed and handed back to the
  parameters before each step (AdamW.step takes them away);
- compile='background' (compile_policy.Background): blocks turn compiled shape by shape while the run goes on; each
  time more are ready, the graphs are captured again, so they replay the compiled kernels;
- the optimizer's step and a weight load write into the parameters in place, where the graphs read them;
- all graphs share one memory pool: they run one at a time, and their outputs are copied out before the next one.
More than max_graphs buckets (a run whose lengths keep moving): the rest run eager, and the step's metrics count them.
"""
import torch

from parallel import add_metrics, forward_only, stage_loss

FILL = {"seg": -1, "routed_experts": -1, "indexer_topk": -1}  # padding: in no sample, no replayed pick; the rest 0


def bucket(n, per_octave):
    """n rounded up to the next of per_octave evenly spaced sizes between two powers of two: at most 1 / per_octave
    more (lengths take 8 an octave, rows 4), and a run meets a handful of shapes."""
    step = max(1, (1 << (n - 1).bit_length()) // (2 * per_octave))
    return -(-n // step) * step


def pad(mb, rows, length, out=None):
    """A micro-batch padded to rows x length, written into `out` (a graph's inputs) or new tensors: inert padding
    (FILL) in rows of its own and past the end of each row."""
    out = out or {k: v.new_empty(rows, length, *v.shape[2:]) for k, v in mb.items()}
    for k, v in mb.items():
        out[k].fill_(FILL.get(k, 0))
        out[k][:v.shape[0], :v.shape[1]].copy_(v)
    return out


def why_not(grid, model, mode):
    """None where train_graphs=mode replays micro-batches as graphs, else why it does not."""
    if mode == "off":
        return "train_graphs='off'"
    if grid.device.type != "cuda":
        return "no GPU: the CPU runs eager"
    if grid.pp_size > 1 or grid.ep_size > 1:  # 1F1B sends activations between forward and backward; EP's dispatch
        return "pipeline or expert parallel (their schedules run eager)"  # reads its split sizes on the host
    if model.invariant:
        return "invariant numerics (a Python dispatch mode per op)"
    ffn = next(iter(model.layers.values())).ffn
    if not ffn.fast or model.dtype != torch.bfloat16:  # the reference experts read their row counts on the host
        return "the routed experts' reference loop (grouped GEMM kernels off, or not bf16)"
    return None


class StepGraphs:
    """One model's micro-batch graphs, by bucket, and the counts of what ran how since the last `take_counts`."""

    def __init__(self, model, grid, max_graphs=16, log=print):
        self.model, self.grid, self.max_graphs, self.log = model, grid, max_graphs, log
        # compile='background' (compile_model's model.background) and how many shapes it had ready at the last check
        self.compiled, self.compiled_seen = getattr(model, "background", None), 0
        self.graphs = {}  # key -> (graph, static inputs, static outputs)
        self.grads = None  # [(leaf, its gradient)]: what every backward accumulates into, kept across steps
        self.pool, self.where = None, None  # the graphs' memory pool; the parameters' addresses they read
        self.failed = None  # why capturing stopped (every later micro-batch runs eager)
        self.counts = dict(graph_replayed=0, graph_captured=0, graph_eager=0)

    def train(self, model, grid, microbatches, loss_fn, recompute=False):
        """parallel.one_f_one_b's work on one stage (parallel.train_step's `schedule`): each micro-batch's forward,
        loss and backward, then its metrics, read from the device once all are issued."""
        self.check_params()
        if self.grads is not None:
            torch._foreach_zero_([g for _, g in self.grads])
            for leaf, g in self.grads:
                leaf.grad = g
        outs = [self.run(mb, loss_fn, recompute, True) for mb in microbatches]
        metrics = {}
        for loss, extra, routing in outs:
            add_metrics(metrics, loss, extra, routing)
        return metrics

    def forward_only(self, model, grid, microbatches, fn):
        """parallel.forward_only on one stage, for a fn that returns a [B, T] tensor (grpo.token_logprobs)."""
        self.check_params()
        return [self.run(mb, fn, False, False) for mb in microbatches]

    def check_params(self):
        """The graphs read the parameters where they were at capture: a load that assigned new tensors (not copied
        into them, as AdamW.step and weight loads in place do) drops every graph, and the next micro-batches capture
        again. The routed experts are stacked first (Transformer.stack_experts, which every forward would do): their
        parameters become views of the stacks once, here, not inside the first captured step."""
        self.model.stack_experts()
        where = [p.data_ptr() for p in self.model.parameters()]
        if self.where is not None and where != self.where and self.graphs:
            self.log(f"train graphs: the parameters moved, capturing {len(self.graphs)} graphs again")
            self.graphs, self.grads, self.pool = {}, None, None
        self.where = where
        ready = self.compiled.version if self.compiled is not None else 0
        if ready != self.compiled_seen and self.graphs:  # blocks compiled since: graphs that run them, not eager
            self.log(f"train graphs: compiled blocks ready at {ready - self.compiled_seen} more shapes, capturing "
                     f"{len(self.graphs)} graphs again")
            self.graphs, self.pool = {}, None
        self.compiled_seen = ready

    def take_counts(self):
        """Micro-batches replayed, captured (their eager first run) and run eager since the last call."""
        out, self.counts = self.counts, dict.fromkeys(self.counts, 0)
        return out

    def call(self, mb, fn, recompute, grad):
        """The eager work that a graph captures: forward, loss and backward -> (loss, {metric: tensor}, routing), or
        the no-grad pass -> fn's [B, T]."""
        if not grad:
            return forward_only(self.model, self.grid, [mb], fn)[0]
        loss, extra, routing = stage_loss(self.model, None, mb, fn, recompute)
        loss.backward()
        return loss.detach(), extra, routing

    def run(self, mb, fn, recompute, grad):
        B, T = mb["input_ids"].shape
        key = (bucket(B, 4), bucket(T, 8), tuple(sorted(mb)), fn, recompute, grad)
        entry = self.graphs.get(key)
        if entry is None and (self.failed or len(self.graphs) >= self.max_graphs):
            self.counts["graph_eager"] += 1
            return self.call(mb, fn, recompute, grad)
        static = pad(mb, key[0], key[1], entry[1] if entry else None)
        if entry is None:
            out = self.capture(key, static, fn, recompute, grad)
        else:
            entry[0].replay()
            self.counts["graph_replayed"] += 1
            out = entry[2]
        if not grad:
            return out[:B, :T].clone()
        loss, extra, routing = out  # copies: the graph's next replay writes them again
        return loss.clone(), {k: v.clone() for k, v in extra.items()}, routing.clone() if routing is not None else None

    def capture(self, key, static, fn, recompute, grad):
        """The bucket's first micro-batch run eagerly (on a side stream, as capture wants its warm-up), then the
        same call captured. -> the eager run's outputs."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = self.call(static, fn, recompute, grad)
        torch.cuda.current_stream().wait_stream(side)
        self.counts["graph_captured"] += 1
        if grad and self.grads is None:  # the gradients this backward made: every later one adds into them
            stacks = [s for layer in self.model.layers.values() for s in (layer.ffn.stacked or ())]
            self.grads = [(t, t.grad) for t in (*self.model.parameters(), *stacks) if t.grad is not None]
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            # thread-local: compile_policy.Background's thread may work on the GPU (on its own stream) meanwhile
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                static_out = self.call(static, fn, recompute, grad)
        except RuntimeError as e:  # something in the step reads the device on the host: eager from here on
            self.failed = f"{type(e).__name__}: {str(e)[:300]}"
            self.log(f"train graphs: capturing ({key[0]} rows x {key[1]}) failed, eager from here: {self.failed}")
            return out
        self.graphs[key] = (graph, static, static_out)
        self.log(f"train graphs: {'forward + backward' if grad else 'forward'} of {key[0]} rows x {key[1]} tokens "
                 f"captured ({len(self.graphs)} graphs)")
        return out
