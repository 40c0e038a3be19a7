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
