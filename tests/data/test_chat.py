"""Chat templates: rendering equal to transformers' `apply_chat_template` (text and token ids),
the assistant-token mask (also where a template rewrites earlier turns), loading templates, and
the one-line errors of bad conversations."""

import json

import numpy as np
import pytest
import tokenizers

from titan_jax.data.chat import (
    HINT_NO_TEMPLATE,
    ChatError,
    load_chat_template,
    load_special_tokens,
    render_chat,
    render_pair,
    render_with_mask,
)
from titan_jax.data.tokenizer import Tokenizer, load_tokenizer

SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
SPECIAL_TOKENS = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}

# Plain ChatML: every message is `<|im_start|>{role}\n{content}<|im_end|>\n`.
CHATML = """\
{%- for message in messages %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# ChatML as Qwen3 extends it (written for these tests): tools listed in the system turn,
# `<think>` blocks kept only for assistant turns after the last user query (from
# `reasoning_content`, or split out of inline `<think>...</think>` content), `<tool_call>` JSON
# blocks, and consecutive tool results wrapped in one user turn.
QWEN3_STYLE = """\
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nThese functions can be called:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nTo call one, answer with <tool_call></tool_call> tags around '
        '{"name": ..., "arguments": ...}.<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
        {%- continue %}
    {%- endif %}
    {%- if message.role in ('user', 'system') %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set answer = message.content if message.content is string else '' %}
        {%- set thought = message.reasoning_content if message.reasoning_content is string
            else '' %}
        {%- if not thought and '</think>' in answer %}
            {%- set thought = answer.split('</think>')[0].split('<think>')[-1] %}
            {%- set answer = answer.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if loop.index0 > ns.last_query and (loop.last or thought) %}
            {{- '<think>\\n' + thought.strip('\\n') + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- answer }}
        {%- for call in message.tool_calls or [] %}
            {%- set fn = call.function if call.function is defined else call %}
            {%- if answer or not loop.first %}
                {{- '\\n' }}
            {%- endif %}
            {{- '<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
            {{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# Plain-text roles, the special tokens as variables, and the rest of the environment: the
# {% generation %} tag, dict(), namespace, loop controls, tojson's arguments, strftime_now.
PLAIN = """\
{{- bos_token }}
{%- set seen = namespace(n=0) %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {{- 'System (' + strftime_now('%Y')[:2] + '): ' + message.content + '\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- 'Assistant: ' }}{% generation %}{{ message.content + eos_token }}{% endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {%- set seen.n = seen.n + 1 %}
        {{- message.role | capitalize + ' #' + seen.n | string + ': ' + message.content + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if tools %}
    {%- for tool in tools %}
        {%- if loop.index > 1 %}{% break %}{% endif %}
        {%- set shown = dict(name=tool.function.name, n=1) %}
        {{- 'Tool: ' + shown | tojson(indent=2, sort_keys=True) + '\\n' }}
    {%- endfor %}
{%- endif %}
{%- if add_generation_prompt %}
    {{- 'Assistant: ' }}
{%- endif %}
"""

# ChatML whose assistant content and end marker are in {% generation %}: transformers' own
# assistant mask (return_assistant_tokens_mask) then marks what ours must.
CHATML_GENERATION = """\
{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}{{- message.content + '<|im_end|>' }}{%- endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather now in a city — °C",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            },
        },
    },
]


def call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


SYSTEM_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "Seven."},
]
MULTI_TURN = [
    {"role": "user", "content": "Hi there!"},
    {"role": "assistant", "content": "Hello. How can I help?"},
    {"role": "user", "content": "Say 'héllo wörld, 世界 🙂'."},
    {"role": "assistant", "content": "héllo wörld, 世界 🙂"},
]
# Earlier reasoning is dropped by QWEN3_STYLE (it precedes the last user query), the last kept.
THINKING = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4.", "reasoning_content": "Two and two make four."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6.", "reasoning_content": "\nThree and three: six.\n"},
]
INLINE_THINKING = [
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "<think>\nIt is Paris.\n</think>\n\nParis."},
    {"role": "user", "content": "Of Italy?"},
    {"role": "assistant", "content": "<think>\nRome, surely.\n</think>\n\nRome."},
]
# A multi-step tool call: reasoning before the call, two results in one user turn, content None
# on a tool-call-only message (dropped, as transformers drops None values), then a new query.
TOOL_CHAT = [
    {"role": "system", "content": "Use tools when useful."},
    {"role": "user", "content": "Weather in Paris, and 2+3?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I need two tools.",
        "tool_calls": [call("get_weather", {"city": "Paris"}), call("add", '{"a": 2, "b": 3}')],
    },
    {"role": "tool", "content": "18 °C, sunny"},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "Paris: 18 °C and sunny; 2+3 = 5."},
    {"role": "user", "content": "And in Rome?"},
    {
        "role": "assistant",
        "content": None,
        "thinking": "Call it again.",
        "tool_calls": [call("get_weather", {"city": "Rome"})],
    },
    {"role": "tool", "content": "21 °C"},
    {"role": "assistant", "content": "Rome: 21 °C."},
]
CHATS = {
    "system": SYSTEM_CHAT,
    "multi_turn": MULTI_TURN,
    "thinking": THINKING,
    "inline_thinking": INLINE_THINKING,
    "tools": TOOL_CHAT,
}


@pytest.fixture(scope="module")
def raw_tokenizer():
    raw = tokenizers.Tokenizer.from_str(load_tokenizer("").to_json())
    raw.add_special_tokens(SPECIALS)
    return raw


@pytest.fixture(scope="module")
def tok(raw_tokenizer):
    return Tokenizer(
        raw_tokenizer,
        eos_id=raw_tokenizer.token_to_id("<|im_end|>"),
        bos_id=raw_tokenizer.token_to_id("<|endoftext|>"),
    )


@pytest.fixture(scope="module")
def hf(raw_tokenizer):
    """transformers' tokenizer over the same vocabulary, with the same special tokens."""
    transformers = pytest.importorskip("transformers")  # the `parity` extra; CI installs it
    copy = tokenizers.Tokenizer.from_str(raw_tokenizer.to_str())
    return transformers.PreTrainedTokenizerFast(tokenizer_object=copy, **SPECIAL_TOKENS)


def hf_render(hf, messages, template, **kwargs):
    text = hf.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)
    ids = hf.apply_chat_template(
        messages, chat_template=template, tokenize=True, return_dict=False, **kwargs
    )
    return text, list(ids)


def trained_runs(tok, ids, mask):
    """The decoded text of each run of trained tokens, in order."""
    runs, current = [], []
    for token, trained in zip(ids.tolist(), mask.tolist(), strict=True):
        if trained:
            current.append(token)
        elif current:
            runs.append(tok.decode(current))
            current = []
    if current:
        runs.append(tok.decode(current))
    return runs


# ---------------------------------------------------------------------------------------------
# Rendering equal to transformers


@pytest.mark.parametrize(
    "template",
    [CHATML, QWEN3_STYLE, PLAIN, CHATML_GENERATION],
    ids=["chatml", "qwen3_style", "plain", "chatml_generation"],
)
@pytest.mark.parametrize("name", list(CHATS))
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_render_equals_transformers(hf, tok, template, name, generation_prompt):
    messages = CHATS[name]
    tools = TOOLS if name == "tools" else None
    if template is not QWEN3_STYLE and name == "tools":
        # Templates without tool support read content only: drop the tool-call-only messages.
        messages = [m for m in messages if m.get("content")]
    if generation_prompt:
        messages = messages[:-1]  # ends with a user or tool turn, as at inference
    want_text, want_ids = hf_render(
        hf, messages, template, tools=tools, add_generation_prompt=generation_prompt
    )
    text = render_chat(
        messages,
        template,
        tools=tools,
        add_generation_prompt=generation_prompt,
        special_tokens=SPECIAL_TOKENS,
    )
    assert text == want_text
    assert tok.encode(text) == want_ids
    if not generation_prompt:
        ids, mask = render_with_mask(
            messages, template, tok, tools=tools, special_tokens=SPECIAL_TOKENS
        )
        assert ids.dtype == np.int64 and mask.dtype == np.bool_ and ids.shape == mask.shape
        assert ids.tolist() == want_ids


def test_template_kwargs_and_default_special_tokens(hf, tok):
    # enable_thinking=False adds an empty think block to the generation prompt.
    for enable_thinking in (True, False):
        want, _ = hf_render(
            hf,
            THINKING[:3],
            QWEN3_STYLE,
            add_generation_prompt=True,
            enable_thinking=enable_thinking,
        )
        got = render_chat(
            THINKING[:3], QWEN3_STYLE, add_generation_prompt=True, enable_thinking=enable_thinking
        )
        assert got == want
    assert want.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # Without special_tokens the mask functions pass the tokenizer's EOS and BOS, as named.
    want_text, want_ids = hf_render(hf, SYSTEM_CHAT, PLAIN)
    assert want_text.startswith("<|endoftext|>") and "Seven.<|im_end|>" in want_text
    ids, _ = render_with_mask(SYSTEM_CHAT, PLAIN, tok)
    assert ids.tolist() == want_ids
    # And the caller's messages are never changed (the None content, the reasoning aliases).
    before = json.dumps(TOOL_CHAT)
    render_with_mask(TOOL_CHAT, QWEN3_STYLE, tok, tools=TOOLS)
    assert json.dumps(TOOL_CHAT) == before


# ---------------------------------------------------------------------------------------------
# The mask


def test_mask_chatml_trains_content_and_end_marker_only(tok):
    ids, mask = render_with_mask(MULTI_TURN, CHATML, tok)
    assert trained_runs(tok, ids, mask) == [
        "Hello. How can I help?<|im_end|>",
        "héllo wörld, 世界 🙂<|im_end|>",
    ]
    # The headers, the user turns and the newline after each end marker are context.
    untrained = tok.decode(ids[~mask].tolist())
    assert untrained == (
        "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n\n"
        "<|im_start|>user\nSay 'héllo wörld, 世界 🙂'.<|im_end|>\n"
        "<|im_start|>assistant\n\n"
    )


def test_mask_keeps_up_when_the_template_drops_earlier_thinking(tok):
    # The first turn's reasoning is not in the rendering (it precedes the last user query), so
    # the rendering of the first two messages is not a prefix of the whole one.
    ids, mask = render_with_mask(THINKING, QWEN3_STYLE, tok)
    assert "Two and two" not in tok.decode(ids.tolist())
    assert trained_runs(tok, ids, mask) == [
        "4.<|im_end|>",
        "<think>\nThree and three: six.\n</think>\n\n6.<|im_end|>",
    ]
    ids, mask = render_with_mask(INLINE_THINKING, QWEN3_STYLE, tok)
    assert trained_runs(tok, ids, mask) == [
        "Paris.<|im_end|>",
        "<think>\nRome, surely.\n</think>\n\nRome.<|im_end|>",
    ]


def test_mask_tool_calls_and_results(tok):
    ids, mask = render_with_mask(TOOL_CHAT, QWEN3_STYLE, tok, tools=TOOLS)
    assert trained_runs(tok, ids, mask) == [
        # Before the last user query: reasoning dropped, the calls kept.
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
        "Paris: 18 °C and sunny; 2+3 = 5.<|im_end|>",
        # After it: the reasoning (given as `thinking`) is written and trained on.
        '<think>\nCall it again.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Rome"}}\n</tool_call><|im_end|>',
        "<think>\n\n</think>\n\nRome: 21 °C.<|im_end|>",
    ]
    text = tok.decode(ids[~mask].tolist())
    assert "<tool_response>\n18 °C, sunny\n</tool_response>" in text  # results are context
    assert "# Tools" in text and "get_weather" in text


def test_mask_equals_transformers_generation_mask(hf, tok):
    # Where the template marks the assistant's text itself, transformers' mask is ours.
    for messages in (SYSTEM_CHAT, MULTI_TURN, INLINE_THINKING):
        out = hf.apply_chat_template(
            messages,
            chat_template=CHATML_GENERATION,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        ids, mask = render_with_mask(messages, CHATML_GENERATION, tok)
        assert ids.tolist() == list(out["input_ids"])
        assert mask.astype(int).tolist() == list(out["assistant_masks"])


def test_mask_token_straddling_header_and_content_is_trained(tok):
    # "Assistant: " then "Seven.": the tokenizer joins the space to the word (" Seven"), so
    # that token straddles the header's end and is trained on: no output character is lost.
    ids, mask = render_with_mask(SYSTEM_CHAT, PLAIN, tok, special_tokens=SPECIAL_TOKENS)
    assert trained_runs(tok, ids, mask) == [" Seven.<|im_end|>"]
    assert tok.decode(ids.tolist()).endswith("Assistant: Seven.<|im_end|>\n")
    # Why the whole text is tokenized and split by character offsets: tokenizing header and
    # content apart gives other tokens than the rendering's.
    assert tok.encode("Assistant: ") + tok.encode("Seven.") != tok.encode("Assistant: Seven.")


def test_mask_non_thinking_generation_prompt(tok):
    # enable_thinking=False: the prompt forces an empty think block that history turns lack;
    # the header found for those is the prompt's `<|im_start|>assistant\n` part.
    ids, mask = render_with_mask(
        THINKING[:2]
        + [{"role": "user", "content": "ok?"}, {"role": "assistant", "content": "Yes."}],
        QWEN3_STYLE,
        tok,
        enable_thinking=False,
    )
    assert trained_runs(tok, ids, mask) == ["4.<|im_end|>", "Yes.<|im_end|>"]


def test_render_pair(tok):
    want = render_with_mask(
        [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven."}],
        CHATML,
        tok,
    )
    got = render_pair("Name a prime.", "Seven.", CHATML, tok)
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
    # Conversational form: only the completion's assistant messages are trained on, not a
    # few-shot assistant turn in the prompt nor a tool result in the completion.
    prompt = MULTI_TURN[:3]
    completion = [
        {"role": "assistant", "content": "", "tool_calls": [call("add", {"a": 1, "b": 2})]},
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "It is 3."},
    ]
    ids, mask = render_pair(prompt, completion, QWEN3_STYLE, tok, tools=TOOLS[1:])
    assert trained_runs(tok, ids, mask) == [
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>',
        "<think>\n\n</think>\n\nIt is 3.<|im_end|>",
    ]
    assert "Hello. How can I help?" in tok.decode(ids[~mask].tolist())


# ---------------------------------------------------------------------------------------------
# Loading templates


def test_load_chat_template(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": CHATML,
                "eos_token": {"content": "<|im_end|>"},
                "bos_token": None,
                "pad_token": "<|endoftext|>",
            }
        )
    )
    assert load_chat_template(str(tmp_path)) == CHATML
    assert load_chat_template(str(tmp_path / "tokenizer_config.json")) == CHATML
    assert load_special_tokens(str(tmp_path)) == {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
    }
    # A chat_template.jinja beside the config wins over its entry, as in transformers.
    (tmp_path / "chat_template.jinja").write_text(QWEN3_STYLE)
    assert load_chat_template(str(tmp_path)) == QWEN3_STYLE
    assert load_chat_template(str(tmp_path / "tokenizer_config.json")) == QWEN3_STYLE
    assert load_chat_template(str(tmp_path / "chat_template.jinja")) == QWEN3_STYLE
    # Named templates: "default" is the one.
    named = tmp_path / "named"
    named.mkdir()
    (named / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [
                    {"name": "tool_use", "template": QWEN3_STYLE},
                    {"name": "default", "template": CHATML},
                ]
            }
        )
    )
    assert load_chat_template(str(named)) == CHATML


def test_load_chat_template_errors(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    hint = HINT_NO_TEMPLATE.format(directory=tmp_path)
    with pytest.raises(ChatError) as e:
        load_chat_template(str(tmp_path))
    assert (
        str(e.value) == f"{str(tmp_path / 'tokenizer_config.json')!r} has no chat_template; {hint}"
    )
    assert "--training.chat_template FILE" in hint
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ChatError, match="neither chat_template.jinja nor tokenizer_config.json"):
        load_chat_template(str(empty))
    with pytest.raises(ChatError, match="does not exist"):
        load_chat_template(str(tmp_path / "missing"))
    (empty / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "tool_use", "template": CHATML}]})
    )
    with pytest.raises(ChatError, match=r"names no 'default' template \(it has \['tool_use'\]\)"):
        load_chat_template(str(empty))
    (empty / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ChatError, match="is not valid JSON"):
        load_chat_template(str(empty))


# ---------------------------------------------------------------------------------------------
# Bad input: one line each


RAISING = (
    "{%- if messages[0].role != 'user' %}{{ raise_exception('Conversations must start\\n"
    "with a user message') }}{% endif %}" + CHATML
)


@pytest.mark.parametrize(
    "messages, template, message",
    [
        (
            [],
            CHATML,
            r"^data.jsonl:7: messages is empty: a conversation needs at least one message$",
        ),
        ("hello", CHATML, r"^data.jsonl:7: messages is not a list of messages \(a str\)$"),
        (
            [{"role": "user", "content": "Hi"}],
            CHATML,
            r"^data.jsonl:7: messages has no assistant message to train on$",
        ),
        (
            [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Hey"}],
            CHATML,
            r"^data.jsonl:7: messages\[1\] has role 'bot'; valid roles: system, "
            r"user, assistant, tool$",
        ),
        (
            [{"role": "user", "content": ["Hi"]}, {"role": "assistant", "content": "Hey"}],
            CHATML,
            r"^data.jsonl:7: messages\[0\] \(user\) needs a string 'content'; it has a list$",
        ),
        (
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}],
            CHATML,
            r"^data.jsonl:7: messages\[1\] \(assistant\) needs a string 'content' or 'tool_calls'; "
            r"it has none$",
        ),
        (
            [{"role": "user", "content": "Hi"}, "Hey"],
            CHATML,
            r"^data.jsonl:7: messages\[1\] is not a message object \(a str\)$",
        ),
        (
            [{"role": "system", "content": "Be brief."}, {"role": "assistant", "content": "Hey"}],
            RAISING,
            r"^data.jsonl:7: chat template error: Conversations must start with a user "
            r"message$",
        ),
        (
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey"}],
            "{% for m in messages %}{{ m.content }",
            r"^chat template line 1: unexpected '}'",
        ),
    ],
)
def test_bad_conversations(tok, messages, template, message):
    with pytest.raises(ChatError, match=message) as e:
        render_with_mask(messages, template, tok, where="data.jsonl:7")
    assert "\n" not in str(e.value)


def test_bad_pairs_and_tools(tok):
    with pytest.raises(ChatError, match=r"^completion has no assistant message to train on$"):
        render_pair("Hi", [{"role": "user", "content": "Hey"}], CHATML, tok)
    with pytest.raises(ChatError, match=r"^x:2: prompt\[0\] has role 'human'; valid roles"):
        render_pair([{"role": "human", "content": "Hi"}], "Hey", CHATML, tok, where="x:2")
    with pytest.raises(ChatError, match=r"^x:2: completion is empty"):
        render_pair("Hi", [], CHATML, tok, where="x:2")
    with pytest.raises(ChatError, match=r"^tools\[0\] is not a JSON object \(a str\)$"):
        render_with_mask(SYSTEM_CHAT, QWEN3_STYLE, tok, tools=["get_weather"])
    # A template that writes no generation prompt leaves the header unknown.
    no_prompt = "{% for m in messages %}{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}"
    with pytest.raises(ChatError, match=r"writes no generation prompt \(add_generation_prompt\)"):
        render_with_mask(SYSTEM_CHAT, no_prompt, tok)
    # The sandbox holds: no underscore attributes, no namespace internals.
    with pytest.raises(
        ChatError,
        match=r"^chat template error: access to attribute '__class__' "
        r"of 'list' object is unsafe\.$",
    ):
        render_chat(SYSTEM_CHAT, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatError, match="attribute 'append' of 'list' object is unsafe"):
        render_chat(SYSTEM_CHAT, "{{ messages.append(1) }}")
    with pytest.raises(ChatError, match="cannot set underscore names on a namespace"):
        render_chat(SYSTEM_CHAT, "{% set ns = namespace(_x=1) %}")
