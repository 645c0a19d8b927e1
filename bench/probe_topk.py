# A pytest plugin for session 19's look at test_engine_cuda_graphs_equal_eager_and_forward on the GPU (one logprob
# 0.128 apart): TOPK=n sets the tiny test model's index_topk before the tests run; n above its compressed entries
# (40 at max_len 160, ratio 4) takes the indexer's pick, and with it its near-ties, out of the comparison.
# python -m pytest -p probe_topk (with bench/ on PYTHONPATH)
import os


def pytest_collection_modifyitems(session, config, items):
    import conftest
    if os.environ.get("TOPK"):
        conftest.TINY.index_topk = int(os.environ["TOPK"])
