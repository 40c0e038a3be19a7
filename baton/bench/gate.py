"""The correctness gate (``baton gate``): the three checks every change must pass before it stays.

1. Greedy parity: a ``--num-tokens`` (256) greedy generation with ``ignore_eos`` on a few fixed prompts is
   byte-identical between a reference (plain decoding, "a") and a candidate (speculative decoding, "b"). A
   failure names where the texts diverge: the token index and both continuations around it.
2. Accept length: the candidate's accept length (``completion_tokens / spec_verify_ct`` summed over the greedy
   requests, else ``/server_info``'s average) lies within 0.05 of a stored baseline (``--baseline FILE``,
   ``{"accept_length": x}``; ``--write-baseline`` stores it instead).
3. State pollution: the candidate's greedy requests, repeated after interleaving temperature-1.0 sampled
   requests (different seeds), give exactly the text of its first greedy run.

Either side is a running server (native ``/generate``) or an engine built in this process; in-process, the
two engines are built one after the other so only one is ever in memory. Also owns the small native
generation clients (``NativeClient`` over HTTP, ``EngineClient`` in process) that ``gsm8k.py`` reuses.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import shlex
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tqdm import tqdm

from baton import env

DEFAULT_PROMPTS = (
    "The history of the printing press begins in",
    'def quicksort(items):\n    """Sort a list of numbers in ascending order."""\n',
    "Question: A train travels 60 miles per hour for 3 hours. How far does it travel?\nAnswer:",
)
DEFAULT_NUM_TOKENS = 256
DEFAULT_TOLERANCE = 0.05
_CONTEXT_CHARS = 60
_HTTP_TIMEOUT_S = 600.0


class GateError(RuntimeError):
    """The gate cannot run (bad flags, unreachable server, unreadable baseline); the message says why."""


# ---- generation clients ----
@dataclass
class Completion:
    """One finished native generation."""

    text: str
    output_ids: list[int] | None  # None when the server does not return them
    completion_tokens: int
    num_verify_steps: int  # spec_verify_ct; 0 without speculation


class Generator(Protocol):
    """Runs one native ``/generate`` request (``sampling`` uses SGLang's ``sampling_params`` names)."""

    name: str

    def generate(self, prompt: str, sampling: dict[str, Any]) -> Completion: ...

    def server_accept_length(self) -> float | None: ...

    def close(self) -> None: ...


class NativeClient:
    """A running server's native ``/generate`` (non-streaming), thread-safe; auth as ``baton bench``."""

    def __init__(self, base_url: str, timeout_s: float = _HTTP_TIMEOUT_S) -> None:
        import httpx

        from baton.bench.serving import request_headers

        self.name = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.name, headers=request_headers(), timeout=timeout_s)

    def generate(self, prompt: str, sampling: dict[str, Any]) -> Completion:
        import httpx

        try:
            resp = self._http.post("/generate", json={"text": prompt, "sampling_params": sampling})
        except httpx.HTTPError as e:
            raise GateError(f"{self.name}/generate failed: {e!r}") from e
        if resp.status_code != 200:
            raise GateError(f"{self.name}/generate answered {resp.status_code}: {resp.text[:300]}")
        body = resp.json()
        meta = body.get("meta_info") or {}
        ids = body.get("output_ids")
        return Completion(body.get("text", ""), list(ids) if isinstance(ids, list) else None,
                          int(meta.get("completion_tokens") or 0), int(meta.get("spec_verify_ct") or 0))

    def server_accept_length(self) -> float | None:
        from baton.bench.serving import accept_length_from

        try:
            resp = self._http.get("/server_info")
        except Exception:
            return None
        return accept_length_from(resp.json()) if resp.status_code == 200 else None

    def close(self) -> None:
        self._http.close()


class EngineClient:
    """An engine in this process; prompts are tokenized as the server does (special tokens added)."""

    def __init__(self, engine: Any, name: str = "in-process") -> None:
        self.engine = engine
        self.name = name
        self._lock = threading.Lock()  # the engine runs one request at a time

    @classmethod
    def from_args(cls, server_args: Any, name: str = "in-process") -> EngineClient:
        from baton.engine.engine import Engine

        return cls(Engine(server_args), name)

    def generate(self, prompt: str, sampling: dict[str, Any]) -> Completion:
        from baton.types import Request, SamplingParams

        params = SamplingParams(**{k: v for k, v in sampling.items() if v is not None})
        with self._lock:
            ids = list(self.engine.tokenizer.encode(prompt, add_special_tokens=True))
            text, out_ids, num_verify = [], [], 0
            for out in self.engine.generate(Request(ids, params)):
                text.append(out.text)
                out_ids.extend(out.token_ids)
                num_verify = out.num_verify_steps
        return Completion("".join(text), out_ids, len(out_ids), num_verify)

    def server_accept_length(self) -> float | None:
        return self.engine.spec_stats.avg_accept_length

    def close(self) -> None:
        """Drop the engine and return its memory before the next one is built."""
        self.engine = None
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass


GeneratorFactory = Callable[[], Generator]


# ---- checks ----
PASS, FAIL, SKIP, WRITTEN = "PASS", "FAIL", "SKIP", "WRITTEN"


@dataclass
class Check:
    name: str
    status: str
    detail: str = ""


@dataclass
class GateResult:
    checks: list[Check]
    reference: list[Completion]
    candidate: list[Completion]
    repeat: list[Completion]
    accept_length: float | None
    divergences: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.status != FAIL for c in self.checks)

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1


def greedy_params(num_tokens: int) -> dict[str, Any]:
    return {"temperature": 0.0, "max_new_tokens": num_tokens, "ignore_eos": True}


def sampled_params(num_tokens: int, seed: int) -> dict[str, Any]:
    return {"temperature": 1.0, "max_new_tokens": num_tokens, "ignore_eos": True, "seed": seed}


def _progress(total: int, desc: str) -> tqdm:
    return tqdm(total=total, desc=desc, unit="req", leave=False, disable=env.disable_progress())


def _greedy_run(gen: Generator, prompts: Sequence[str], num_tokens: int, desc: str) -> list[Completion]:
    outs = []
    with _progress(len(prompts), desc) as bar:
        for prompt in prompts:
            outs.append(gen.generate(prompt, greedy_params(num_tokens)))
            bar.update(1)
    return outs


def _interleaved_run(gen: Generator, prompts: Sequence[str], num_tokens: int, num_sampled: int,
                     sampled_tokens: int) -> list[Completion]:
    """Before each greedy repeat, ``num_sampled`` sampled requests (rotating prompts, distinct seeds)."""
    outs = []
    with _progress(len(prompts) * (num_sampled + 1), "b: sampled + greedy") as bar:
        for i, prompt in enumerate(prompts):
            for j in range(num_sampled):
                seed = 1000 + i * num_sampled + j
                gen.generate(prompts[(i + j + 1) % len(prompts)], sampled_params(sampled_tokens, seed))
                bar.update(1)
            outs.append(gen.generate(prompt, greedy_params(num_tokens)))
            bar.update(1)
    return outs


def first_difference(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """Index of the first element where ``a`` and ``b`` differ (the shorter length if one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def describe_divergence(prompt: str, a: Completion, b: Completion, label_a: str = "a", label_b: str = "b") -> str:
    """Where two generations of one prompt part: token index (when ids are known), character offset, and the
    text just before plus both continuations after it."""
    char = first_difference(a.text, b.text)
    tok = None
    if a.output_ids is not None and b.output_ids is not None:
        tok = first_difference(a.output_ids, b.output_ids)
    head = f"prompt {prompt[:40]!r}: "
    if char is None and tok is None:
        return head + "identical"
    where = []
    if tok is not None:
        where.append(f"token {tok} ({_token_at(a, tok)} vs {_token_at(b, tok)})")
    if char is not None:
        where.append(f"char {char}")
    char = char if char is not None else min(len(a.text), len(b.text))
    before = a.text[max(0, char - _CONTEXT_CHARS) : char]
    return (head + "diverges at " + ", ".join(where) + f"\n    common  ...{before!r}"
            f"\n    {label_a:<7} {a.text[char : char + _CONTEXT_CHARS]!r}"
            f"\n    {label_b:<7} {b.text[char : char + _CONTEXT_CHARS]!r}")


def _token_at(c: Completion, i: int) -> str:
    return str(c.output_ids[i]) if c.output_ids is not None and i < len(c.output_ids) else "end"


def _parity(prompts: Sequence[str], a: list[Completion], b: list[Completion], labels: tuple[str, str],
            name: str) -> tuple[Check, list[str]]:
    diffs = [describe_divergence(p, x, y, *labels) for p, x, y in zip(prompts, a, b, strict=True) if x.text != y.text]
    num_tokens = sum(c.completion_tokens for c in b)
    if diffs:
        return Check(name, FAIL, f"{len(diffs)} of {len(prompts)} prompts differ"), diffs
    return Check(name, PASS, f"{len(prompts)} prompts, {num_tokens} tokens identical"), []


def candidate_accept_length(gen: Generator, outs: Sequence[Completion]) -> float | None:
    """SGLang's per-request accept length over the greedy run: completion tokens / verify steps."""
    num_verify = sum(c.num_verify_steps for c in outs)
    if num_verify:
        return sum(c.completion_tokens for c in outs) / num_verify
    return gen.server_accept_length()


def read_baseline(path: str) -> float:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)["accept_length"]
    except FileNotFoundError:
        raise GateError(f"baseline {path} does not exist; create it with --write-baseline") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise GateError(f"baseline {path} is not a JSON object with accept_length: {e!r}") from None
    return float(value)


def write_baseline(path: str, accept_length: float, num_tokens: int, prompts: Sequence[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"accept_length": accept_length, "num_tokens": num_tokens, "prompts": list(prompts)}, f, indent=2)
        f.write("\n")


def _accept_check(accept: float | None, baseline_path: str | None, write: bool, tolerance: float,
                  num_tokens: int, prompts: Sequence[str]) -> Check:
    name = "accept length"
    if baseline_path is None:
        return Check(name, SKIP, f"{_fmt(accept)} (no --baseline)")
    if accept is None:
        return Check(name, FAIL, "the candidate reports no accept length (is speculative decoding on?)")
    if write:
        write_baseline(baseline_path, accept, num_tokens, prompts)
        return Check(name, WRITTEN, f"{accept:.4f} -> {baseline_path}")
    base = read_baseline(baseline_path)
    status = PASS if abs(accept - base) <= tolerance else FAIL
    return Check(name, status, f"{accept:.4f} vs baseline {base:.4f} (tolerance {tolerance})")


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def run_gate(
    reference: GeneratorFactory,
    candidate: GeneratorFactory,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    num_tokens: int = DEFAULT_NUM_TOKENS,
    baseline_path: str | None = None,
    write_baseline: bool = False,
    accept_tolerance: float = DEFAULT_TOLERANCE,
    num_sampled: int = 2,
    sampled_tokens: int = 64,
    out: Any = None,
) -> GateResult:
    """Run the three checks. Each factory opens one side; the reference is closed before the candidate opens,
    so two in-process engines never share memory. Prints the divergences and the PASS/FAIL table to ``out``
    (stdout by default; ``False`` prints nothing)."""
    if not prompts:
        raise GateError("no prompts")
    ref = reference()
    try:
        a = _greedy_run(ref, prompts, num_tokens, f"a: greedy ({ref.name})")
    finally:
        ref.close()
    cand = candidate()
    try:
        b = _greedy_run(cand, prompts, num_tokens, f"b: greedy ({cand.name})")
        accept = candidate_accept_length(cand, b)
        repeat = _interleaved_run(cand, prompts, num_tokens, num_sampled, sampled_tokens)
    finally:
        cand.close()
    parity, diffs = _parity(prompts, a, b, ("a", "b"), "greedy parity (a vs b)")
    pollution, diffs2 = _parity(prompts, b, repeat, ("b", "b again"), "state pollution (b vs b again)")
    checks = [parity, _accept_check(accept, baseline_path, write_baseline, accept_tolerance, num_tokens, prompts),
              pollution]
    result = GateResult(checks, a, b, repeat, accept, diffs + diffs2)
    if out is not False:
        print_result(result, out or sys.stdout)
    return result


def print_result(result: GateResult, out: Any) -> None:
    for line in result.divergences:
        print(line, file=out)
    width = max(len(c.name) for c in result.checks)
    print(f"\n{'check':<{width}}  {'result':<7}  detail", file=out)
    for c in result.checks:
        print(f"{c.name:<{width}}  {c.status:<7}  {c.detail}", file=out)
    print(f"gate: {'PASS' if result.passed else 'FAIL'}", file=out)


# ---- command line ----
def _spec_overrides(spec_args: str) -> dict[str, Any]:
    """The ``--speculative-*`` values of a ``--spec-args`` string (anything else is refused)."""
    from baton.args import add_engine_args

    parser = argparse.ArgumentParser(prog="--spec-args", add_help=False, exit_on_error=False)
    add_engine_args(parser)
    try:
        ns = parser.parse_args(shlex.split(spec_args))
    except (argparse.ArgumentError, SystemExit) as e:
        raise GateError(f"cannot parse --spec-args {spec_args!r}: {e}") from None
    defaults = vars(parser.parse_args([]))
    changed = {k: v for k, v in vars(ns).items() if v != defaults[k]}
    other = sorted(k for k in changed if not k.startswith("speculative_"))
    if other:
        raise GateError(f"--spec-args takes --speculative-* flags only; give {other[0]} outside it")
    return changed


def engine_configs(ns: argparse.Namespace) -> tuple[Any, Any]:
    """ServerArgs of config a (no speculation) and b (the engine flags plus ``--spec-args``)."""
    from baton.args import server_args_from
    from baton.config import SpecConfig

    merged = argparse.Namespace(**(vars(ns) | _spec_overrides(ns.spec_args or "")))
    b = server_args_from(merged)
    if not b.spec.enabled:
        raise GateError("config b has no speculation: pass --spec-args '--speculative-algorithm NEXTN ...'")
    # the gate judges the drafter at its configured depth: adaptive depth would make the accept length a property
    # of the machine's step times (its exactness is tested in tests/speculative/test_adaptive.py)
    b = dataclasses.replace(b, spec=dataclasses.replace(b.spec, adaptive=False))
    return dataclasses.replace(b, spec=SpecConfig()), b


def _factories(ns: argparse.Namespace) -> tuple[GeneratorFactory, GeneratorFactory]:
    if bool(ns.base_url_a) != bool(ns.base_url_b):
        raise GateError("give both --base-url-a and --base-url-b, or neither (in-process engines)")
    if ns.base_url_a:
        return (lambda: NativeClient(ns.base_url_a, ns.timeout)), (lambda: NativeClient(ns.base_url_b, ns.timeout))
    args_a, args_b = engine_configs(ns)
    return (lambda: EngineClient.from_args(args_a, "a: plain")), (lambda: EngineClient.from_args(args_b, "b: spec"))


def add_gate_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from baton.args import add_engine_args

    g = p.add_argument_group("servers (instead of in-process engines)")
    g.add_argument("--base-url-a", default=None, help="reference server (plain decoding), e.g. http://127.0.0.1:30000")
    g.add_argument("--base-url-b", default=None, help="candidate server (speculative decoding)")
    g.add_argument("--timeout", type=float, default=_HTTP_TIMEOUT_S, help="seconds per HTTP request")
    add_engine_args(p)
    p.add_argument("--spec-args", default=None, metavar="FLAGS",
                   help="speculative flags of config b as one string, e.g. \"--speculative-algorithm NEXTN "
                        "--speculative-num-steps 3\"; config a is the same engine without speculation")
    c = p.add_argument_group("checks")
    c.add_argument("--prompt", action="append", default=None,
                   help=f"a prompt (repeatable; default: {len(DEFAULT_PROMPTS)} built-in prompts)")
    c.add_argument("--num-tokens", type=int, default=DEFAULT_NUM_TOKENS,
                   help="greedy tokens per prompt, ignore_eos (default %(default)s)")
    c.add_argument("--baseline", default=None, metavar="FILE",
                   help='JSON {"accept_length": x} to check against (without it the accept check is skipped)')
    c.add_argument("--write-baseline", action="store_true", help="write the candidate's accept length to --baseline")
    c.add_argument("--accept-tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help="allowed |accept length - baseline| (default %(default)s)")
    c.add_argument("--num-sampled", type=int, default=2,
                   help="temperature-1.0 requests (distinct seeds) before each greedy repeat (default %(default)s)")
    c.add_argument("--sampled-tokens", type=int, default=64, help="tokens per sampled request (default %(default)s)")
    return p


def main(ns: argparse.Namespace) -> int:
    try:
        if ns.write_baseline and not ns.baseline:
            raise GateError("--write-baseline needs --baseline FILE")
        ref, cand = _factories(ns)
        result = run_gate(ref, cand, ns.prompt or DEFAULT_PROMPTS, ns.num_tokens, ns.baseline, ns.write_baseline,
                          ns.accept_tolerance, ns.num_sampled, ns.sampled_tokens)
    except GateError as e:
        print(f"baton gate: error: {e}", file=sys.stderr)
        return 2
    return result.exit_code


def add_gate_parser(sub: Any) -> None:
    p = sub.add_parser(
        "gate", help="correctness gate: greedy parity, accept length, state pollution",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\nEither")[0] + "\n\n"
        "Against servers:  baton gate --base-url-a http://127.0.0.1:30000 --base-url-b http://127.0.0.1:30001\n"
        "In process:       baton gate --model-path M --spec-args \"--speculative-algorithm NEXTN "
        "--speculative-num-steps 3\" --baseline gate.json [--write-baseline]\n\n"
        "In process, config b is the model flags plus --spec-args (speculative flags given directly also apply "
        "to b only); config a is the same engine with speculation off.\n\n"
        "Exit status 0 only when every check holds (a skipped accept check does not fail); 1 on a failed check, "
        "2 when the gate cannot run.")
    add_gate_args(p)
    p.set_defaults(func=main)
