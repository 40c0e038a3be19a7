"""Argmax over the vocabulary at decode shapes, torch against the vocabulary-parallel Triton kernels, in CUDA
graphs (where baton runs them); and the greedy DSpark Markov chain of a block (gamma slots, rank r), the eager
chain's ops (gather, rank-r linear, add, argmax per slot) against ``markov_greedy``'s 2 kernels a slot. Each figure
is the mean over 20 back-to-back replays of one graph (``benchmarks.ops.timing``).

    python -m benchmarks.ops.bench_argmax [--vocab 49152 157184] [--rows 1 4 9] [--gamma 8] [--rank 16] [--json F]

Floor: a row's fp32 logits (V x 4 bytes, + W2's V x r x 2 for a Markov slot) over 4.2 TB/s, well under a
microsecond; in practice two kernel launches of ~2 µs each in a graph.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from benchmarks.ops.timing import graph_time_us

H200_BANDWIDTH = 4.2e12


def _graph_us(calls) -> float:
    return graph_time_us(calls, stat="mean")


def bench_argmax(vocabs=(49152, 157184), rows=(1, 4, 9), gamma: int = 8, rank: int = 16) -> list[dict]:
    from baton.models.dspark import MarkovHead
    from baton.ops.argmax import triton as fast
    from baton.speculative.dspark import markov_propose
    from baton.types import SamplingParams

    assert torch.cuda.is_available(), "the argmax bench needs CUDA"
    dev = torch.device("cuda")
    out: list[dict] = []

    def record(**row) -> None:
        out.append(row)
        print(json.dumps(row), flush=True)

    for v in vocabs:
        for m in rows:
            x = torch.randn(m, v, device=dev)
            assert torch.equal(fast.argmax_rows(x), x.argmax(-1))
            floor = m * v * 4 / H200_BANDWIDTH * 1e6
            record(op="argmax", vocab=v, rows=m, torch_us=_graph_us([functools.partial(torch.argmax, x, -1)] * 8),
                   triton_us=_graph_us([functools.partial(fast.argmax_rows, x)] * 8), floor_us=round(floor, 3))
        head = MarkovHead(v, rank, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            head.w1.weight.normal_()
            head.w2.weight.normal_(0, 0.5)
        base = torch.randn(gamma, v, device=dev)
        anchor = torch.tensor([3], device=dev)
        greedy = SamplingParams(temperature=0.0)
        with torch.no_grad():
            eager = markov_propose(base, anchor, head, greedy, None).tokens
            fused = fast.markov_greedy(base, anchor, head.w1.weight, head.w2.weight)
            same = bool(torch.equal(eager, fused))

            eager_chain = functools.partial(markov_propose, base, anchor, head, greedy, None)
            fused_chain = functools.partial(fast.markov_greedy, base, anchor, head.w1.weight, head.w2.weight)
            floor = gamma * v * (4 + 2 * rank) / H200_BANDWIDTH * 1e6
            record(op="markov_chain", vocab=v, gamma=gamma, rank=rank, same_tokens=same,
                   eager_ops_us=_graph_us([eager_chain] * 2), triton_us=_graph_us([fused_chain] * 2),
                   floor_us=round(floor, 3))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[49152, 157184])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 9])
    ap.add_argument("--gamma", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    rows = bench_argmax(args.vocab, args.rows, args.gamma, args.rank)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
