"""A trainer under a parallel layout that syncs its weights to running servers, every transport, and saves what
each rank sent. Launched by tests/test_weight_sync.py on 4 gloo ranks:
    torchrun --standalone --nproc_per_node=4 tests/helpers/sync_run.py OUT_DIR PP EP URL[,URL...]"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import parallel  # noqa: E402
import weight_sync as wsync  # noqa: E402
from model_dsv4 import ModelArgs  # noqa: E402
from parallel_run import ARGS  # noqa: E402
from rollout import RolloutClient  # noqa: E402

if __name__ == "__main__":
    out, pp, ep, urls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    grid = parallel.init_distributed(pp_size=pp, ep_size=ep, timeout_s=60)
    model = parallel.build_stage(ModelArgs(**ARGS), grid, dtype=torch.float32, seed=7)
    client = RolloutClient(urls)
    sent = {}
    for mode in ("disk", "tensor", "distributed"):  # distributed last: its weights are the ones the test reads
        stats = wsync.sync(model, grid, client, model.args, os.path.join(out, "weights"), mode=mode,
                           version=f"{mode}-7", bucket_mb=0.25, verify=True, timeout=60)
        sent[mode] = stats["names"]
        assert stats["max_bucket_bytes"] <= 1 << 18, stats["max_bucket_bytes"]
    with open(os.path.join(out, f"sent.rank{grid.rank}.json"), "w") as f:
        json.dump(sent, f)
    print(f"rank {grid.rank} done", flush=True)
    # Every group down (the weight-update groups with the servers, then the ranks'), and no interpreter teardown: a
    # sender's rank still aborted there once after every rank was done ("terminate called without an active
    # exception": gloo's threads and the group's TCPStore outliving the interpreter). What the test reads is written.
    wsync.teardown(grid, client, urls.split(","))
    parallel.barrier(grid.world_group, "sync_run done")
    torch.distributed.destroy_process_group()
    os._exit(0)
