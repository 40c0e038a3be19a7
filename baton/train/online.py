"""Target features computed online: nothing is stored, every training batch runs the frozen target.

``TargetFeatures`` runs the target over one full token sequence in PREFILL mode (no grad), capturing the
outputs of the tapped decoder layers (``ctx.capture_layer_ids``, the DSpark/DFlash context features) next to
the final-normed hidden states (the NEXTN input and, through the frozen lm_head, the target distribution).

``TargetFeatures.many`` computes a whole training batch at once: for a llama target, one padded forward of
transformers' model holding the target's own weights (``models.hf_export``: no copy), in place of one
baton forward per sequence (a step of 16 sequences was host-bound on the H200: ~0.8 s, most of it Python
launching one small forward after another); other targets fall back to the per-sequence loop.

``FeaturePrefetcher`` turns it into a producer: a worker thread walks the batch iterator ``depth`` batches
ahead of the trainer, runs the target on ``--target-device`` and hands finished features (moved to the
trainer's device) through a bounded queue, so the next batch's target forwards overlap the current batch's
training step.

Device layouts:

- one GPU, time-shared: target and trainer on ``cuda:0``; the worker issues the target forwards on a side
  stream, so they interleave with the trainer's kernels on the same GPU;
- two GPUs, the SplitServe layout: ``--target-device cuda:0 --device cuda:1``; the worker thread drives
  cuda:0 (the "serving" GPU: target forwards only) while the main thread trains on cuda:1; the features cross
  once per sequence (``[T, d]`` final hidden + ``[T, n*d]`` taps), and the trainer keeps its own copy of the
  frozen embedding / lm_head (``common.FrozenHead``);
- CPU (tests): the same thread + queue, computing on the CPU.

The queue carries plain tensors, so the worker could equally be another process (a ``torch.multiprocessing``
queue with CUDA IPC) if one host thread ever becomes the bottleneck; at batch 1 target forwards are GPU-bound.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from baton import env
from baton.cache.model_cache import ModelCache
from baton.layers.context import ForwardContext
from baton.models.base import CausalLM
from baton.train.common import Sample
from baton.types import ForwardMode

log = logging.getLogger(__name__)


@dataclass
class Features:
    """Target features of one sequence of T tokens."""

    hidden: torch.Tensor  # [T, d] final-normed hidden states (row t predicts token t+1)
    taps: torch.Tensor | None  # [T, n*d] outputs of the tapped layers, concatenated in the requested order

    def to(self, device: torch.device, non_blocking: bool = False) -> Features:
        taps = None if self.taps is None else self.taps.to(device, non_blocking=non_blocking)
        return Features(self.hidden.to(device, non_blocking=non_blocking), taps)

    def tensors(self) -> list[torch.Tensor]:
        return [self.hidden] + ([] if self.taps is None else [self.taps])


class TargetFeatures:
    """The frozen target as a feature provider: ``provider(ids) -> Features`` (no grad, PREFILL, one sequence).

    ``layer_ids`` are decoder layer indices in the order the features are concatenated (a DSpark draft's
    ``target_layer_ids``, which may be unsorted); the model captures in layer order and this reorders."""

    def __init__(self, model: CausalLM, device: torch.device, layer_ids: Sequence[int] = (),
                 max_len: int = 2048) -> None:
        self.model, self.device = model, device
        self.layer_ids = list(layer_ids)
        self.capture = tuple(sorted(set(self.layer_ids)))
        self._order = [self.capture.index(i) for i in self.layer_ids]
        self.dtype = next(model.parameters()).dtype
        self.cache: ModelCache | None = None
        self._ensure_cache(max_len)
        self._hf: object | None = None  # the batched llama path, built on first use (False: not available)

    def _ensure_cache(self, length: int) -> ModelCache:
        if self.cache is None or self.cache.max_len < length:
            self.cache = self.model.make_cache(length, self.dtype, self.device, max_stage=1)
        return self.cache

    @torch.no_grad()
    def __call__(self, ids: Sequence[int]) -> Features:
        t = len(ids)
        cache = self._ensure_cache(t)
        cache.reset()  # a fresh sequence: KDA recurrent / conv states start from zero
        tokens = torch.tensor(list(ids), dtype=torch.long, device=self.device)  # [T]
        ctx = ForwardContext(ForwardMode.PREFILL, torch.arange(t, device=self.device), cache, kv_len=t,
                             capture_layer_ids=self.capture)
        hidden = self.model(tokens, ctx)  # [T, d]
        taps = None
        if self.layer_ids:
            taps = torch.cat([ctx.captured[i] for i in self._order], dim=-1)  # [T, n*d]
        return Features(hidden, taps)

    # padded tokens per batched forward (a longer batch is split): bounds the transformers forward's activations
    MAX_BATCH_TOKENS = 32768

    def many(self, seqs: Sequence[Sequence[int]]) -> list[Features]:
        """Features of every sequence, in order: batched (right padding) through transformers for a llama
        target, else one ``__call__`` per sequence. Same values as ``__call__`` up to the two
        implementations' rounding (equal to 1e-5 in fp32)."""
        hf = self._batched_model() if len(seqs) > 1 else None
        if hf is None:
            return [self(ids) for ids in seqs]
        out: list[tuple[int, Features]] = []
        chunk: list[int] = []
        for i in sorted(range(len(seqs)), key=lambda i: len(seqs[i])):  # similar lengths share a forward
            if chunk and len(seqs[i]) * (len(chunk) + 1) > self.MAX_BATCH_TOKENS:  # seqs[i] is the longest yet
                out += zip(chunk, self._hf_forward(hf, [seqs[j] for j in chunk]), strict=True)
                chunk = []
            chunk.append(i)
        out += zip(chunk, self._hf_forward(hf, [seqs[j] for j in chunk]), strict=True)
        return [f for _, f in sorted(out, key=lambda x: x[0])]

    def _batched_model(self):
        if self._hf is None and not env.train_hf_features():
            self._hf = False  # the per-sequence loop (an A/B switch for the training-throughput measurements)
        if self._hf is None:
            try:
                from baton.models.hf_export import to_hf_llama

                self._hf = to_hf_llama(self.model, self.device, self.dtype)
            except (ImportError, ValueError):  # not a llama target, tensor-parallel, or no transformers
                self._hf = False
        return self._hf or None

    @torch.no_grad()
    def _hf_forward(self, hf, seqs: Sequence[Sequence[int]]) -> list[Features]:
        width = max(len(ids) for ids in seqs)
        tokens = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for r, ids in enumerate(seqs):
            tokens[r, : len(ids)] = torch.tensor(list(ids))
            mask[r, : len(ids)] = 1
        res = hf.model(input_ids=tokens.to(self.device), attention_mask=mask.to(self.device),
                       output_hidden_states=bool(self.layer_ids), use_cache=False)
        hidden = res.last_hidden_state  # [B, W, d], final-normed
        taps = None
        if self.layer_ids:  # hidden_states[i + 1]: the residual stream after decoder layer i
            taps = torch.cat([res.hidden_states[i + 1] for i in self.layer_ids], dim=-1)  # [B, W, n*d]
        return [Features(hidden[r, : len(ids)], None if taps is None else taps[r, : len(ids)])
                for r, ids in enumerate(seqs)]


CLOSE_TIMEOUT_S = 600.0  # FeaturePrefetcher.close: the longest a batch of target forwards may still take


class FeaturePrefetcher:
    """Iterate ``batches`` as lists of (sample, Features on ``out_device``), computed ``depth`` batches ahead
    by a worker thread. Exceptions in the worker re-raise in the consumer; ``close`` stops the worker."""

    _DONE = object()

    def __init__(self, provider: TargetFeatures, batches: Iterable[list[Sample]], out_device: torch.device,
                 depth: int = 2) -> None:
        self.provider, self.out_device = provider, out_device
        self._batches = iter(batches)
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._gate = threading.Lock()  # held by the worker while it computes a batch (see ``paused``)
        self._side_stream = torch.cuda.Stream(provider.device) if provider.device.type == "cuda" else None
        self._thread = threading.Thread(target=self._work, name="target-features", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        device = self.provider.device
        if device.type == "cuda" and device.index is not None:  # the current device is per thread (Triton uses it)
            torch.cuda.set_device(device)
        try:
            with torch.no_grad(), _stream(self._side_stream):
                for batch in self._batches:
                    if self._stop.is_set():
                        return
                    with self._gate:
                        feats = self.provider.many([s.ids for s in batch])
                        items = [(s, f.to(self.out_device)) for s, f in zip(batch, feats, strict=True)]
                        if self._side_stream is not None:
                            self._side_stream.synchronize()
                    self._put(items)
        except BaseException as e:  # handed to the consumer
            self._put(e)
            return
        self._put(self._DONE)

    def _put(self, item: object) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator[list[tuple[Sample, Features]]]:
        while True:
            item = self._queue.get()
            if item is self._DONE:
                return
            if isinstance(item, BaseException):
                raise item
            if self._side_stream is not None:
                _claim(item)
            yield item

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No target forwards while the block runs (e.g. an evaluation engine using the same GPU)."""
        with self._gate:
            yield

    def close(self) -> None:
        """Stop after the batch in progress and wait for it: a daemon thread still inside a target forward at
        interpreter exit aborts the process (``terminate called without an active exception``), as when a time
        budget cuts training while a batch is being computed."""
        self._stop.set()
        self._thread.join(timeout=CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("the target-feature worker is still computing after %.0f s; exiting without it",
                        CLOSE_TIMEOUT_S)

    def __enter__(self) -> FeaturePrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stream(stream: torch.cuda.Stream | None):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _claim(items: list[tuple[Sample, Features]]) -> None:
    """Tensors made on the worker's side stream are used on the trainer's stream from now on: tell the
    caching allocator, so their memory is not reused while the trainer's kernels may still read it."""
    for _, feats in items:
        for t in feats.tensors():
            if t.is_cuda:
                t.record_stream(torch.cuda.current_stream(t.device))


def features_for(provider: TargetFeatures, samples: Sequence[Sample],
                 out_device: torch.device) -> list[tuple[Sample, Features]]:
    """Synchronous helper (calibration, evaluation): features of every sample, in order."""
    feats = provider.many([s.ids for s in samples])
    return [(s, f.to(out_device)) for s, f in zip(samples, feats, strict=True)]


__all__ = ["FeaturePrefetcher", "Features", "TargetFeatures", "features_for"]
