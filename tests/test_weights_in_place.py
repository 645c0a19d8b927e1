"""A weight update writes into the tensors the engine's decode reads, never rebinds them: the stacked experts the
grouped GEMM reads, the fused input projections, every parameter. A CUDA graph captured before the update replays on
fixed addresses, so an update that rebound a tensor would leave it decoding the old weights (SGLang's colocated RL
garbled text that way; vLLM's DeepSeek-V4 RL saw a mismatch KL of 0.19). On the CPU the addresses and the tokens are
checked; on a GPU the same test decodes through the captured graphs."""
import copy

import torch

from conftest import SMALL, randomize_
from engine import Engine, SamplingParams
from model_dsv4 import Transformer

CUDA = torch.cuda.is_available()


def addresses(model):
    """The data pointers of every tensor the decode reads: parameters, expert stacks, fused projections."""
    stacks = [t for layer in model.layers.values() for t in (layer.ffn.stacked or ())]
    fused = [layer.attn.fused for layer in model.layers.values() if layer.attn.fused is not None]
    return [t.data_ptr() for t in [*model.parameters(), *stacks, *fused]], len(stacks), len(fused)


def test_an_update_decodes_the_new_weights_in_the_old_tensors():
    dev, dtype = ("cuda", torch.bfloat16) if CUDA else ("cpu", torch.float32)
    old, new = (randomize_(Transformer(copy.deepcopy(SMALL), dtype=torch.float32), SMALL.n_routed_experts,
                           SMALL.num_experts_per_tok, seed=s).set_kernels(True).set_dtype(dtype).to(dev)
                for s in (1, 2))
    prompts = [[5, 9, 2, 7], list(range(20, 47))]
    params = [SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True, seed=s) for s in range(2)]
    served = copy.deepcopy(old)
    engine = Engine(served, max_batch=4, max_len=96)
    before = [r.output_ids for r in engine.generate(prompts, params)]  # on a GPU: the graphs are captured here
    ptrs, n_stacks, n_fused = addresses(served)
    assert n_stacks > 0 and n_fused > 0  # the decode reads stacks and fused projections (kernels on)
    graphs = dict(engine.graphs or {})
    engine.load_weights({k: v.clone() for k, v in new.state_dict().items()})
    assert addresses(served)[0] == ptrs  # written into, not rebound
    after = engine.generate(prompts, params)
    assert (engine.graphs or {}).keys() == graphs.keys() and all(engine.graphs[b] is g for b, g in graphs.items())
    fresh = Engine(copy.deepcopy(new), max_batch=4, max_len=96).generate(prompts, params)
    assert [r.output_ids for r in after] == [r.output_ids for r in fresh] != before  # the new weights' tokens
    for a, f in zip(after, fresh):
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, f.output_logprobs)) <= (1e-2 if CUDA else 1e-5)
