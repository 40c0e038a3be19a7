"""The general prompt set: seven domains, a stable held-out split of every domain."""

from baton.train.prompts import general_prompts, heldout_prompts

DOMAINS = {"writing", "explanation", "lists", "code", "summarisation", "translation", "chat"}


def test_every_domain_has_train_and_heldout_prompts():
    prompts = general_prompts()
    assert {p.domain for p in prompts} == DOMAINS
    for d in DOMAINS:
        splits = [p.split for p in prompts if p.domain == d]
        assert splits.count("heldout") >= 2 and splits.count("train") >= 5, d
    assert len({p.messages for p in prompts}) == len(prompts)  # no prompt twice (so none is in both splits)


def test_the_split_is_every_fourth_prompt_of_a_domain_and_stable():
    writing = [p for p in general_prompts() if p.domain == "writing"]
    assert [p.split for p in writing[:8]] == ["train"] * 3 + ["heldout"] + ["train"] * 3 + ["heldout"]
    assert writing[3].messages == (("user", "Write a short story about the water cycle."),)


def test_heldout_by_domain_and_chat_messages():
    held = heldout_prompts(per_domain=2)
    assert set(held) == DOMAINS and all(len(v) == 2 for v in held.values())
    chat = heldout_prompts()["chat"][0].chat
    assert [m["role"] for m in chat] == ["user", "assistant", "user"]


def test_extra_prompts_general_is_the_train_split_only():
    """`baton train data --extra-prompts general`: every train prompt of the set as a chat, no held-out one (the
    domain benchmark measures on those)."""
    from baton.train.data import DataOptions, _work, load_extra, plan_jobs

    items = load_extra("general")
    train = [p for p in general_prompts() if p.split == "train"]
    assert len(items) == len(train) and all(it.messages for it in items)
    held = {tuple((m["role"], m["content"]) for m in p.chat) for p in general_prompts() if p.split == "heldout"}
    assert not held & {tuple((m["role"], m["content"]) for m in it.messages) for it in items}
    assert {it.source for it in items} == {f"general/{d}" for d in DOMAINS}
    jobs = plan_jobs(DataOptions(output="o.jsonl", extra_prompts="general", num_extra_prompts=5,
                                 prompt_formats=("plain", "fewshot")), tokenizer=None)
    assert [it.prompt_id for it in jobs.items] == [it.prompt_id for it in items[:5]]
    # a chat renders the same in every format: one job each, not one per format
    assert [(i, f) for i, _, f, _ in _work(jobs)] == [(i, 0) for i in range(5)]


def test_train_only_part_leaves_the_heldout_split_and_indices_alone():
    """The train-only prompts come after the first part, are never held out and repeat none of its prompts, so
    every earlier prompt keeps its index (the data's prompt ids) and its split."""
    from baton.train.prompts import train_only_prompts

    prompts, extra = general_prompts(), train_only_prompts()
    first = prompts[: len(prompts) - len(extra)]
    assert prompts[len(first):] == extra and all(p.split == "train" for p in extra)
    assert len(first) == 340 and sum(p.split == "heldout" for p in first) == 83
    assert {d: len(v) for d, v in heldout_prompts().items()} == {
        "writing": 22, "explanation": 22, "lists": 22, "code": 6, "summarisation": 2, "translation": 2, "chat": 7}
    assert not {p.messages for p in first} & {p.messages for p in extra}
    assert {p.domain for p in extra} == DOMAINS
