"""A general prompt set the project makes itself: templated tasks over seed topics, in seven domains beside GSM8K
(writing, explanation, code, summarisation, lists, translation, multi-turn chat), split into train and held-out
every fourth prompt of each domain held out (new topics go at the end of their lists, so the split of the
existing prompts never changes). A second, train-only part (``TRAIN_TOPICS``, ``NEW_TEMPLATES``, more code
tasks, texts and sentences) follows them: more variety for draft training, never held out, so the held-out
split and every existing prompt's index stay as they were.

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

# Train-only: never held out (the domain benchmark measures on the split above, which these leave as it was).
TRAIN_TOPICS = [
    "a fox in the snow", "the speed of light", "a night at the museum", "glaciers", "a birthday surprise",
    "wind turbines", "a ship in a storm", "the immune system", "a village fair", "dinosaurs", "a late bus",
    "clouds and rain", "a young inventor", "the stock market", "a forest fire", "penguins", "a job interview",
    "the periodic table", "a haunted house", "vaccines", "a football final", "ancient Egypt", "a kind neighbour",
    "the ocean tides", "a secret garden", "computers", "a desert caravan", "the seasons", "a talking cat",
    "bridges", "a hospital night shift", "magnets", "a treasure map", "rainforests", "a school play",
    "the Great Wall of China", "a lonely whale", "batteries", "a snowy cabin", "the solar system",
    "a lost dog finding home", "democracy", "a jazz club", "sleep", "a space station", "trees in autumn",
    "a flower shop", "gravity", "a music teacher", "the Olympic Games", "an island holiday", "bread making",
    "a friendly dragon", "money", "a night sky full of stars", "rivers", "a cooking competition", "owls",
    "a mystery letter", "public libraries",
]
NEW_TEMPLATES = {  # beside TEMPLATES: the train-only part takes both over TRAIN_TOPICS, these over TOPICS
    "writing": ["Write a letter to a friend about {t}.", "Write the opening paragraph of a novel about {t}."],
    "explanation": ["Why do people care about {t}?", "Give a short explanation of {t} with one example."],
    "lists": ["Give me five tips related to {t}."],
}
TRAIN_CODE_TASKS = [
    "sorts a list of numbers without using sort()", "finds the second largest number in a list",
    "counts how often each letter appears in a string", "checks whether two words are anagrams",
    "returns the average of a list", "converts a list of strings to upper case", "flattens a nested list",
    "finds the common elements of two lists", "reads a text file and counts its lines",
    "returns the greatest common divisor of two numbers", "capitalises the first letter of every word",
    "checks whether a year is a leap year", "returns the squares of the numbers from 1 to n",
    "removes the vowels from a string", "finds the longest word in a sentence", "reverses the order of words",
]
TRAIN_TEXTS = [
    "The school library will open on Saturdays from next month. Volunteers from the parents' group will run it, "
    "and pupils can borrow up to three books each. The head teacher hopes that more children will read at the "
    "weekend, and the local bookshop has donated fifty new titles.",
    "After a dry summer the river fell to its lowest level in forty years. Boats could not reach the harbour, and "
    "farmers were asked to use less water. Heavy rain in October has since brought the river back to normal, but "
    "the council plans to build a new reservoir.",
    "A small company in the north has built a bicycle made almost entirely of bamboo. It weighs less than a steel "
    "frame and absorbs bumps well. The founders sell about two hundred a year and want to open a second workshop.",
    "Scientists tracked twenty sea turtles for three years with small satellite tags. The turtles swam thousands "
    "of kilometres but returned to the same beaches to lay their eggs. The data will help protect their routes.",
]
TRAIN_SENTENCES = [
    ("French", "The children are playing in the park."), ("Spanish", "Where can I buy a ticket?"),
    ("German", "I have been learning to cook."), ("Italian", "The train leaves at seven o'clock."),
    ("Portuguese", "My favourite colour is blue."), ("French", "Could you speak more slowly, please?"),
    ("Spanish", "We had dinner with our friends last night."), ("German", "The shop is closed on Sundays."),
    ("Italian", "I would like to visit Rome next year."), ("Dutch", "Good morning, how are you?"),
    ("Spanish", "The library is next to the school."), ("French", "It is raining again today."),
]
FOLLOW_UPS = ["Thanks! Can you say more, and give an example?", "Can you make that shorter?",
              "Interesting. What else should I know?", "Can you explain that in a different way?"]


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


def _code(tasks: list[str]) -> list[Prompt]:
    """Each task as a "write it" prompt, then each as an "explain it" prompt."""
    return ([Prompt("code", _user(f"Write a Python function that {task}.")) for task in tasks]
            + [Prompt("code", _user(f"Explain what a Python function that {task} does, step by step."))
               for task in tasks])


def _chat(topic: str, first: str, follow_up: str) -> Prompt:
    """A multi-turn chat: a first question, a short assistant turn about ``topic``, then the follow-up."""
    return Prompt("chat", (("user", first), ("assistant", f"Sure. Here is a short answer about {topic}."),
                           ("user", follow_up)))


def general_prompts() -> list[Prompt]:
    """Every prompt of the set, in a fixed order, each with its split."""
    out: list[Prompt] = []
    for domain, templates in TEMPLATES.items():
        out += [Prompt(domain, _user(tpl.format(t=t))) for t in TOPICS for tpl in templates]
    out += _code(CODE_TASKS)
    for ask in ("Summarise this text in two sentences:", "What is the main point of this text?"):
        out += [Prompt("summarisation", _user(f"{ask}\n\n{text}")) for text in SUMMARY_TEXTS]
    out += [Prompt("translation", _user(f"Translate into {lang}: {text}")) for lang, text in TRANSLATE]
    for i, t in enumerate(TOPICS):  # multi-turn: a first exchange, then a follow-up
        out.append(_chat(t, TEMPLATES["explanation"][i % 3].format(t=t), FOLLOW_UPS[0]))
    seen: dict[str, int] = {}
    for i, p in enumerate(out):
        n = seen[p.domain] = seen.get(p.domain, -1) + 1
        out[i] = dataclasses.replace(p, split="heldout" if n % 4 == 3 else "train")
    return out + train_only_prompts()


def train_only_prompts() -> list[Prompt]:
    """The train-only part: new topics under more templates, more code tasks, texts to summarise, sentences to
    translate and multi-turn chats; every one ``split="train"``, none equal to a prompt of the first part."""
    out: list[Prompt] = []
    for domain, new in NEW_TEMPLATES.items():
        out += [Prompt(domain, _user(tpl.format(t=t))) for t in TRAIN_TOPICS for tpl in TEMPLATES[domain] + new]
        out += [Prompt(domain, _user(tpl.format(t=t))) for t in TOPICS for tpl in new]
    out += _code(TRAIN_CODE_TASKS)
    asks = ("Summarise this text in two sentences:", "What is the main point of this text?",
            "Give this text a title and a one-line summary:")
    out += [Prompt("summarisation", _user(f"{ask}\n\n{text}")) for ask in asks for text in TRAIN_TEXTS]
    out += [Prompt("summarisation", _user(f"{asks[2]}\n\n{text}")) for text in SUMMARY_TEXTS]
    out += [Prompt("translation", _user(f"Translate into {lang}: {text}")) for lang, text in TRAIN_SENTENCES]
    firsts = TEMPLATES["explanation"] + NEW_TEMPLATES["explanation"]
    for i, t in enumerate(TRAIN_TOPICS):
        out.append(_chat(t, firsts[i % len(firsts)].format(t=t), FOLLOW_UPS[i % len(FOLLOW_UPS)]))
    return out


def heldout_prompts(per_domain: int | None = None) -> dict[str, list[Prompt]]:
    """The held-out split by domain (the first ``per_domain`` of each, when given)."""
    by: dict[str, list[Prompt]] = {}
    for p in general_prompts():
        if p.split == "heldout":
            by.setdefault(p.domain, []).append(p)
    return {d: ps[:per_domain] if per_domain else ps for d, ps in by.items()}
