"""A model directory's own chat template (Jinja), rendered as transformers renders it, and the
messages it is rendered from.

A template comes from `chat_template.jinja` in the directory, else `chat_template` in
tokenizer_config.json: a string, or a list of {"name", "template"} of which the one named
"default" is used (transformers 5.24: a separate file wins over the config). Chat templates from
the Hub are untrusted code, so they run in Jinja's immutable sandbox, with what transformers'
`_compile_jinja_template` gives them: trim_blocks, lstrip_blocks, the loopcontrols extension, a
`tojson` filter that leaves non-ASCII and HTML characters alone, and the globals
`raise_exception(message)` and `strftime_now(format)`. A render sees `messages`,
`add_generation_prompt`, `tools=None`, `documents=None` and the special-token names
(`bos_token`, `eos_token`, ...); no tool calls, no `{% generation %}` masks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant")
Message = dict[str, str]


def load_chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    """The template source of directory `path` (config: its tokenizer_config.json), or None."""
    file = path / "chat_template.jinja"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    where = path / "tokenizer_config.json"
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {e.get("name"): e.get("template") for e in value if isinstance(e, dict)}
        if len(named) != len(value) or not all(isinstance(t, str) for t in named.values()):
            raise ValueError(
                f"{where}: chat_template as a list must hold {{'name': str, 'template': str}} "
                f"objects, got {str(value)[:80]!r}"
            )
        if "default" not in named:
            raise ValueError(
                f"{where}: chat_template lists {sorted(map(str, named))} but none named "
                "'default', the one rheo-engine renders; name one 'default'"
            )
        return named["default"]
    raise ValueError(
        f"{where}: chat_template must be a string or a list of {{name, template}}, got "
        f"{type(value).__name__}"
    )


class ChatTemplate:
    """One compiled Jinja chat template; `render` raises ValueError, never jinja2's errors."""

    def __init__(self, source: str, name: str, special_tokens: Mapping[str, str]) -> None:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.name, self.source = name, source
        self._special_tokens = dict(special_tokens)
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise ValueError(
                f"chat template {name!r} is not valid Jinja: line {err.lineno}: {err.message}"
            ) from err

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The template's text for `messages` (checked by `check_messages` first)."""
        import jinja2

        # Each render gets its own copies: a template may not alter the caller's messages.
        variables = {
            **self._special_tokens,
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "tools": None,
            "documents": None,
        }
        try:
            return self._template.render(**variables)
        except jinja2.TemplateError as err:
            # raise_exception's message is the template author's rule, e.g. "Conversation
            # roles must alternate user/assistant/user/assistant/..."
            message = " ".join(str(err).split())
            raise ValueError(
                f"chat template {self.name!r} rejects the messages: {message}"
            ) from err


def check_messages(messages: Any) -> list[Message]:
    """OpenAI-style messages, checked: a non-empty list of {"role", "content"} dicts with role
    system, user or assistant, and an optional "name" (kept for templates that use it). As
    OpenAI's API takes them: role "developer" is a system message; content may be a list of
    text parts ({"type": "text", "text": str}, joined with newlines as vLLM joins them); an
    assistant's content may be null or absent (""). Returns plain dict copies."""
    if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(
            "messages must be a non-empty list of {'role': 'system'|'user'|'assistant', "
            f"'content': str}} dicts, got {type(messages).__name__}"
        )
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(
                f"message {index} must be a dict with the keys 'role' and 'content', got "
                f"{type(message).__name__}"
            )
        role = message.get("role")
        role = "system" if role == "developer" else role  # OpenAI's name for it since o1
        if role not in ROLES:
            raise ValueError(
                f"message {index} has role {role!r}; roles are {', '.join(ROLES)} (and developer, "
                "read as system)"
            )
        extra = sorted(set(message) - {"role", "content", "name"})
        if extra or ("content" not in message and role != "assistant"):
            raise ValueError(
                f"message {index} must be a dict with the keys 'role' and 'content' (and "
                f"optionally 'name'), got {sorted(message)}"
            )
        content = _content(index, role, message.get("content"))
        out = {"role": role, "content": content}
        if message.get("name") is not None:
            if not isinstance(message["name"], str):
                raise ValueError(f"message {index} name must be a str, got {message['name']!r}")
            out["name"] = message["name"]
        checked.append(out)
    return checked


def _content(index: int, role: str, content: Any) -> str:
    """A message's content as one str: a str, a list of text parts, or (assistant) null."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":  # an assistant turn that only called tools
        return ""
    if isinstance(content, Sequence) and not isinstance(content, (str, bytes)):
        texts = []
        for n, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"message {index} content part {n} is {kind!r}; only text parts "
                    "({'type': 'text', 'text': str}) are supported: the engine reads text only"
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(
        f"message {index} content must be a str or a list of text parts, got "
        f"{type(content).__name__}"
    )


def turns_to_messages(turns: Sequence[str], system: str | None) -> list[Message]:
    """[q1, a1, q2] (+ system) as messages: user and assistant alternate, a system message
    first when `system` is a non-empty string."""
    messages = [{"role": "system", "content": system}] if system else []
    roles = ("user", "assistant")
    return messages + [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]


def messages_to_turns(messages: Sequence[Message]) -> tuple[str, list[str]]:
    """(system, turns) of checked messages for the built-in templates, which take an optional
    system message first, then user/assistant alternating and ending with the user."""
    system, offset = "", 0
    if messages[0]["role"] == "system":
        system, messages, offset = messages[0]["content"], messages[1:], 1
    for index, message in enumerate(messages):
        want = ("user", "assistant")[index % 2]
        if message["role"] != want:
            raise ValueError(
                f"the built-in templates take an optional system message first, then user and "
                f"assistant alternating; message {index + offset} is "
                f"{message['role']!r} where {want!r} belongs"
            )
    return system, [m["content"] for m in messages]


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want the plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.TemplateError(message)
