"""The engine: owns the target model, its caches, the drafter, the step program and the tokenizer, and runs one
request at a time: an eager prefill, then the step program (engine/step.py) repeats {draft, verify, accept,
commit, extend} over device-resident values while the host reads each step's tokens one step late and emits
them. There is one program: captured as CUDA graphs on CUDA, the same bodies uncaptured on the CPU and with
--disable-cuda-graph.

Under tensor parallelism (baton/engine/tp.py) every rank builds its own Engine on its own GPU and runs the same
loop on the same requests; greedy choices come from ``model.greedy_tokens`` (an argmax across vocabulary
shards without gathering the logits), everything else from the gathered logits, so all ranks agree (a DSpark /
DFlash draft is replicated on every rank; baton/speculative/dspark.py says how its prefix decision is shared).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import time
from collections.abc import Callable, Iterator

import torch

from baton import dist, env
from baton.config import ConfigError, LingConfig, ServerArgs
from baton.engine.api import RequestTrace, run_warm_up
from baton.engine.load import load_target
from baton.engine.output import OutputTracker
from baton.layers.context import ModelRunner
from baton.models.checkpoint import parse_dtype
from baton.ops.sampling import logits_to_probs, sample_from_probs
from baton.speculative.adaptive import AdaptiveDepth, FixedDepth, default_depths
from baton.speculative.base import Drafter
from baton.types import ForwardMode, Request, SamplingParams, SpecStats, StepOutput

log = logging.getLogger(__name__)


def pick_device(name: str | None) -> torch.device:
    """The device asked for (default: cuda when available); a tensor-parallel rank takes its own GPU."""
    device = torch.device(name) if name else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and dist.tp_size() > 1:
        return dist.state().device if dist.state().device.type == "cuda" else torch.device("cuda", dist.tp_rank())
    return device


class Engine:
    def __init__(self, args: ServerArgs) -> None:
        self.server_args = args
        self.device = pick_device(args.device)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # Triton kernels, streams and graphs use the current device
        self.dtype = parse_dtype(args.dtype, self.device)
        loaded = load_target(args, self.device, self.dtype)
        dist.barrier()  # tensor parallel: every rank has its weights before any collective
        self.model, self.model_config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        self.model_path, self.tokenizer_path = loaded.model_path, loaded.tokenizer_path
        self.served_model_name = args.served_model_name or self.model_path
        self._apply_precision(args)
        self.context_length = self._context_length()
        spec = args.spec
        if spec.algorithm in ("DSPARK", "DFLASH"):
            from baton.speculative.dspark import resolve_dspark_spec

            resolve_dspark_spec(spec)  # num_draft_tokens = checkpoint block size + 1 when unset
        self.num_draft_tokens = spec.num_draft_tokens if spec.enabled else 1
        # Margin: the graph loop reads one step late, so one extra step may run past the last token.
        max_len = self.context_length + 2 * self.num_draft_tokens + 1
        cache = self.model.make_cache(max_len, self.dtype, self.device, max_stage=self.num_draft_tokens)
        self.runner = ModelRunner(cache, self.device)
        self.drafter: Drafter | None = None
        if spec.enabled:
            from baton.speculative.factory import build_drafter

            self.drafter = build_drafter(self, spec)
            if args.enable_fp8_draft_lm_head:
                self.model.use_fp8_draft_lm_head()
            if spec.token_map:
                from baton.speculative.token_map import load_token_map

                self.model.use_draft_token_map(load_token_map(spec.token_map))
                if getattr(self.drafter, "use_heads", False):
                    log.info("--speculative-token-map: DSpark's Markov chain drafts over the whole vocabulary; the "
                             "map applies to NEXTN and DFlash drafts")
        self.spec_stats = SpecStats()
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | _config_eos(self.model_config)
        self._sim_generator = torch.Generator().manual_seed(args.seed)
        self._observers: list[Callable[[RequestTrace], None]] = []
        self.program = self._make_program()
        self.prefill_graphs = self._make_prefill_graphs()
        self.depth_policy = self._make_policy()
        self.prefix_cache = self._make_prefix_cache()
        self.last_cached_tokens = 0  # the last request's prompt tokens restored from the prefix cache

    def _make_prefix_cache(self):
        """The prefix cache over this engine's live buffers (None: --disable-radix-cache, or a drafter without
        the hooks). Budgets: --max-total-tokens rows, --max-mamba-cache-size snapshots (device defaults)."""
        from baton.cache.prefix import PrefixCache

        args = self.server_args
        if args.disable_radix_cache or (self.drafter is not None and not self.drafter.supports_prefix_cache):
            return None
        cache = self.runner.cache
        rows = [(t, 0) for t in cache.row_buffers()]
        states = cache.state_buffers()
        exact = bool(states)
        if self.drafter is not None:
            rows += self.drafter.prefix_buffers()
            exact = exact or self.drafter.needs_prev_hidden
        cuda = self.device.type == "cuda"
        max_tokens = args.max_total_tokens if args.max_total_tokens is not None else (65536 if cuda else 32768)
        max_snaps = args.max_mamba_cache_size if args.max_mamba_cache_size is not None else (16 if cuda else 64)
        if args.prefix_snapshot_stride < 0:
            raise ConfigError("--prefix-snapshot-stride must be >= 0")
        return PrefixCache(rows, states, exact, max_tokens, max_snaps, args.prefix_snapshot_stride)

    def _make_program(self):
        """The one decode program: captured as CUDA graphs on CUDA, run uncaptured on the CPU and with
        --disable-cuda-graph."""
        from baton.engine.step import StepProgram

        sim_table = None  # --speculative-simulate-accept-len: accepted counts, cycled by the step counter
        if self.drafter is not None and self.server_args.spec.simulate_accept_len is not None:
            sim_table = self.simulated_accept_table(self.num_draft_tokens - 1)
        depths = default_depths(self.num_draft_tokens - 1) if self._adaptive() else None
        capture = self.device.type == "cuda" and not self.server_args.disable_cuda_graph
        return StepProgram(self.model, self.runner.cache, self.drafter, self.num_draft_tokens, self.dtype,
                           self.device, depths=depths, sim_table=sim_table, capture=capture)

    def _make_prefill_graphs(self):
        """Short prefills as captured graphs (engine/prefill_graph.py): on CUDA with graphs on, unless
        --disable-prefill-cuda-graph or --cuda-graph-max-tokens-prefill 0. Captured here, before any request."""
        from baton.engine.prefill_graph import PrefillGraphs, prefill_buckets

        args = self.server_args
        if args.cuda_graph_max_tokens_prefill < 0:
            raise ConfigError("--cuda-graph-max-tokens-prefill must be >= 0")
        if self.device.type != "cuda" or args.disable_cuda_graph or args.disable_prefill_cuda_graph:
            return None
        buckets = prefill_buckets(min(args.cuda_graph_max_tokens_prefill, self.context_length))
        if not buckets:
            return None
        capture = self.drafter.capture_layer_ids if self.drafter else ()
        t0 = time.perf_counter()
        graphs = PrefillGraphs(self.model, self.runner.cache, self.device, buckets, capture)
        log.info("prefill CUDA graphs captured for %s tokens in %.1f s", "/".join(map(str, buckets)),
                 time.perf_counter() - t0)
        return graphs

    def _adaptive(self) -> bool:
        spec = self.server_args.spec
        return self.drafter is not None and spec.adaptive and spec.simulate_accept_len is None

    def _make_policy(self) -> AdaptiveDepth | FixedDepth:
        """The depth policy: adaptive (each depth's step time measured now; under tensor parallelism rank 0's, so
        every rank makes the same choices), or the full depth always."""
        if not self._adaptive():
            return FixedDepth(self.program.max_depth)
        step_ms = self.program.time_depths()
        if dist.tp_size() > 1:
            step_ms = dist.broadcast_object(step_ms)
        log.info("draft depth step times (ms): %s", ", ".join(f"{d}: {t:.2f}" for d, t in step_ms.items()))
        return AdaptiveDepth(self.program.depths, step_ms, online_times=dist.tp_size() == 1)

    def set_drafter(self, drafter: Drafter) -> None:
        """Replace the drafter (same number of drafts); the step program and the depth policy are built again."""
        self.drafter = drafter
        self.program = self._make_program()
        self.depth_policy = self._make_policy()
        self.prefix_cache = self._make_prefix_cache()

    def set_depth_policy(self, policy) -> None:
        """Replace the depth policy (tests: a fixed schedule); its depths must be among ``program.depths``."""
        self.depth_policy = policy

    def _apply_precision(self, args: ServerArgs) -> None:
        """Router gate and lm_head run in the model dtype unless the flags keep fp32 copies (made once here)."""
        from baton.layers.moe import SparseMoE

        if args.enable_fp32_lm_head:
            self.model.use_fp32_lm_head()
        if args.enable_fp32_router:
            for m in self.model.modules():
                if isinstance(m, SparseMoE):
                    m.use_fp32_router()

    # ---- public API (docs/engine-api.md) ----

    def validate_request(self, req: Request) -> None:
        req.sampling.validate()
        if not req.input_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in req.input_ids):
            raise ValueError(f"input_ids must lie in [0, {vocab})")
        total = len(req.input_ids) + req.sampling.max_new_tokens
        if total > self.context_length:
            raise ValueError(
                f"prompt ({len(req.input_ids)} tokens) + max_new_tokens ({req.sampling.max_new_tokens}) = "
                f"{total} exceeds the context length {self.context_length}"
            )

    def flush_cache(self) -> None:
        self.spec_stats.reset()
        self.runner.cache.reset()
        if self.drafter is not None:
            self.drafter.reset()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
            self.prefix_cache.reset_stats()

    def prefix_cache_info(self) -> dict:
        """The prefix cache's counters (hit rate = cached / prompt tokens since start or the last flush)."""
        if self.prefix_cache is None:
            return {"prefix_cache_enabled": False, "prefix_cache_hit_rate": 0.0}
        return {"prefix_cache_enabled": True, **self.prefix_cache.stats()}

    def model_info(self) -> dict:
        from baton.tokenizer import ID_TOKENIZER, IdTokenizer

        info = {"model_path": self.model_path, "tokenizer_path": self.loadable_tokenizer_path, "is_generation": True,
                "model_type": self.model_config.model_type, "served_model_name": self.served_model_name,
                "context_length": self.context_length}
        if isinstance(self.tokenizer, IdTokenizer):  # no tokenizer files (dummy weights): text is token ids
            info.update(tokenizer_path=ID_TOKENIZER, vocab_size=self.tokenizer.vocab_size)
        return info

    @property
    def loadable_tokenizer_path(self) -> str | None:
        """A directory a client's AutoTokenizer can load, so bench_serving needs no --tokenizer: the model's
        tokenizer directory, or for the embedded / a GGUF model the tokenizer baton converted from the GGUF."""
        return getattr(self.tokenizer, "model_dir", None) or self.tokenizer_path

    def server_info(self) -> dict:
        args = self.server_args
        info = {k: v for k, v in vars(args).items() if k != "spec"}
        info["tokenizer_path"] = self.model_info()["tokenizer_path"]
        info.update({f"speculative_{k}": v for k, v in vars(args.spec).items()})
        info.update(device=str(self.device), dtype=str(self.dtype).replace("torch.", ""),
                    context_length=self.context_length, avg_spec_accept_length=self.spec_stats.avg_accept_length,
                    spec_accept_histogram=dict(self.spec_stats.accept_histogram))
        info.update(self.prefix_cache_info())
        return info

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def add_observer(self, fn: Callable[[RequestTrace], None]) -> None:
        self._observers.append(fn)

    def warm_up(self) -> None:
        run_warm_up(self, long_prompt=self.device.type == "cuda")

    def generate(self, req: Request, should_abort: Callable[[], bool] | None = None) -> Iterator[StepOutput]:
        self.validate_request(req)
        with torch.inference_mode():
            yield from self._generate(req, should_abort or (lambda: False))

    def start_steps(self, req: Request) -> None:
        """Prefill ``req`` (greedy) and load the step program's relay, without running a step: for tools that time
        or profile ``program.replays`` themselves (the census)."""
        self.validate_request(req)
        with torch.inference_mode():
            anchor, pos = self._prefill(req)
            self.program.start(anchor, pos)

    # ---- the loop ----

    def _prefill(self, req: Request) -> tuple[torch.Tensor, int]:
        """The prompt's forward (eager, host shapes) and the drafter's begin; returns the first token and its
        position. A sampled first token comes from the default generator (seeded per request).

        With the prefix cache: the longest cached prefix is written back into the live caches (in place) and only
        the rest runs; with recurrent state the prefill is cut at the snapshot stride and the states there (and at
        the prompt's end) are recorded (baton/cache/prefix.py)."""
        cache, pc = self.runner.cache, self.prefix_cache
        cache.reset()
        if self.drafter is not None:
            self.drafter.reset()
        tokens = list(req.input_ids)
        n = len(tokens)
        start, prev_hidden = 0, None
        if pc is not None:
            m = pc.match(tokens)
            length = m.length if pc.exact else min(m.length, n - 1)  # exact: the snapshot's hidden gives logits
            if length > 0:
                pc.restore(m, length)
                start = length
                prev_hidden = m.node.hidden if pc.exact else None
            pc.record(n, start)
        self.last_cached_tokens = start
        prompt = torch.tensor(tokens, dtype=torch.long, device=self.device)
        hidden, caps, pending = self._forward_pieces(prompt, start)
        if hidden is not None:
            anchor = self._pick(hidden[-1:], req.sampling)  # [1]
        else:  # the whole prompt was cached: its last hidden state gives the first token
            hidden = prev_hidden[:0]
            caps = [prev_hidden[:0] for _ in (self.drafter.capture_layer_ids if self.drafter else ())]
            anchor = self._pick(prev_hidden, req.sampling)
        if self.drafter is not None:
            if start == 0:
                self.drafter.begin(prompt, hidden, caps, anchor)
            else:
                self.drafter.begin_from(start, prompt, hidden, caps, anchor, prev_hidden)
        if pc is not None and pc.exact:
            if not pc.state_buffers and pc.stride > 0:  # no recurrent state (NEXTN's hidden only): one forward
                cuts = range((start // pc.stride + 1) * pc.stride, n, pc.stride)
                pending = [(b, [], hidden[b - 1 - start : b - start].clone()) for b in cuts]
            for b, states, h in pending:
                pc.insert(tokens[:b], h, states=states)
            if start < n:  # the end of the prompt: where the next turn falls back to when the answer differs
                pc.insert(tokens, hidden[-1:])
        return anchor, n

    def _forward_pieces(self, prompt: torch.Tensor, start: int):
        """The target over ``prompt[start:]`` (cut by ``_segments``): (hidden [N - start, d] or None, the tapped
        layers' outputs, the recurrent states at the stride boundaries with h_{b-1})."""
        n = prompt.shape[0]
        capture = self.drafter.capture_layer_ids if self.drafter else ()
        hiddens, captured, pending = [], [], []
        graphs = self.prefill_graphs
        for a, b in self._segments(start, n):
            if graphs is not None and graphs.bucket(a, b - a) is not None:  # a short piece: a graph's replay
                h, caps = graphs.run(prompt[a:b], a)
            else:
                ctx = self.runner.context(ForwardMode.PREFILL, a, b - a, capture)
                h, caps = self.model(prompt[a:b], ctx), ctx.captured
            hiddens.append(h)
            captured.append(caps)
            if b < n:  # a stride boundary: the state there, recorded once the drafter's rows exist
                pending.append((b, [t.clone() for t in self.prefix_cache.state_buffers], h[-1:].clone()))
        if not hiddens:
            return None, [], pending
        hidden = hiddens[0] if len(hiddens) == 1 else torch.cat(hiddens)
        caps = captured[0] if len(captured) == 1 else [torch.cat(c) for c in zip(*captured, strict=True)]
        return hidden, caps, pending

    def _catch_up(self, tokens: list[int]) -> None:
        """Record the state after exactly ``tokens`` (the prompt and the tokens the client saw) where the caches
        went further (a speculative run-ahead step, tokens past a stop): restore the nearest snapshot and prefill
        the rest, between requests. The next turn, which resends those tokens, then hits at their end."""
        pc = self.prefix_cache
        m = pc.match(tokens)
        if m.length >= len(tokens):
            return
        self.runner.cache.reset()
        if self.drafter is not None:
            self.drafter.reset()
        start = m.length
        if start > 0:
            pc.restore(m, start)
        prompt = torch.tensor(tokens, dtype=torch.long, device=self.device)
        hidden, caps, _ = self._forward_pieces(prompt, start)
        if self.drafter is not None:  # the "first token" only feeds NEXTN's row N-1, which the cache never keeps
            nxt = prompt[-1:]
            if start == 0:
                self.drafter.begin(prompt, hidden, caps, nxt)
            else:
                self.drafter.begin_from(start, prompt, hidden, caps, nxt, m.node.hidden)
        pc.insert(tokens, hidden[-1:])

    def _segments(self, start: int, n: int) -> list[tuple[int, int]]:
        """The prefill's pieces: one, or (recurrent state cached) cut at multiples of the snapshot stride."""
        pc = self.prefix_cache
        if start >= n:
            return []
        if pc is None or not pc.exact or pc.stride <= 0 or not pc.state_buffers:
            return [(start, n)]
        cuts = list(range((start // pc.stride + 1) * pc.stride, n, pc.stride))
        bounds = [start, *cuts, n]
        return list(zip(bounds, bounds[1:], strict=False))

    def _record_end(self, sequence: list[int], host_step: int, seen: int) -> None:
        """After a request: its committed tokens (prompt + generated, and the last enqueued step's) into the
        prefix cache, with the states the caches hold now. With recurrent state (or NEXTN), where the caches went
        past the ``seen`` tokens (prompt + emitted: what a follow-up resends), the state at ``seen`` instead
        (``_catch_up``); plain decoding stops exactly there (its run-ahead step consumed the last emitted token)."""
        pc, program = self.prefix_cache, self.program
        extra = program.relay.read(host_step) if host_step >= 0 else []  # enqueued after the last one read
        committed = int(program.relay.pos)
        full = sequence + extra
        if len(full) != committed + 1 or committed <= 0:
            log.warning("prefix cache: request end not recorded (%d tokens, %d committed)", len(full), committed)
            return
        if pc.exact and 0 < seen < committed and full[:seen] == sequence[:seen]:
            self._catch_up(full[:seen])
            return
        hidden = program.relay.verify_hidden.index_select(0, program.relay.num_accepted)
        pc.insert(full[:committed], hidden, snapshot=pc.exact)

    def _generate(self, req: Request, should_abort: Callable[[], bool]) -> Iterator[StepOutput]:
        """Prefill, then the step program (engine/step.py) with host run-ahead: step k+1 is enqueued before step
        k's tokens are read (on CUDA from pinned memory, copied on a side stream), so the GPU never waits for the
        host."""
        sp = req.sampling
        out = OutputTracker(self.tokenizer, sp, self.eos_token_ids)
        if sp.max_new_tokens == 0:
            yield StepOutput([], "", True, {"type": "length", "length": 0})
            return
        program, policy = self.program, self.depth_policy
        if not sp.is_greedy and sp.seed is not None:  # a seed must repeat the request: the depth may not vary
            policy = FixedDepth(program.max_depth)  # with the machine's timings (the draws depend on the depth)
        sampled = not sp.is_greedy
        if sampled:  # the sampled bodies (captured at first use, before this request's state exists) read the
            program.prepare_sampled()  # default generator: seeded here, so a seed repeats the request
            self._seed_default_generator(_request_seed(sp))
            program.relay.set_sampling(sp.temperature, sp.top_k, sp.top_p, sp.min_p)
        anchor, pos = self._prefill(req)
        program.start(anchor, pos)
        first = anchor.tolist()
        sequence = list(req.input_ids) + first
        simulated = self.server_args.spec.simulate_accept_len is not None
        step_out = self._emit(out, first, 0, simulated, self.last_cached_tokens)
        seen = len(req.input_ids) + len(step_out.token_ids)  # prompt + the tokens emitted so far
        yield step_out
        num_verify, host_step = 0, 0
        enqueued, failed = -1, False  # the last step enqueued; an error (the caches' contents unknown)
        spec = self.drafter is not None
        gc_enabled = gc.isenabled()
        gc.disable()  # a collection pause in the loop eats the host's slack
        sync_check = torch.cuda.set_sync_debug_mode if env.sync_debug() and program.capture else None
        on_cpu = self.device.type == "cpu"  # the step runs inside program.step: its time is the call's
        policy.begin_request()
        depths = [policy.choose()]  # the depth of each enqueued step (the policy sees step k after enqueueing k+1)
        try:
            with _sync_debug(sync_check):
                program.step(host_step, sampled, depths[0])
                enqueued = host_step
                read_at = time.perf_counter()
                while not out.finished:
                    if should_abort():
                        e = out.abort()
                        yield StepOutput([], e.text, True, e.finish_reason, num_verify, simulated)
                        return
                    host_step += 1
                    depths.append(policy.choose())
                    t0 = time.perf_counter()
                    program.step(host_step, sampled, depths[host_step])  # enqueue step k+1 ...
                    enqueued = host_step
                    t1 = time.perf_counter()
                    tokens = program.relay.read(host_step - 1)  # ... then read step k
                    if spec:
                        num_verify += 1
                        self.spec_stats.record(len(tokens) - 1)
                        policy.observe(depths[host_step - 1], len(tokens) - 1)
                        if on_cpu:
                            policy.observe_time(depths[host_step], 1000 * (t1 - t0))
                        elif host_step > 1:  # GPU-bound: the wait between reads is the step's own time
                            policy.observe_time(depths[host_step - 1], 1000 * (time.perf_counter() - read_at))
                        read_at = time.perf_counter()
                    sequence += tokens
                    step_out = self._emit(out, tokens, num_verify, simulated)
                    seen += len(step_out.token_ids)
                    yield step_out
        except Exception:
            failed = True
            raise
        finally:
            if gc_enabled:
                gc.enable()
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the step in flight is discarded
            if not failed and self.prefix_cache is not None:
                program.flush()  # the drafter's deferred extends: its rows are what the prefix cache copies
                self._record_end(sequence, enqueued, seen)
            if self._observers:
                trace = RequestTrace(req.rid, sequence, int(program.relay.pos))
                for fn in self._observers:
                    fn(trace)

    def _seed_default_generator(self, seed: int) -> None:
        """The generator the graph path samples with: the device's default one (CUDA graph replays read its
        seed and advance its offset), seeded per request."""
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def simulated_accept_table(self, k: int, length: int = 4096) -> torch.Tensor:
        """The accepted-draft counts the CUDA-graph loop cycles through under simulated acceptance."""
        sim = self.server_args.spec.simulate_accept_len
        return torch.tensor([self._simulated_accept(k, sim) for _ in range(length)], device=self.device)

    def _simulated_accept(self, k: int, accept_len: float) -> int:
        """--speculative-simulate-accept-len L: accepted drafts a take the two integers around L - 1
        (clipped to [0, k]) with probabilities that make the mean exactly L - 1, so the mean accept length
        (a + 1) is L whenever L - 1 <= k."""
        m = min(max(accept_len - 1.0, 0.0), float(k))
        lo = math.floor(m)
        u = torch.rand(1, generator=self._sim_generator).item()
        return min(lo + (1 if u < m - lo else 0), k)

    def _pick(self, hidden: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
        """The next token after each row of ``hidden`` [T, d]: the argmax, or a sample (default generator)."""
        if sp.is_greedy:
            return self.model.greedy_tokens(hidden)
        logits = self.model.compute_logits(hidden)
        return sample_from_probs(logits_to_probs(logits, sp.temperature, sp.top_k, sp.top_p, sp.min_p), None)

    def _emit(self, out: OutputTracker, token_ids: list[int], num_verify: int, simulated: bool,
              cached_tokens: int = 0) -> StepOutput:
        e = out.add(token_ids)
        return StepOutput(e.token_ids, e.text, out.finished, e.finish_reason, num_verify, simulated, cached_tokens)

    def _context_length(self) -> int:
        cfg = self.model_config
        limit = self.server_args.context_length
        max_pos = getattr(cfg, "max_position_embeddings", 8192)
        if limit is None:
            return min(max_pos, 32768 if self.device.type == "cuda" else 8192)
        if limit < 2:
            raise ConfigError("--context-length must be at least 2")
        if limit > max_pos and not isinstance(cfg, LingConfig):
            log.warning("--context-length %d exceeds the model's max_position_embeddings %d", limit, max_pos)
        return limit


def _request_seed(sp: SamplingParams) -> int:
    """A sampled request's seed: its own, or one drawn from the clock."""
    return sp.seed if sp.seed is not None else int(time.time_ns() % (2**63))


@contextlib.contextmanager
def _sync_debug(setter):
    if setter is None:
        yield
        return
    setter("error")
    try:
        yield
    finally:
        setter("default")


def _config_eos(cfg) -> set[int]:
    eos = getattr(cfg, "eos_token_id", None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {int(eos)}
