"""The prefix cache: what a follow-up request can reuse of the states earlier requests left, keyed by token ids.

A radix tree over token ids. Each node covers the token span ``[start, end)`` below its parent and holds

- ``rows``: for every position-indexed cache buffer (the target's GQA K / V and MLA latent rows, the drafter's own
  cache rows) a copy of the rows of its span only, so a prefix shared by many requests (a system prompt, the
  earlier turns of a conversation) is stored once. A drafter row that depends on the *next* token (NEXTN: row i
  holds (h_i, token i+1)) is stored shifted by one (``shift``): the node keeps rows ``[start-1, end-1)``, which its
  own tokens determine.
- optionally a **snapshot** at ``end``: a copy of every recurrent state (the KDA recurrent and short-conv states of
  each layer) after exactly ``end`` tokens, and the target's last hidden state h_{end-1} (what a drafter needs to
  continue, and the first token when the whole prompt matches). A recurrent state cannot be rebuilt from rows, so a
  model with recurrent layers (or a drafter that needs h_{start-1}) restores only at a snapshot (``exact``); a
  model of attention layers only can restore at any matched length.

Snapshots are taken by the engine during the prefill at multiples of the stride and at the end of the prompt
(models with recurrent state only), and at the end of every request (prompt + generated tokens).

Memory: ``max_total_tokens`` bounds the rows held (in tokens, SGLang's ``--max-total-tokens``, the pool its radix
cache lives in) and ``max_snapshots`` the snapshots holding recurrent state (SGLang's ``--max-mamba-cache-size``,
its number of mamba state slots). Eviction is LRU over leaves (a node's descendants need its rows), so it removes
whole prefixes from the far end; a node on the path a running request restored from is locked.

Every decision depends only on token ids and the order of the requests, so tensor-parallel ranks (each with its
own shards in the buffers) keep identical trees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _lcp(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists (slice compares run in C; a binary search on mismatch)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _span(start: int, end: int, shift: int) -> tuple[int, int]:
    """The rows a node [start, end) stores of a buffer whose row i depends on tokens up to i + shift."""
    return max(start - shift, 0), max(end - shift, 0)


class _Node:
    __slots__ = ("parent", "key", "start", "children", "rows", "states", "hidden", "last_used", "locks")

    def __init__(self, parent: _Node | None, key: list[int], start: int) -> None:
        self.parent = parent
        self.key = key  # the tokens [start, end)
        self.start = start
        self.children: dict[int, _Node] = {}
        self.rows: list[torch.Tensor] = []
        self.states: list[torch.Tensor] | None = None  # the snapshot at ``end`` (None: rows only)
        self.hidden: torch.Tensor | None = None  # [1, d] h_{end-1}, with a snapshot
        self.last_used = 0
        self.locks = 0

    @property
    def end(self) -> int:
        return self.start + len(self.key)

    def row_tokens(self) -> int:
        return len(self.key)


@dataclass
class PrefixMatch:
    """Where a request can start: ``length`` tokens restorable (``node``'s path, plus ``partial`` rows of ``child``
    for a model without recurrent state); ``snapshot``: the node whose snapshot is restored (exact models)."""

    length: int
    node: _Node | None
    child: _Node | None = None
    partial: int = 0


class PrefixCache:
    """``rows``: (buffer, shift) pairs, buffer dim 0 = position; ``states``: tensors snapshotted whole.
    ``exact``: restore only at snapshots (recurrent state, or a drafter that needs the previous hidden state)."""

    def __init__(self, rows: list[tuple[torch.Tensor, int]], states: list[torch.Tensor], exact: bool,
                 max_total_tokens: int, max_snapshots: int, stride: int) -> None:
        self.buffers = rows
        self.state_buffers = states
        self.exact = exact
        self.max_total_tokens = max_total_tokens
        self.max_snapshots = max_snapshots
        self.stride = stride
        self.row_bytes_per_token = sum(b[0].nbytes for b, _ in rows)
        self.snapshot_bytes = sum(t.nbytes for t in states)
        self.root = _Node(None, [], 0)
        self._clock = 0
        self.reset_stats()
        self.clear()

    # ---- bookkeeping ----

    def clear(self) -> None:
        self.root = _Node(None, [], 0)
        self.total_tokens = 0
        self.num_snapshots = 0
        self.hidden_bytes = 0

    def reset_stats(self) -> None:
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.requests = 0
        self.hits = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    @property
    def nbytes(self) -> int:
        return self.total_tokens * self.row_bytes_per_token + self.num_snapshots * self.snapshot_bytes + \
            self.hidden_bytes

    def stats(self) -> dict:
        rate = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return {"prefix_cache_hit_rate": rate, "prefix_cache_cached_tokens": self.cached_tokens,
                "prefix_cache_prompt_tokens": self.prompt_tokens, "prefix_cache_requests": self.requests,
                "prefix_cache_hits": self.hits, "prefix_cache_tokens": self.total_tokens,
                "prefix_cache_snapshots": self.num_snapshots, "prefix_cache_bytes": self.nbytes,
                "prefix_cache_snapshot_bytes": self.snapshot_bytes,
                "prefix_cache_row_bytes_per_token": self.row_bytes_per_token}

    def record(self, prompt_tokens: int, cached: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached
        self.hits += cached > 0

    # ---- match and restore ----

    def match(self, tokens: list[int]) -> PrefixMatch:
        """The longest restorable prefix of ``tokens``."""
        node, pos, best = self.root, 0, None
        child, partial = None, 0
        while pos < len(tokens):
            nxt = node.children.get(tokens[pos])
            if nxt is None:
                break
            n = _lcp(nxt.key, tokens[pos:])
            if n < len(nxt.key):
                child, partial = nxt, n
                break
            node, pos = nxt, pos + n
            if node.states is not None and (node.hidden is not None or node.end < len(tokens)):
                best = node
        if self.exact:
            return PrefixMatch(best.end, best) if best is not None else PrefixMatch(0, None)
        return PrefixMatch(pos + partial, node, child, partial)

    def restore(self, m: PrefixMatch, length: int) -> None:
        """Copy the rows of ``m``'s path (the first ``length`` tokens) into the live buffers, in place, and (exact)
        the snapshot's states."""
        path = []
        node = m.node
        while node is not None and node is not self.root:
            path.append(node)
            node = node.parent
        segments = [(n, len(n.key)) for n in reversed(path)]
        if m.child is not None and length > (m.node.end if m.node else 0):
            segments.append((m.child, length - m.child.start))
        for n, used in segments:
            for (buf, shift), rows in zip(self.buffers, n.rows, strict=True):
                a, b = _span(n.start, n.start + used, shift)
                a0, _ = _span(n.start, n.end, shift)
                if b > a:
                    buf[a:b].copy_(rows[a - a0 : b - a0])
        if self.exact and m.node is not None:
            for buf, saved in zip(self.state_buffers, m.node.states, strict=True):
                buf.copy_(saved)
        tick = self._tick()
        for n, _ in segments:
            n.last_used = tick

    def lock(self, node: _Node | None, delta: int) -> None:
        while node is not None:
            node.locks += delta
            node = node.parent

    # ---- insert ----

    def insert(self, tokens: list[int], hidden: torch.Tensor | None, snapshot: bool = True,
               states: list[torch.Tensor] | None = None) -> _Node:
        """Record the live buffers' rows for ``tokens`` (the committed prefix, all of it in the live caches) and,
        with ``snapshot``, the states at its end (``states``, owned from now on, or copies of the live ones) and
        ``hidden`` (h_{L-1}); then evict to the budget."""
        node, pos, tick = self.root, 0, self._tick()
        length = len(tokens)
        while pos < length:
            node.last_used = tick
            nxt = node.children.get(tokens[pos])
            if nxt is None:
                node = self._new_child(node, tokens[pos:length], pos)
                pos = length
                break
            n = _lcp(nxt.key, tokens[pos:length])
            if n < len(nxt.key):
                nxt = self._split(nxt, n)
            node, pos = nxt, pos + n
        node.last_used = tick
        if snapshot and node is not self.root and node.states is None:
            node.states = states if states is not None else [t.clone() for t in self.state_buffers]
            node.hidden = None if hidden is None else hidden.detach().reshape(1, -1).clone()
            self.num_snapshots += 1
            self.hidden_bytes += 0 if node.hidden is None else node.hidden.nbytes
        self.lock(node, 1)
        try:
            self.evict(protect=node)
        finally:
            self.lock(node, -1)
        return node

    def _new_child(self, parent: _Node, key: list[int], start: int) -> _Node:
        child = _Node(parent, list(key), start)
        for buf, shift in self.buffers:
            a, b = _span(start, start + len(key), shift)
            child.rows.append(buf[a:b].clone())
        parent.children[key[0]] = child
        self.total_tokens += len(key)
        return child

    def _split(self, node: _Node, n: int) -> _Node:
        """Cut ``node`` after its first ``n`` tokens; returns the new upper part (no snapshot)."""
        upper = _Node(node.parent, node.key[:n], node.start)
        lower_rows = []
        for (_, shift), rows in zip(self.buffers, node.rows, strict=True):
            a0, _ = _span(node.start, node.end, shift)
            _, mid = _span(node.start, node.start + n, shift)
            upper.rows.append(rows[: mid - a0].clone())
            lower_rows.append(rows[mid - a0 :].clone())
        node.rows = lower_rows
        upper.parent.children[upper.key[0]] = upper
        upper.last_used, upper.locks = node.last_used, node.locks
        node.key, node.start, node.parent = node.key[n:], node.start + n, upper
        upper.children[node.key[0]] = node
        return upper

    # ---- eviction ----

    def _over(self) -> bool:
        return self.total_tokens > self.max_total_tokens or self.num_snapshots > self.max_snapshots

    def evict(self, protect: _Node | None = None) -> None:
        """Least recently used unlocked leaves first (whole prefixes from their far end), until both budgets hold.
        Over the snapshot budget with only locked leaves left (one long path), the least recently used snapshot
        other than ``protect``'s goes (its rows stay: they serve the nodes below)."""
        while self._over():
            leaves = [n for n in self._nodes() if not n.children and n.locks == 0]
            if not leaves:
                if self.num_snapshots > self.max_snapshots:
                    inner = [n for n in self._nodes() if n.states is not None and n is not protect]
                    if inner:
                        self._drop_snapshot(min(inner, key=lambda n: n.last_used))
                        continue
                return
            victim = min(leaves, key=lambda n: n.last_used)
            self._remove(victim)

    def _drop_snapshot(self, node: _Node) -> None:
        if node.states is not None:
            self.num_snapshots -= 1
            self.hidden_bytes -= 0 if node.hidden is None else node.hidden.nbytes
        node.states, node.hidden = None, None

    def _remove(self, node: _Node) -> None:
        self._drop_snapshot(node)
        self.total_tokens -= len(node.key)
        del node.parent.children[node.key[0]]
        node.rows = []

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())
