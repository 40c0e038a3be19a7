"""The GPU-resident relay between the graphs of one decode step, and the one-step-late host read.

Everything that crosses from one graph to the next (the anchor token, the committed length ``pos``, the
accepted count, the draft's seed token and hidden state, the verify hidden states) lives in static device
tensors that the graphs read and write in place, so the host can enqueue step k+1 without knowing what
step k accepted. What the host must see (the committed tokens of each step, to detokenize and to check
EOS, stop strings and max tokens) goes to a small device ring; after enqueueing a step the host copies its
ring slot into pinned memory on a side stream and reads it one step later.
"""

from __future__ import annotations

import torch

RING = 4  # ring slots; the host lags one step, so 3 would do
HISTORY = 32  # rows of the deferred-extend history ring (engine/step.py): the most depth-0 steps between extends


class Relay:
    def __init__(self, max_tokens_per_step: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 feature_dim: int = 0, history: tuple[str, ...] = ()) -> None:
        """``history``: the drafter's deferred inputs (``Drafter.deferred_inputs``), kept per position in a ring of
        HISTORY rows (slot = position mod HISTORY) by depth-0 steps, for the catch-up extend that follows them."""
        t = max_tokens_per_step
        kw = dict(device=device, dtype=torch.long)
        self.pos = torch.zeros(1, **kw)  # committed tokens = position of the anchor
        self.anchor = torch.zeros(1, **kw)
        self.step = torch.zeros(1, **kw)  # device step counter: selects the ring slot
        self.extend_pos = torch.zeros(1, **kw)  # the anchor position the last verify started from
        self.num_accepted = torch.zeros(1, **kw)
        self.accepted_tokens = torch.zeros(t, **kw)  # drafts[:a] then the bonus at index a
        self.draft_tokens = torch.zeros(max(t - 1, 1), **kw)
        # how many of the k drafts the verify may accept: k, unless the drafter schedules a shorter prefix (DSpark's
        # confidence rule); rows past it are verified (fixed shapes) and never committed
        self.num_drafts = torch.full((1,), max(t - 1, 0), **kw)
        self.max_drafts = max(t - 1, 0)
        self.first_draft = torch.zeros(1, **kw)  # the next round's first draft (from extend)
        self.draft_hidden = torch.zeros(1, hidden_size, dtype=dtype, device=device)
        self.verify_hidden = torch.zeros(t, hidden_size, dtype=dtype, device=device)
        # Tapped target features of the verify rows, in the drafter's order (DSpark / DFlash).
        self.verify_features = torch.zeros(t, feature_dim, dtype=dtype, device=device) if feature_dim else None
        # The deferred-extend history: what a depth-0 (plain decode) step leaves for the drafter's later catch-up,
        # and how many positions the catch-up covers (the newest ones, up to pos - 1; set by the host, no sync).
        h = HISTORY
        self.hist_hidden = torch.zeros(h, hidden_size, dtype=dtype, device=device) if "hidden" in history else None
        self.hist_next = torch.zeros(h, **kw) if "next" in history else None
        self.hist_features = (torch.zeros(h, feature_dim, dtype=dtype, device=device)
                              if "features" in history else None)
        self.catchup_count = torch.ones(1, **kw)
        # A sampled request's settings (logits_to_probs_t), set by ``set_sampling`` before its first step.
        self.temperature = torch.ones(1, dtype=torch.float32, device=device)
        self.top_p = torch.ones(1, dtype=torch.float32, device=device)
        self.min_p = torch.zeros(1, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(1, **kw)
        self.ring_tokens = torch.zeros(RING, t, **kw)  # [slot, token]
        self.ring_count = torch.zeros(RING, **kw)  # tokens committed by the step in that slot
        self.on_cuda = device.type == "cuda"  # on the CPU copies are synchronous
        # uncaptured on the CPU, the host reads pos for free and forwards attend only to the filled cache rows
        self.slice_cache = False
        self.host_tokens = torch.zeros(RING, t, dtype=torch.long, pin_memory=self.on_cuda)
        self.host_count = torch.zeros(RING, dtype=torch.long, pin_memory=self.on_cuda)
        if self.on_cuda:
            self.copy_stream = torch.cuda.Stream(device=device)
            self.step_done = [torch.cuda.Event() for _ in range(RING)]
            self.copy_done = [torch.cuda.Event() for _ in range(RING)]

    def reset(self, anchor: torch.Tensor, pos: int) -> None:
        """Start a request: the anchor sampled by prefill, at position ``pos``."""
        self.anchor.copy_(anchor.reshape(1))
        self.pos.fill_(pos)
        self.step.zero_()
        self.num_drafts.fill_(self.max_drafts)

    def set_sampling(self, temperature: float, top_k: int, top_p: float, min_p: float) -> None:
        """A sampled request's settings into the static tensors its graphs read (copies, no sync)."""
        self.temperature.fill_(temperature)
        self.top_k.fill_(top_k)  # <= 0: off
        self.top_p.fill_(top_p)
        self.min_p.fill_(min_p)

    def kv_len(self, num_rows: int) -> int | None:
        """Cache rows any forward of this step may read: pos + ``num_rows`` bounds them (pos only grows within a
        step and extend starts below it), or None (captured, or on CUDA): the whole cache, with a position mask."""
        return int(self.pos) + num_rows if self.slice_cache else None

    # ---- inside graphs ----

    def publish(self, tokens: torch.Tensor, count: torch.Tensor) -> None:
        """Write this step's committed tokens (padded to the ring width) and count; advance the step."""
        slot = torch.remainder(self.step, RING)
        padded = torch.zeros_like(self.ring_tokens[0])
        padded[: tokens.shape[0]] = tokens
        self.ring_tokens.index_copy_(0, slot, padded[None])
        self.ring_count.index_copy_(0, slot, count.reshape(1))
        self.step.add_(1)

    # ---- host side ----

    def enqueue_copy(self, host_step: int) -> None:
        """After enqueueing step ``host_step``: copy its ring slot to pinned memory on the side stream."""
        slot = host_step % RING
        if not self.on_cuda:
            self.host_tokens[slot].copy_(self.ring_tokens[slot])
            self.host_count[slot].copy_(self.ring_count[slot])
            return
        main = torch.cuda.current_stream()
        self.step_done[slot].record(main)
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.step_done[slot])
            self.host_tokens[slot].copy_(self.ring_tokens[slot], non_blocking=True)
            self.host_count[slot].copy_(self.ring_count[slot], non_blocking=True)
            self.copy_done[slot].record(self.copy_stream)

    def read(self, host_step: int) -> list[int]:
        """The tokens committed by step ``host_step`` (waits only for that step's copy)."""
        slot = host_step % RING
        if self.on_cuda:
            self.copy_done[slot].synchronize()
        n = int(self.host_count[slot])
        return self.host_tokens[slot, :n].tolist()
