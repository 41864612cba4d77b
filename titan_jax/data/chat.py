"""Conversations rendered with a checkpoint's own chat template, and which tokens are trained on.

`render_chat` gives the text transformers' `tokenizer.apply_chat_template(messages,
tokenize=False, ...)` gives: the same sandboxed Jinja environment (trim_blocks, lstrip_blocks,
loop controls, its `tojson`, `raise_exception`, `strftime_now`, `namespace`, `dict`, and the
`{% generation %}` tag as a no-op) and the same variables (`messages`, `tools`, `documents`,
`add_generation_prompt`, the named special tokens, extra keyword arguments). Messages are
normalized as transformers does: keys whose value is None are dropped, and reasoning given as
`thinking`/`reasoning` is also passed as `reasoning_content` (and the reverse as `thinking`).

`render_with_mask` tokenizes that text whole and marks the tokens the loss trains on: from the
end of each assistant turn's header (the template's generation prompt, `<|im_start|>assistant\\n`)
through the end-of-turn marker that closes it (`<|im_end|>`). Whitespace the template writes after
the marker (ChatML's newline) is not trained, the model stops at the marker, unless the tokenizer
joins it to the marker's last token (a vocabulary where `<|im_end|>` is not a special token).
Reasoning blocks and tool calls the template writes inside the turn are trained on with it.

Templates may rewrite earlier turns (Qwen3's drops the `<think>` block of assistant turns before
the last user query), so a turn is never located by rendering a prefix of the conversation.
Each assistant turn is found in the full rendering itself: the conversation is rendered again
with that one message's content replaced by a sentinel (and its reasoning removed); where the
two renderings differ is inside that turn. From there the turn's header is searched backwards and
its end marker forwards. The token ids are those of the whole text (as transformers tokenizes
it), and a token is trained on when its characters overlap a trained span: a token straddling
the header and the content (e.g. ` H` in "Assistant: Hello") is trained on, so no character
of the assistant's output is ever left out of the loss.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from titan_jax.data.tokenizer import Tokenizer, special_token
from titan_jax.errors import TitanJaxError

ROLES = ("system", "user", "assistant", "tool")
TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
# What to do when a checkpoint has no template; `directory` is the checkpoint's folder.
HINT_NO_TEMPLATE = (
    "add a chat_template to {directory}/tokenizer_config.json, "
    "or pass a template file with --training.chat_template FILE"
)
# The special tokens transformers passes to every template (its `special_tokens_map`).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Names a message's reasoning comes under; templates read the first.
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
# Stands in for one assistant message's content to find where the template writes it. Private
# use characters: no template strips, splits on or tests for them.
_SENTINEL = "\ue000titan-jax-assistant-content\ue001"


class ChatError(TitanJaxError, ValueError):
    """A conversation or chat template that cannot be rendered: one line naming what is wrong
    and where (the file and line of the conversation, when the caller gives them)."""


# ---------------------------------------------------------------------------------------------
# Loading a template


def load_chat_template(path: str) -> str:
    """The chat template of a HF checkpoint: `path` is its folder or tokenizer_config.json (a
    `chat_template.jinja` beside it wins over the config's entry, as in transformers), or a
    template file itself (any file not ending in .json)."""
    file = Path(path)
    if file.is_dir():
        directory, config = file, file / CONFIG_FILE
    elif file.is_file() and file.suffix == ".json":
        directory, config = file.parent, file
    elif file.is_file():
        return _checked_template(_read_text(file), str(file))
    else:
        raise ChatError(f"chat template path {path!r} does not exist")
    if (directory / TEMPLATE_FILE).is_file():
        return _checked_template(
            _read_text(directory / TEMPLATE_FILE), str(directory / TEMPLATE_FILE)
        )
    hint = HINT_NO_TEMPLATE.format(directory=directory)
    if not config.is_file():
        raise ChatError(
            f"no chat template in {str(directory)!r}: neither {TEMPLATE_FILE} nor "
            f"{CONFIG_FILE} is there; {hint}"
        )
    template = _read_config(config).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if isinstance(template, dict):
        if "default" not in template:
            raise ChatError(
                f"{str(config)!r}: chat_template names no 'default' template (it has "
                f"{sorted(map(str, template))}); pass one with "
                "--training.chat_template FILE"
            )
        template = template["default"]
    if template is None or (isinstance(template, str) and not template.strip()):
        raise ChatError(f"{str(config)!r} has no chat_template; {hint}")
    if not isinstance(template, str):
        raise ChatError(
            f"{str(config)!r}: chat_template is a {type(template).__name__}, "
            "not the template's text"
        )
    return template


def load_special_tokens(path: str) -> dict[str, str]:
    """The named special tokens (`eos_token`, ...) of a tokenizer_config.json, or of the one in
    folder `path`: what transformers passes to the template. {} when there is no config."""
    config = Path(path)
    if config.is_dir():
        config = config / CONFIG_FILE
    if not config.is_file():
        return {}
    values = _read_config(config)
    tokens = {name: special_token(values, name, str(config)) for name in SPECIAL_TOKEN_NAMES}
    return {name: token for name, token in tokens.items() if token is not None}


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ChatError(f"{str(file)!r} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ChatError(f"{str(file)!r} cannot be read: {e.strerror or e}") from None


def _read_config(file: Path) -> dict[str, Any]:
    try:
        config = json.loads(_read_text(file))
    except json.JSONDecodeError as e:
        raise ChatError(f"{str(file)!r} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ChatError(f"{str(file)!r} is not a JSON object")
    return config


def _checked_template(text: str, where: str) -> str:
    if not text.strip():
        raise ChatError(f"chat template file {where!r} is empty")
    return text


# ---------------------------------------------------------------------------------------------
# The Jinja environment (as transformers 5 builds it)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which transformers' templates may hold to mark
    the assistant's text: rendered as its body (the mask here is found from the text)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names: no way to reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # No named `self`, as Jinja's own: `namespace(self=...)` must still work.
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore names on a namespace ({name!r})"
            )


class _DictGlobal:
    """`dict(...)` for templates, without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &, '), which chat templates must not.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    # Templates come from checkpoints on the Hub: untrusted code, hence the sandbox.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    # Typed apart: jinja2 leaves `globals` unannotated, so its value type is inferred from
    # jinja2's own defaults (range, dict, ...) and would reject these.
    template_globals: dict[str, Any] = {
        "raise_exception": _raise_exception,
        "strftime_now": _strftime_now,
        "dict": _DictGlobal(),
        "namespace": _Namespace,
    }
    env.globals.update(template_globals)
    return env


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> jinja2.Template:
    return _environment().from_string(template)


def _compile(template: str) -> jinja2.Template:
    try:
        return _compiled(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatError(f"chat template line {e.lineno}: {_one_line(e.message or e)}") from None


# ---------------------------------------------------------------------------------------------
# Rendering


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    template: str,
    *,
    add_generation_prompt: bool = False,
    tools: Sequence[Mapping] | None = None,
    special_tokens: Mapping[str, str] | None = None,
    where: str = "",
    **template_kwargs: Any,
) -> str:
    """The conversation as `apply_chat_template(messages, tokenize=False, ...)` renders it;
    `special_tokens` are the template's `eos_token`, ... (see `load_special_tokens`), and
    `template_kwargs` other template variables (`enable_thinking=False`, ...)."""
    chat = _checked_messages(messages, "messages", where)
    return _Renderer(template, tools, special_tokens or {}, template_kwargs, where).render(
        chat, add_generation_prompt
    )


def render_with_mask(
    messages: Sequence[Mapping[str, Any]],
    template: str,
    tokenizer: Tokenizer,
    *,
    tools: Sequence[Mapping] | None = None,
    special_tokens: Mapping[str, str] | None = None,
    where: str = "",
    **template_kwargs: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """(token ids int64, trained bool) of the whole conversation: True on every assistant turn
    after its header, through its end-of-turn marker (module docstring). `special_tokens`
    default to the tokenizer's EOS and BOS as `eos_token`, `bos_token`."""
    chat = _checked_messages(messages, "messages", where)
    trained = [i for i, m in enumerate(chat) if m["role"] == "assistant"]
    if not trained:
        raise ChatError(f"{_prefix(where)}messages has no assistant message to train on")
    labels = [f"messages[{i}]" for i in range(len(chat))]
    return _ids_and_mask(
        chat, trained, labels, template, tokenizer, tools, special_tokens, template_kwargs, where
    )


def render_pair(
    prompt: str | Sequence[Mapping[str, Any]],
    completion: str | Sequence[Mapping[str, Any]],
    template: str,
    tokenizer: Tokenizer,
    *,
    tools: Sequence[Mapping] | None = None,
    special_tokens: Mapping[str, str] | None = None,
    where: str = "",
    completion_name: str = "completion",
    **template_kwargs: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """A prompt/completion pair as `render_with_mask` renders it, trained on the completion's
    assistant messages only. A string prompt is one user message, a string completion one
    assistant message; lists of messages are TRL's conversational prompt-completion form.
    `completion_name`: the completion's field, for messages (a preference pair's "chosen")."""
    prompt_chat = _checked_messages(_as_messages(prompt, "user"), "prompt", where)
    completion_chat = _checked_messages(
        _as_messages(completion, "assistant"), completion_name, where
    )
    trained = [
        len(prompt_chat) + i for i, m in enumerate(completion_chat) if m["role"] == "assistant"
    ]
    if not trained:
        raise ChatError(f"{_prefix(where)}{completion_name} has no assistant message to train on")
    labels = [f"prompt[{i}]" for i in range(len(prompt_chat))] + [
        f"{completion_name}[{i}]" for i in range(len(completion_chat))
    ]
    return _ids_and_mask(
        prompt_chat + completion_chat,
        trained,
        labels,
        template,
        tokenizer,
        tools,
        special_tokens,
        template_kwargs,
        where,
    )


class _Renderer:
    """One template with its variables, rendering conversations already checked."""

    def __init__(
        self,
        template: str,
        tools: Sequence[Mapping] | None,
        special_tokens: Mapping[str, str],
        template_kwargs: Mapping[str, Any],
        where: str,
    ):
        self.template = _compile(template)
        if tools is not None:
            if isinstance(tools, (str, Mapping)) or not isinstance(tools, Sequence):
                raise ChatError(f"{_prefix(where)}tools is not a list of JSON schemas")
            for i, tool in enumerate(tools):
                if not isinstance(tool, Mapping):
                    raise ChatError(
                        f"{_prefix(where)}tools[{i}] is not a JSON object (a {type(tool).__name__})"
                    )
        self.tools = _plain(tools)
        # As transformers: keyword arguments override special tokens of the same name.
        self.variables = _plain({**special_tokens, **template_kwargs})
        self.where = where

    def render(self, chat: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        try:
            return self.template.render(
                messages=chat,
                tools=self.tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.variables,
            )
        except (jinja2.TemplateError, TypeError) as e:
            raise ChatError(f"{_prefix(self.where)}chat template error: {_one_line(e)}") from None


def _ids_and_mask(
    chat: list[dict[str, Any]],
    trained: list[int],
    labels: list[str],
    template: str,
    tokenizer: Tokenizer,
    tools: Sequence[Mapping] | None,
    special_tokens: Mapping[str, str] | None,
    template_kwargs: Mapping[str, Any],
    where: str,
) -> tuple[np.ndarray, np.ndarray]:
    if special_tokens is None:
        special_tokens = {"eos_token": tokenizer.decode([tokenizer.eos_id])}
        if tokenizer.bos_id is not None:
            special_tokens["bos_token"] = tokenizer.decode([tokenizer.bos_id])
    renderer = _Renderer(template, tools, special_tokens, template_kwargs, where)
    text = renderer.render(chat)
    header, closing = _turn_markers(renderer, chat, trained[0])
    regions = [
        _assistant_region(renderer, chat, k, text, f"{_prefix(where)}{labels[k]}") for k in trained
    ]
    spans, floor = [], 0
    for i, (k, (start, stop)) in enumerate(zip(trained, regions, strict=True)):
        at = f"{_prefix(where)}{labels[k]}"
        if start < floor:
            raise ChatError(
                f"{at}: the chat template writes it before the assistant turn it "
                "follows; its tokens cannot be told apart"
            )
        limit = regions[i + 1][0] if i + 1 < len(regions) else len(text)
        begin = _header_end(text, header, floor, start)
        if begin is None:
            raise ChatError(
                f"{at}: the rendering has no assistant header {header!r} (the "
                "template's generation prompt) before its content"
            )
        end = stop
        if closing:
            end = text.find(closing, stop, limit)
            if end < 0:
                raise ChatError(
                    f"{at}: the rendering has no end-of-turn marker {closing!r} after its content"
                )
            end += len(closing)
        spans.append((begin, end))
        floor = end

    token_ids, token_offsets = tokenizer.encode_with_offsets(text)
    ids = np.asarray(token_ids, dtype=np.int64)
    offsets = np.asarray(token_offsets, dtype=np.int64).reshape(-1, 2)
    starts = offsets[:, 0]
    ends = np.maximum(offsets[:, 1], starts + 1)  # a zero-width token counts where it starts
    mask = np.zeros(len(ids), dtype=bool)
    for begin, end in spans:
        mask |= (starts < end) & (ends > begin)
    return ids, mask


def _turn_markers(renderer: _Renderer, chat: list[dict[str, Any]], first: int) -> tuple[str, str]:
    """(header, closing): what the template writes before an assistant turn's content when
    asked for a generation prompt, and what it writes after that content whether the turn ends
    the conversation or a user turn follows (trailing whitespace dropped), both learned on the
    conversation up to its first trained turn."""
    before = chat[:first] or [{"role": "user", "content": "Hi"}]
    bare, prompted = renderer.render(before), renderer.render(before, add_generation_prompt=True)
    where = _prefix(renderer.where)
    if not prompted.startswith(bare) or prompted == bare:
        raise ChatError(
            f"{where}the chat template writes no generation prompt "
            "(add_generation_prompt), so the assistant's header cannot be told from "
            "its content"
        )
    answered = before + [{"role": "assistant", "content": _SENTINEL}]
    last = renderer.render(answered)
    followed = renderer.render(answered + [{"role": "user", "content": "Thanks"}])
    if _SENTINEL not in last or _SENTINEL not in followed:
        raise ChatError(f"{where}the chat template does not write an assistant message's content")
    after_last = last[last.rindex(_SENTINEL) + len(_SENTINEL) :]
    after_followed = followed[followed.rindex(_SENTINEL) + len(_SENTINEL) :]
    # Their common start: not what the template writes once after the final message, nor the
    # next turn's header.
    closing = after_last[: _common_prefix(after_last, after_followed)].rstrip()
    return prompted[len(bare) :], closing


def _assistant_region(
    renderer: _Renderer, chat: list[dict[str, Any]], k: int, text: str, at: str
) -> tuple[int, int]:
    """Where in `text` assistant message `k`'s content and reasoning are written: the part that
    changes when they are replaced by a sentinel (empty, at its place, if there are none)."""
    changed = {key: value for key, value in chat[k].items() if key not in REASONING_KEYS}
    changed["content"] = _SENTINEL
    probe = renderer.render(chat[:k] + [changed] + chat[k + 1 :])
    if probe == text:
        raise ChatError(f"{at}: the chat template does not write this assistant message's content")
    head = _common_prefix(text, probe)
    tail = _common_suffix(text, probe, min(len(text), len(probe)) - head)
    return head, len(text) - tail


def _header_end(text: str, header: str, lo: int, hi: int) -> int | None:
    """Where the last header in text[lo:hi] ends. A generation prompt can force a start of the
    content (Qwen3's `<think>\\n\\n</think>\\n\\n` with enable_thinking=False) that turns
    rendered from history lack; then the longest of its prefixes that ends in whitespace."""
    cuts = [len(header)] + [i + 1 for i in range(len(header) - 2, -1, -1) if header[i].isspace()]
    for cut in cuts:
        at = text.rfind(header[:cut], lo, hi)
        if at >= 0:
            return at + cut
    return None


def _common_prefix(a: str, b: str) -> int:
    # Bisection on slice equality: C-speed comparisons rather than a Python loop per character.
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str, limit: int) -> int:
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid :] == b[len(b) - mid :]:
            lo = mid
        else:
            hi = mid - 1
    return lo


# ---------------------------------------------------------------------------------------------
# Checking messages


def _as_messages(value: Any, role: str) -> Any:
    return [{"role": role, "content": value}] if isinstance(value, str) else value


def _checked_messages(messages: Any, name: str, where: str) -> list[dict[str, Any]]:
    """Plain copies of the messages, normalized as transformers does, after checking each has a
    known role and string content (an assistant message may have tool_calls instead)."""
    at = _prefix(where)
    if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence):
        raise ChatError(f"{at}{name} is not a list of messages (a {type(messages).__name__})")
    if not messages:
        raise ChatError(f"{at}{name} is empty: a conversation needs at least one message")
    chat = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatError(f"{at}{name}[{i}] is not a message object (a {type(message).__name__})")
        # transformers drops None values: templates test for a key, and would render "None".
        message = {k: v for k, v in _plain(message).items() if v is not None}
        role = message.get("role")
        if role not in ROLES:
            raise ChatError(f"{at}{name}[{i}] has role {role!r}; valid roles: {', '.join(ROLES)}")
        content = message.get("content")
        tool_calls = role == "assistant" and bool(message.get("tool_calls"))
        if not isinstance(content, str) and not (content is None and tool_calls):
            got = "none" if content is None else f"a {type(content).__name__}"
            needs = (
                "string 'content' or 'tool_calls'" if role == "assistant" else "string 'content'"
            )
            raise ChatError(f"{at}{name}[{i}] ({role}) needs a {needs}; it has {got}")
        reasoning = next((message[k] for k in REASONING_KEYS if k in message), None)
        if reasoning is not None:  # as transformers: under the name each template family reads
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    return chat


def _plain(value: Any) -> Any:
    """A copy made of plain JSON types only: what the sandbox may see, and the caller's
    messages are never changed by the copies edited here."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _prefix(where: str) -> str:
    return f"{where}: " if where else ""


def _one_line(error: object) -> str:
    return " ".join(str(error).split())
