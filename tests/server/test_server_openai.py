"""The OpenAI API through the official ``openai`` client: completions and chat, streaming and not, usage,
stop strings, finish reasons and the model list."""

from __future__ import annotations

import openai
import pytest
from fake_engine import CharTokenizer, expected_text

PROMPT = "Say something:"
CHAT_PROMPT = "<|user|>hello\n<|assistant|>"


def test_models_list(oai: openai.OpenAI) -> None:
    models = oai.models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    assert oai.models.retrieve("fake-model").id == "fake-model"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4")


def test_completion(oai: openai.OpenAI) -> None:
    out = oai.completions.create(model="fake-model", prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text == expected_text(PROMPT, 12)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(PROMPT.encode()) + 1  # BOS
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert out.model == "fake-model"


def test_completion_default_model_and_token_prompt(oai: openai.OpenAI) -> None:
    ids = CharTokenizer().encode(PROMPT, add_special_tokens=True)
    out = oai.completions.create(model="default", prompt=ids, max_tokens=5)
    assert out.choices[0].text == expected_text(PROMPT, 5)


def test_completion_stop_string(oai: openai.OpenAI) -> None:
    full = expected_text(PROMPT, 20)
    stop = full[6:9]
    out = oai.completions.create(model="fake-model", prompt=PROMPT, max_tokens=20, stop=[stop, "zzzz"])
    assert out.choices[0].text == full[:6]
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["matched_stop"] == stop


def test_completion_stream_with_usage(oai: openai.OpenAI) -> None:
    full = expected_text(PROMPT, 20)
    stream = oai.completions.create(
        model="fake-model",
        prompt=PROMPT,
        max_tokens=20,
        stream=True,
        stop=full[10:12],
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in content) == full[:10]
    assert content[-1].choices[0].finish_reason == "stop"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert len({c.id for c in chunks}) == 1
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 12
    assert usage.usage.prompt_tokens == len(PROMPT.encode()) + 1


def test_completion_stream_without_usage(oai: openai.OpenAI) -> None:
    chunks = list(oai.completions.create(model="fake-model", prompt=PROMPT, max_tokens=8, stream=True))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == expected_text(PROMPT, 8)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat(oai: openai.OpenAI) -> None:
    out = oai.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "hello"}],
        max_completion_tokens=9,
        temperature=0,
        seed=1,
    )
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected_text(CHAT_PROMPT, 9, chat=True)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(CHAT_PROMPT.encode())
    assert out.usage.completion_tokens == 9


def test_chat_content_parts_and_max_tokens(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    out = oai.chat.completions.create(model="fake-model", messages=messages, max_tokens=4)
    assert out.choices[0].message.content == expected_text(CHAT_PROMPT, 4, chat=True)


def test_chat_template_kwargs(oai: openai.OpenAI) -> None:
    out = oai.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=5,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert out.choices[0].message.content == expected_text(
        "<|enable_thinking=False|>" + CHAT_PROMPT, 5, chat=True
    )


def test_chat_stream(oai: openai.OpenAI) -> None:
    full = expected_text(CHAT_PROMPT, 15, chat=True)
    stream = oai.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=15,
        stream=True,
        stop=full[5:7],
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full[:5]
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].object == "chat.completion.chunk"


def test_finish_reason_stop_on_eos(server_factory) -> None:
    from fake_engine import FakeEngine

    running = server_factory(lambda args: FakeEngine(eos_after=3))
    client = openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0)
    out = client.completions.create(model="fake-model", prompt=PROMPT, max_tokens=10)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == expected_text(PROMPT, 3)
    ignored = client.completions.create(
        model="fake-model", prompt=PROMPT, max_tokens=10, extra_body={"ignore_eos": True}
    )
    assert ignored.choices[0].finish_reason == "length"
    assert ignored.choices[0].text == expected_text(PROMPT, 10)
