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
