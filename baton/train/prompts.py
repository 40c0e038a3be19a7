"""A general prompt set the project makes itself: templated tasks over seed topics, in seven domains beside GSM8K
(writing, explanation, code, summarisation, lists, translation, multi-turn chat), split into train and held-out
every fourth prompt of each domain held out (new topics go at the end of their lists, so the split of the
existing prompts never changes).

It is the input of draft training beyond GSM8K (the target answers each prompt) and of the speculation benchmark
over domains (benchmarks/bench_domains.py), which reads only the held-out split. Every prompt is a list of chat
messages; render it with the tokenizer's chat template.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

TOPICS = [
    "a lighthouse keeper", "the water cycle", "a small bakery", "volcanoes", "a chess tournament", "honeybees",
    "the first day of school", "solar panels", "a lost umbrella", "the moon landing", "a city garden",
    "electric cars", "an old library", "the human heart", "a rainy train journey", "coral reefs",
    "a robot who learns to paint", "the printing press", "a mountain village", "recycling plastic",
    "a street musician", "black holes", "a family recipe", "the internet", "a winter market", "photosynthesis",
    "a retired astronaut", "earthquakes", "a bicycle repair shop", "the Roman empire",
]

SUMMARY_TEXTS = [
    "The town council met on Tuesday to discuss the new bus routes. Residents complained that the morning buses "
    "were always late and too crowded. The council agreed to add two buses at peak hours and to publish a new "
    "timetable next month. A vote on the cost will take place in spring.",
    "Maria started running last year after her doctor told her to exercise more. At first she could only run for "
    "five minutes. She kept a diary of every run and slowly added a minute each week. This autumn she finished "
    "her first half marathon, and she now trains a group of beginners on Saturdays.",
    "The museum will close its east wing for six weeks while the roof is repaired. The paintings from that wing "
    "will be shown in the main hall instead. Tickets stay the same price, and members can still visit the "
    "library. The cafe will open an hour later during the works.",
    "A study of two hundred gardens found that lawns left uncut for a month had three times as many bees as lawns "
    "cut every week. Clover and dandelions flowered in the uncut lawns and fed the insects. The authors suggest "
    "cutting less often rather than not at all.",
]

TRANSLATE = [
    ("French", "Where is the train station?"), ("Spanish", "I would like a cup of coffee, please."),
    ("German", "The weather is very nice today."), ("French", "My brother lives in a small house by the sea."),
    ("Spanish", "Can you help me find my keys?"), ("German", "We are going to the museum tomorrow."),
    ("Italian", "This book is very interesting."), ("Portuguese", "How much does this cost?"),
]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "counts the words in a sentence",
    "returns the largest value in a list", "converts Celsius to Fahrenheit", "removes duplicates from a list",
    "computes the factorial of a number", "checks whether a word is a palindrome", "sums the even numbers in a list",
    "returns the n-th Fibonacci number", "merges two sorted lists", "counts the vowels in a string",
]

TEMPLATES = {
    "writing": ["Write a short story about {t}.", "Write a poem about {t}.",
                "Write a diary entry from the point of view of {t}."],
    "explanation": ["Explain {t} to a ten-year-old.", "What is interesting about {t}? Answer in one paragraph.",
                    "Describe {t} in simple words."],
    "lists": ["List five facts about {t}.", "Give me a list of ten words related to {t}.",
              "List three questions a child might ask about {t}."],
}


@dataclass(frozen=True)
class Prompt:
    domain: str
    messages: tuple[tuple[str, str], ...]  # (role, content)
    split: str = "train"  # or "heldout"

    @property
    def chat(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages]


def _user(text: str) -> tuple[tuple[str, str], ...]:
    return (("user", text),)


def general_prompts() -> list[Prompt]:
    """Every prompt of the set, in a fixed order, each with its split."""
    out: list[Prompt] = []
    for domain, templates in TEMPLATES.items():
        out += [Prompt(domain, _user(tpl.format(t=t))) for t in TOPICS for tpl in templates]
    out += [Prompt("code", _user(f"Write a Python function that {task}.")) for task in CODE_TASKS]
    out += [Prompt("code", _user(f"Explain what a Python function that {task} does, step by step."))
            for task in CODE_TASKS]
    for ask in ("Summarise this text in two sentences:", "What is the main point of this text?"):
        out += [Prompt("summarisation", _user(f"{ask}\n\n{text}")) for text in SUMMARY_TEXTS]
    out += [Prompt("translation", _user(f"Translate into {lang}: {text}")) for lang, text in TRANSLATE]
    for i, t in enumerate(TOPICS):  # multi-turn: a first exchange, then a follow-up
        first = TEMPLATES["explanation"][i % 3].format(t=t)
        out.append(Prompt("chat", (("user", first), ("assistant", f"Sure. Here is a short answer about {t}."),
                                   ("user", "Thanks! Can you say more, and give an example?"))))
    seen: dict[str, int] = {}
    for i, p in enumerate(out):
        n = seen[p.domain] = seen.get(p.domain, -1) + 1
        out[i] = dataclasses.replace(p, split="heldout" if n % 4 == 3 else "train")
    return out


def heldout_prompts(per_domain: int | None = None) -> dict[str, list[Prompt]]:
    """The held-out split by domain (the first ``per_domain`` of each, when given)."""
    by: dict[str, list[Prompt]] = {}
    for p in general_prompts():
        if p.split == "heldout":
            by.setdefault(p.domain, []).append(p)
    return {d: ps[:per_domain] if per_domain else ps for d, ps in by.items()}
