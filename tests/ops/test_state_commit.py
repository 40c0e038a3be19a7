"""The batched commit of staged KDA states (baton.ops.state_commit) equals the per-layer copies, on the CPU
reference and, with a GPU, in the Triton kernel (also inside a CUDA graph, for indices chosen after capture)."""

import pytest
import torch

from baton.cache.model_cache import ModelCache
from baton.cache.state import KDAState
from baton.ops.state_commit import StagedCommit, commit_reference


def _states(device, n=3, stage=5):
    torch.manual_seed(0)
    out = {}
    for i in range(n):
        s = KDAState(2 + i, 8, 8, 24, 4, stage, torch.bfloat16, device)
        s.staged_recurrent.copy_(torch.randn_like(s.staged_recurrent))
        s.staged_conv.copy_(torch.randn_like(s.staged_conv, dtype=torch.float32).to(torch.bfloat16))
        out[i] = s
    return out


def _expected(states, index):
    return {i: (s.staged_recurrent[index].clone(), s.staged_conv[index].clone()) for i, s in states.items()}


def test_model_cache_commit_copies_every_layers_staged_position():
    states = _states("cpu")
    cache = ModelCache(dict(states), max_len=8)
    for index in (3, 0, 4):
        want = _expected(states, index)
        cache.commit(torch.tensor(index))
        for i, s in states.items():
            assert torch.equal(s.recurrent, want[i][0]) and torch.equal(s.conv, want[i][1])


def test_reference_equals_the_single_layer_commit():
    a, b = _states("cpu"), _states("cpu")
    index = torch.tensor([2])
    commit_reference([(s.staged_recurrent, s.recurrent) for s in a.values()]
                     + [(s.staged_conv, s.conv) for s in a.values()], index)
    for s in b.values():
        s.commit(index)
    for i in a:
        assert torch.equal(a[i].recurrent, b[i].recurrent) and torch.equal(a[i].conv, b[i].conv)


def test_mismatched_pair_is_refused():
    s = KDAState(2, 8, 8, 24, 4, 3, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="does not stage"):
        StagedCommit([(s.staged_conv, s.recurrent)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_commit_equals_reference_and_replays_in_a_graph():
    states = _states("cuda", n=4)
    cache = ModelCache(dict(states), max_len=8)
    assert cache._commit._kernel is not None  # the Triton path is the one under test
    index = torch.zeros((), dtype=torch.int64, device="cuda")
    cache.commit(index)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cache.commit(index)
    for value in (4, 1, 3):
        for s in states.values():
            s.recurrent.zero_()
            s.conv.zero_()
        index.fill_(value)
        want = _expected(states, value)
        graph.replay()
        torch.cuda.synchronize()
        for i, s in states.items():
            assert torch.equal(s.recurrent, want[i][0]) and torch.equal(s.conv, want[i][1])
