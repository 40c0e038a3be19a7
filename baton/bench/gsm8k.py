"""GSM8K few-shot accuracy (``baton eval gsm8k``), SGLang's ``bench_sglang.py`` protocol without its leak.

The prompt is a few-shot block of TRAIN examples ("Question: ...\\nAnswer: <reference answer>\\n\\n", the first
``--num-shots``) followed by "Question: <test question>\\nAnswer:"; test questions never appear in the block.
Generation is greedy through the native ``/generate`` endpoint of a running server, or an engine in this
process, with SGLang's stop strings. The answer is the last number of the output (the one after "####" when
the model writes that marker, as the few-shot answers do), read with signs, decimals, thousands commas and
"$"; the label is the number after "####"; they are compared as numbers.

Reported as the seed write-up does: accuracy, invalid rate (no number in the output), total latency, output
throughput (completion tokens / latency) and, under speculative decoding, accept length.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm import tqdm

from baton import env
from baton.bench.gate import Completion, EngineClient, GateError, Generator, NativeClient

DEFAULT_STOP = ("Question", "</s>", "<|im_end|>", "\n\n\n")
DATA_URL = "https://github.com/openai/grade-school-math (grade_school_math/data)"
_NUMBER = re.compile(r"(?P<sign>[-\u2212])?\$?(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)")


class EvalError(RuntimeError):
    """Missing data files or bad flags; the message says what to fix."""


# ---- answers ----
def find_numbers(text: str) -> list[float]:
    """Every number in ``text``: "1,234" is 1234, "$5" is 5, "-3" is -3 but the "-" of "7-3" is subtraction."""
    values = []
    for m in _NUMBER.finditer(text):
        value = float(m["num"].replace(",", ""))
        start = m.start()
        is_minus_sign = m["sign"] and not (start > 0 and (text[start - 1].isalnum() or text[start - 1] in ")]"))
        values.append(-value if is_minus_sign else value)
    return values


def extract_answer(text: str) -> float | None:
    """A model output's answer: the last number on the line after the first "####", else the last number of
    the whole output; None when there is none (an invalid answer)."""
    if "####" in text:
        marked = find_numbers(text.split("####", 1)[1].split("\n", 1)[0])
        if marked:
            return marked[-1]
    numbers = find_numbers(text)
    return numbers[-1] if numbers else None


def extract_label(answer: str) -> float:
    """A reference answer's label: the number after its last "####"."""
    numbers = find_numbers(answer.rsplit("####", 1)[-1])
    if not numbers:
        raise EvalError(f"reference answer without a number after ####: {answer[-80:]!r}")
    return numbers[-1]


def same_number(pred: float | None, label: float) -> bool:
    return pred is not None and math.isclose(pred, label, rel_tol=1e-9, abs_tol=1e-6)


# ---- data and prompts ----
def read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def data_files(data_path: str, train_path: str | None = None) -> tuple[str, str]:
    """(test.jsonl, train.jsonl) from a directory holding both, or the test file (train.jsonl beside it)."""
    if os.path.isdir(data_path):
        test = os.path.join(data_path, "test.jsonl")
        train = train_path or os.path.join(data_path, "train.jsonl")
    else:
        test = data_path
        train = train_path or os.path.join(os.path.dirname(data_path) or ".", "train.jsonl")
    for name, path in (("test", test), ("train", train)):
        if not os.path.isfile(path):
            raise EvalError(f"GSM8K {name} file {path} not found: --data-path takes the directory holding "
                            f"test.jsonl and train.jsonl from {DATA_URL}, or the test.jsonl itself")
    return test, train


def few_shot_prefix(train: Sequence[dict[str, Any]], num_shots: int) -> str:
    """The first ``num_shots`` TRAIN examples, each "Question: q\\nAnswer: a\\n\\n"."""
    if num_shots > len(train):
        raise EvalError(f"--num-shots {num_shots} exceeds the {len(train)} train examples")
    return "".join(f"Question: {ex['question']}\nAnswer: {ex['answer']}\n\n" for ex in train[:num_shots])


def build_prompt(prefix: str, question: str) -> str:
    return f"{prefix}Question: {question}\nAnswer:"


# ---- running ----
@dataclass
class QuestionResult:
    question: str
    output: str
    prediction: float | None
    label: float
    correct: bool
    completion_tokens: int


@dataclass
class GSM8KResult:
    accuracy: float
    invalid: float
    latency: float
    output_throughput: float
    accept_length: float | None
    num_questions: int
    num_shots: int
    details: list[QuestionResult] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "details"}


def _sampling(max_new_tokens: int, stop: Sequence[str], temperature: float) -> dict[str, Any]:
    return {"temperature": temperature, "max_new_tokens": max_new_tokens, "stop": list(stop)}


def _generate_all(client: Generator, prompts: Sequence[str], sampling: dict[str, Any],
                  parallel: int) -> list[Completion]:
    outs: list[Completion | None] = [None] * len(prompts)
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool, \
            tqdm(total=len(prompts), desc="gsm8k", unit="q", disable=env.disable_progress()) as bar:
        futures = {pool.submit(client.generate, p, sampling): i for i, p in enumerate(prompts)}
        for fut in as_completed(futures):
            outs[futures[fut]] = fut.result()
            bar.update(1)
    return outs  # type: ignore[return-value]


def run_gsm8k(
    client: Generator,
    test: Sequence[dict[str, Any]],
    train: Sequence[dict[str, Any]],
    num_shots: int = 5,
    max_new_tokens: int = 256,
    parallel: int = 1,
    stop: Sequence[str] = DEFAULT_STOP,
    temperature: float = 0.0,
) -> GSM8KResult:
    """Ask every ``test`` question with a ``num_shots`` prefix from ``train``; ``parallel`` requests at once."""
    if not test:
        raise EvalError("no test questions")
    prefix = few_shot_prefix(train, num_shots)
    labels = [extract_label(ex["answer"]) for ex in test]
    prompts = [build_prompt(prefix, ex["question"]) for ex in test]
    start = time.perf_counter()
    outs = _generate_all(client, prompts, _sampling(max_new_tokens, stop, temperature), parallel)
    latency = time.perf_counter() - start
    details = [QuestionResult(ex["question"], o.text, extract_answer(o.text), label,
                              same_number(extract_answer(o.text), label), o.completion_tokens)
               for ex, o, label in zip(test, outs, labels, strict=True)]
    num_tokens = sum(o.completion_tokens for o in outs)
    num_verify = sum(o.num_verify_steps for o in outs)
    accept = num_tokens / num_verify if num_verify else client.server_accept_length()
    n = len(details)
    return GSM8KResult(sum(d.correct for d in details) / n, sum(d.prediction is None for d in details) / n,
                       latency, num_tokens / latency if latency > 0 else 0.0, accept, n, num_shots, details)


def print_result(result: GSM8KResult, out: Any = None) -> None:
    out = out or sys.stdout
    print(f"Accuracy: {result.accuracy:.3f}", file=out)
    print(f"Invalid: {result.invalid:.3f}", file=out)
    print(f"Latency: {result.latency:.3f} s", file=out)
    print(f"Output throughput: {result.output_throughput:.3f} token/s", file=out)
    if result.accept_length is not None:
        print(f"Accept length: {result.accept_length:.3f}", file=out)


# ---- command line ----
def _client(ns: argparse.Namespace) -> Generator:
    if ns.base_url or ns.port:
        url = ns.base_url or f"http://{ns.host}:{ns.port}"
        return NativeClient(url, ns.timeout)
    from baton.args import server_args_from

    return EngineClient.from_args(server_args_from(ns))


def _record(ns: argparse.Namespace, result: GSM8KResult, client: Generator) -> dict[str, Any]:
    record = {"task": "gsm8k", "backend": "baton", "server": client.name, "model_path": ns.model_path,
              **result.summary(), "max_new_tokens": ns.max_new_tokens, "stop": ns.stop or list(DEFAULT_STOP)}
    if ns.output_details:
        record["details"] = [asdict(d) for d in result.details]
    return record


def main(ns: argparse.Namespace) -> int:
    try:
        test_path, train_path = data_files(ns.data_path, ns.train_path)
        test = read_jsonl(test_path)[: ns.num_questions]
        train = read_jsonl(train_path) if ns.num_shots else []
        client = _client(ns)
        try:
            parallel = ns.parallel if isinstance(client, NativeClient) else 1
            result = run_gsm8k(client, test, train, ns.num_shots, ns.max_new_tokens, parallel,
                               ns.stop or DEFAULT_STOP, ns.temperature)
        finally:
            client.close()
    except (EvalError, GateError) as e:
        print(f"baton eval gsm8k: error: {e}", file=sys.stderr)
        return 2
    print_result(result)
    if ns.output_file:
        with open(ns.output_file, "w", encoding="utf-8") as f:
            json.dump(_record(ns, result, client), f, indent=2)
            f.write("\n")
    return 0


def add_gsm8k_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from baton.args import add_engine_args

    d = p.add_argument_group("data")
    d.add_argument("--data-path", required=True,
                   help=f"directory with test.jsonl and train.jsonl from {DATA_URL}, or the test.jsonl "
                        "(train.jsonl is then read beside it)")
    d.add_argument("--train-path", default=None, help="train.jsonl for the few-shot examples, if elsewhere")
    d.add_argument("--num-shots", type=int, default=5, help="few-shot examples from the TRAIN set (default 5)")
    d.add_argument("--num-questions", type=int, default=200, help="first N test questions (default 200)")
    g = p.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=256, help="output tokens per question (default 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--stop", action="append", default=None,
                   help=f"stop string (repeatable; default {list(DEFAULT_STOP)!r})")
    g.add_argument("--parallel", type=int, default=64,
                   help="concurrent requests to a server (default 64; an in-process engine runs one at a time)")
    s = p.add_argument_group("server (default: an engine in this process, see the model flags)")
    s.add_argument("--base-url", default=None, help="a running server, e.g. http://127.0.0.1:30000")
    s.add_argument("--host", default="127.0.0.1", help="with --port, instead of --base-url")
    s.add_argument("--port", type=int, default=None)
    s.add_argument("--timeout", type=float, default=3600.0, help="seconds per HTTP request (queueing included)")
    o = p.add_argument_group("output")
    o.add_argument("--output-file", default=None, help="write the results as JSON")
    o.add_argument("--output-details", action="store_true", help="include every question's output in the JSON")
    add_engine_args(p)
    return p


def add_eval_parser(sub: Any) -> None:
    p = sub.add_parser("eval", help="accuracy evaluations (gsm8k)",
                       description="Accuracy evaluations against a running server or an in-process engine.")
    esub = p.add_subparsers(dest="eval_command", required=True, metavar="EVAL")
    g = esub.add_parser("gsm8k", help="GSM8K few-shot accuracy, latency and output throughput",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        description=__doc__ + "\nExamples:\n"
                        "  baton eval gsm8k --data-path data/gsm8k --base-url http://127.0.0.1:30000\n"
                        "  baton eval gsm8k --data-path data/gsm8k --num-questions 20   # embedded model")
    add_gsm8k_args(g)
    g.set_defaults(func=main)
