"""Adaptive draft depth, per request: speculate only as deep as pays.

A step at depth d verifies the anchor and d drafts and commits 1 + (accepted drafts) tokens; it costs t(d). With
p_i the probability that draft i is accepted given drafts 1..i-1 were, a step at depth d commits on average
``E(d) = 1 + sum_{i<=d} prod_{j<=i} p_j`` tokens, so the policy picks the depth with the most tokens per second,
``E(d) / t(d)`` (d = 0: plain decoding, whose E is 1). The p_i are exponential moving averages of what the verify
reports: a step at depth d that accepted a drafts saw drafts 1..a accepted and, if a < d, draft a+1 rejected;
deeper positions are not seen. Each request starts from the engine's running estimate (what earlier requests
saw), so a second request of the same kind starts at the right depth.

A depth below the maximum leaves the deeper positions unobserved, and depth 0 observes nothing, so every
``probe_interval`` steps below the maximum the policy runs one step at the full depth (its observation weighs more
than a regular step's, ``probe_decay``); a probe that does not bring a deeper choice doubles the interval (up to
``max_probe_interval``), one that does resets it. A request that turns predictable therefore gets its speculation
back within a few probes. A request starts at half the interval the last one reached (at least
the base interval): after requests where speculation did not pay, a probe (a full-depth step, about twice a plain
one on a GPU) comes rarely, yet sooner in each request than the last back-off would have it.

What a probe costs depends on the device, so the intervals follow the step times: a probe that finds nothing costs
``t(max) / t(0) - 1`` plain steps, and the base interval is at least that over ``probe_budget`` (the share of the
decode time failed probes may take; 3%: about 33 steps on an H100, where a full-depth DSpark step is 2x a plain
one, ~140 on a 2-core CPU, where a 3-step NEXTN one is 5x), the longest at least 4x the base. Where even a perfect
draft cannot pay (every depth's ``(d + 1) / t(d)`` within ``min_gain`` of plain decoding's ``1 / t(0)``: the CPU
with NEXTN, whose best is 5% at 100% acceptance), the policy never probes and decodes plainly.

The step times t(d) come from ``StepProgram.time_depths`` at start-up (under tensor parallelism rank 0's, so
every rank decides alike) and, when ``online_times`` is on (one process), an exponential moving average of the
host's measured step time at each depth. The policy sees only what the host reads anyway, one step late (the
committed tokens), so it adds no device synchronisation; the depth it picks is one of the program's captured
variants. Greedy output does not depend on the depth (each verify is exact); sampled output keeps the target's
distribution at any depth (the rejection rule is exact for any number of drafts).
"""

from __future__ import annotations

from collections.abc import Sequence


def default_depths(max_depth: int) -> tuple[int, ...]:
    """The depths an adaptive program captures: 0, the powers of two below ``max_depth``, and ``max_depth``."""
    out = {0, max_depth}
    d = 1
    while d < max_depth:
        out.add(d)
        d *= 2
    return tuple(sorted(out))


class FixedDepth:
    """Always the full depth (``--speculative-adaptive off``, simulated acceptance)."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth

    def begin_request(self) -> None:
        pass

    def choose(self) -> int:
        return self.max_depth

    def observe(self, depth: int, accepted: int) -> None:
        pass

    def observe_time(self, depth: int, step_ms: float) -> None:
        pass


class AdaptiveDepth:
    """The adaptive policy (module docstring). ``depths``: the program's depth variants, including 0 and the
    maximum; ``step_ms``: t(d) for each. ``prior``: the acceptance estimate before anything was seen."""

    def __init__(self, depths: Sequence[int], step_ms: dict[int, float], *, prior: float = 0.6,
                 decay: float = 0.15, probe_decay: float = 0.5, time_decay: float = 0.1, probe_interval: int = 8,
                 max_probe_interval: int = 64, online_times: bool = False, probe_budget: float | None = 0.03,
                 min_gain: float = 0.05) -> None:
        """``probe_interval`` / ``max_probe_interval``: the shortest base and longest interval between probes,
        raised to the step times' cost (module docstring) unless ``probe_budget`` is None; ``min_gain``: the
        speed-up at full acceptance below which speculation is not tried at all."""
        self.depths = tuple(sorted(depths))
        self.max_depth = self.depths[-1]
        missing = [d for d in self.depths if d not in step_ms]
        if missing or any(step_ms[d] <= 0 for d in self.depths):
            raise ValueError(f"step times needed (> 0) for every depth {self.depths}: got {step_ms}")
        self.step_ms = {d: float(step_ms[d]) for d in self.depths}
        self.decay, self.probe_decay, self.time_decay = decay, probe_decay, time_decay
        self.min_interval, self.min_max_interval = probe_interval, max_probe_interval
        self.probe_budget, self.min_gain = probe_budget, min_gain
        self.online_times = online_times
        self.interval = probe_interval
        self._plan_probes()  # raises it to the base interval
        self.shared = [prior] * self.max_depth  # p_1..p_k across requests (the next request's start)
        self.p = list(self.shared)
        self.since_full = 0  # steps chosen below the full depth since the last full-depth one
        self.choice = self.max_depth

    def _plan_probes(self) -> None:
        """The probe intervals and whether to probe at all, from the current step times."""
        t0 = self.step_ms[0] if 0 in self.step_ms else None
        base, longest = self.min_interval, self.min_max_interval
        self.probing = True
        if t0 is not None:
            potential = max((d + 1) / self.step_ms[d] for d in self.depths if d > 0) * t0 if self.max_depth else 0
            self.probing = potential >= 1 + self.min_gain
            if self.probe_budget:
                lost = max(0.0, self.step_ms[self.max_depth] / t0 - 1)
                base = max(base, -(-lost // self.probe_budget))
                longest = max(longest, 4 * base)
        self.base_interval, self.max_interval = int(base), int(longest)
        self.interval = min(max(self.interval, self.base_interval), self.max_interval)

    def begin_request(self) -> None:
        if self.online_times:
            self._plan_probes()
        self.p = list(self.shared)
        self.interval = max(self.base_interval, self.interval // 2)
        self.since_full = 0
        self.choice = self.best()

    def expected_tokens(self, depth: int) -> float:
        total, run = 1.0, 1.0
        for i in range(depth):
            run *= self.p[i]
            total += run
        return total

    def best(self) -> int:
        """The depth with the most expected tokens per millisecond (ties: the shallower)."""
        return max(self.depths, key=lambda d: (self.expected_tokens(d) / self.step_ms[d], -d))

    def choose(self) -> int:
        """The depth of the next step."""
        if self.choice == self.max_depth:
            return self.choice
        if self.since_full >= self.interval and self.probing:  # a probe
            self.since_full = 0
            return self.max_depth
        self.since_full += 1
        return self.choice

    def observe_time(self, depth: int, step_ms: float) -> None:
        """A step at ``depth`` took ``step_ms`` (host-measured); used only with ``online_times``."""
        if self.online_times and step_ms > 0:
            self.step_ms[depth] += self.time_decay * (step_ms - self.step_ms[depth])

    def observe(self, depth: int, accepted: int) -> None:
        """A step at ``depth`` accepted ``accepted`` drafts. A probe (a full-depth step while the choice is
        shallower) is the only news about the deeper positions, so it weighs more (``probe_decay``)."""
        probe = depth == self.max_depth and self.choice < self.max_depth
        rate = self.probe_decay if probe else self.decay
        seen = min(accepted + 1, depth)
        for i in range(seen):
            hit = 1.0 if i < accepted else 0.0
            self.p[i] += rate * (hit - self.p[i])
            self.shared[i] += self.decay * (hit - self.shared[i])
        before = self.choice
        self.choice = self.best()
        if probe:  # back off unless it paid
            self.interval = self.base_interval if self.choice > before else min(2 * self.interval, self.max_interval)


class ScheduledDepth:
    """Depths from a fixed cycle (tests: depth changes in the middle of a request, on every drafter)."""

    def __init__(self, schedule: Sequence[int]) -> None:
        self.schedule = list(schedule)
        self.i = 0

    def begin_request(self) -> None:
        self.i = 0

    def choose(self) -> int:
        d = self.schedule[self.i % len(self.schedule)]
        self.i += 1
        return d

    def observe(self, depth: int, accepted: int) -> None:
        pass

    def observe_time(self, depth: int, step_ms: float) -> None:
        pass


def replay(policy, accepted: Sequence[int], tokens: int, step_ms: dict[int, float]) -> tuple[int, float]:
    """Decode a recorded request again under ``policy`` (benchmarks/bench_adaptive_policy.py; tests): the record is a
    full-depth run's accepted count of each step (``accepted``) and its output length (``tokens``, the prefill's
    first token included). At position n (tokens after the first) a step at depth d accepts min(a(n), d), where
    a(n) is what the recorded step starting at n accepted, or, inside a recorded step's accepted run, the rest of
    that run; past the record's steps, nothing. As in the engine, the policy picks each step's depth before it
    sees the previous step's outcome (one step late). Returns (steps, milliseconds at ``step_ms``)."""
    run: list[int] = []
    for a in accepted:
        run.extend(range(a, -1, -1))  # a(s + j) = a - j for j = 0..a; the next step starts at s + a + 1
    total = tokens - 1
    policy.begin_request()
    steps, ms, n = 0, 0.0, 0
    depth = policy.choose()
    while n < total:
        acc = min(run[n] if n < len(run) else 0, depth)
        n += acc + 1
        steps += 1
        ms += step_ms[depth]
        nxt = policy.choose() if n < total else None
        policy.observe(depth, acc)
        depth = nxt
    return steps, ms

