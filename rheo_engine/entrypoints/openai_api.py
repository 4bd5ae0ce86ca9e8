"""OpenAI's API over the engine, without the HTTP: a request body's fields as engine options
(``parse``), and a request's steps and Generation as OpenAI's response objects (``Call``), for
/v1/completions and /v1/chat/completions. rheo_engine.entrypoints.serve puts them on HTTP.

Field names are OpenAI's, then vLLM's extensions (top_k, min_p, repetition_penalty, ignore_eos,
min_tokens), then the engine's own (method, tree, topk, depth, total_tokens, drafts). Each field is
checked for its JSON type here; Request checks the values, and its message becomes the API's
error (``engine_error``) in the request's own spelling: the field the client sent
(max_tokens, not max_new_tokens) with JSON values (null, true), and that field as ``param``.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import re
import time
import uuid

from rheo_engine.runtime.scheduler import Cancelled, Handle
from rheo_engine.spec.verify import TokenLogprob

__all__ = ["ApiError", "Call", "engine_error", "parse"]

# OpenAI's field name -> (JSON type, the engine option it sets or None). null means "not given".
_COMMON = {
    "model": ("str", None), "max_tokens": ("int", None), "n": ("int", None),
    "stream": ("bool", None), "stream_options": ("object", None), "user": ("str", None),
    "temperature": ("number", "temperature"), "top_p": ("number", "top_p"),
    "stop": ("stop", "stop"), "seed": ("int", "seed"),
    "presence_penalty": ("number", "presence_penalty"),
    "frequency_penalty": ("number", "frequency_penalty"),
    # vLLM's extensions, then the engine's own.
    "top_k": ("int", "top_k"), "min_p": ("number", "min_p"),
    "repetition_penalty": ("number", "repetition_penalty"), "ignore_eos": ("bool", "ignore_eos"),
    "min_tokens": ("int", "min_new_tokens"), "method": ("str", "method"),
    "tree": ("str", "tree"), "topk": ("int", "topk"), "depth": ("int", "depth"),
    "total_tokens": ("int", "total_tokens"), "drafts": ("str", "drafts"),
}  # fmt: skip
_COMPLETION = {
    "prompt": ("any", None), "logprobs": ("int", None), "echo": ("bool", None),
    "best_of": ("int", None), "suffix": ("str", None),
}  # fmt: skip
_CHAT = {
    "messages": ("any", None), "logprobs": ("bool", "logprobs"),
    "top_logprobs": ("int", "top_logprobs"), "max_completion_tokens": ("int", None),
}  # fmt: skip
_TYPES = {
    "str": (str,), "int": (int,), "number": (int, float), "bool": (bool,), "object": (dict,),
    "stop": (str, list), "any": (object,),
}  # fmt: skip
_FINISH = {"eos": "stop", "stop": "stop", "max_new_tokens": "length", "context": "length"}


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code=None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}
        kind = kind.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return {"error": error}


def _fields(body: dict, table: dict) -> dict:
    """The given (non-null) fields of ``body``, each checked against its JSON type."""
    unknown = sorted(set(body) - set(table))
    if unknown:
        raise ApiError(400, f"unrecognized request field(s) {unknown}", unknown[0])
    out = {}
    for name, value in body.items():
        kind = table[name][0]
        if value is None:
            continue
        ok = isinstance(value, _TYPES[kind]) and (kind == "bool" or not isinstance(value, bool))
        if not ok:
            raise ApiError(400, f"{name}={json.dumps(value)} must be a JSON {kind}", name)
        out[name] = value
    return out


def _prompts(given: dict) -> list:
    """A completion's prompts, each answered as one choice in order: a str or token ids is
    one; a list of str or of token-id lists is one each (OpenAI's array prompt)."""
    prompt = given.get("prompt")
    many = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    prompts = prompt if many else [prompt]
    for p in prompts:
        if not isinstance(p, (str, list)) or (many and isinstance(p, list) and not p):
            raise ApiError(
                400, "prompt must be a str, a list of token ids, or a non-empty list of them "
                "(one choice each)", "prompt",
            )  # fmt: skip
    return prompts


def _messages(given: dict) -> list:
    """The chat's messages; the engine checks each (rheo_engine.io.chat_template's
    check_messages takes OpenAI's forms: name, developer, null and text-part content)."""
    messages = given.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of messages", "messages")
    return messages


def parse(
    body: dict, chat: bool, context: int, chat_template: str | None = None
) -> tuple[list, int | None, dict, dict]:
    """(prompts, max_new_tokens, engine options, given fields) of a request body: one chat
    (a list of messages) or a completion's prompts. A chat without max_tokens gets
    max_new_tokens None (what the KV slot holds after the prompt, Scheduler.submit), as vLLM
    does; a completion 16, as OpenAI's API. Completions are raw text (chat=False), chats go
    through ``chat_template`` (None: the model's)."""
    table = {**_COMMON, **(_CHAT if chat else _COMPLETION)}
    given = _fields(body, table)
    if given.get("n", 1) != 1 or given.get("best_of", 1) != 1:
        param = "n" if given.get("n", 1) != 1 else "best_of"
        raise ApiError(400, f"{param}={given[param]}: only one choice per request (n=1)", param)
    for name, off in (("echo", False), ("suffix", None)):
        if given.get(name, off) != off:
            raise ApiError(400, f"{name} is not supported", name)
    options = {table[k][1]: v for k, v in given.items() if table[k][1] is not None}
    if not chat and "logprobs" in given:  # completions: logprobs = how many alternatives
        options.update(logprobs=True, top_logprobs=given["logprobs"])
    if chat and chat_template is not None:
        options["chat_template"] = chat_template
    if not chat:  # OpenAI's completions take the prompt as it is, whatever the model
        options["chat"] = False
    limit = given.get("max_completion_tokens", given.get("max_tokens"))
    max_new = (None if chat else 16) if limit is None else limit
    if max_new is not None and max_new > context:
        name = _max_field(given)
        raise ApiError(400, f"{name}={max_new} must be <= the context ({context})", name)
    return ([_messages(given)] if chat else _prompts(given)), max_new, options, given


# --- the engine's errors in the request's spelling -------------------------------------------


def _max_field(given: dict) -> str:
    """The field that set max_new_tokens: max_completion_tokens if given, else max_tokens."""
    return "max_completion_tokens" if "max_completion_tokens" in given else "max_tokens"


def _fields_of(given: dict, chat: bool) -> dict[str, str]:
    """Engine option -> the request field that sets it, as this request spells it."""
    table = {**_COMMON, **(_CHAT if chat else _COMPLETION)}
    fields = {option: name for name, (_, option) in table.items() if option is not None}
    fields["max_new_tokens"] = _max_field(given)
    if not chat:  # completions' logprobs=N sets logprobs=True, top_logprobs=N
        fields.update(logprobs="logprobs", top_logprobs="logprobs")
    return fields


@functools.lru_cache(maxsize=4)
def _option_patterns(options: tuple[str, ...]) -> re.Pattern[str]:
    """An engine option named in a message: ``name=value``, ``name[i]`` or a bare name with an
    underscore (``max_new_tokens 4``; a bare ``stop`` or ``seed`` is prose)."""
    alts = "|".join(sorted(options, key=len, reverse=True))
    bare = "|".join(sorted((o for o in options if "_" in o), key=len, reverse=True))
    return re.compile(
        rf"(?<![\w./\[-])(?:({alts})=('(?:[^'\\]|\\.)*'|[^\s,;()\[\]]*)|({alts})(?=\[)|"
        rf"({bare})(?![\w=./-]))"
    )


_JSON_LITERALS = {"None": "null", "True": "true", "False": "false"}


def _json_value(value: str) -> str:
    """A Python value in a message as JSON writes it: None -> null, 'x' -> "x"."""
    tail = ""
    while value and value[-1] in ".:":  # sentence punctuation after the value
        value, tail = value[:-1], value[-1] + tail
    if value.startswith("'"):
        value = json.dumps(ast.literal_eval(value))
    return _JSON_LITERALS.get(value, value) + tail


def engine_error(err: ValueError, given: dict, chat: bool) -> ApiError:
    """A ValueError of the engine (Request, the Scheduler) about this request as the API's 400:
    each engine option named as the request field that sets it (max_new_tokens=0 ->
    max_tokens=0, min_new_tokens -> min_tokens, completions' top_logprobs -> logprobs), Python
    values as JSON (stop=None -> stop=null), ``param`` the first field named (else prompt or
    messages for an error about the prompt), and context_length_exceeded for a prompt and
    generation too long for the context or a KV slot."""
    message, fields = " ".join(str(err).split()), _fields_of(given, chat)
    named: list[str] = []

    def field(m: re.Match) -> str:
        option = m.group(1) or m.group(3) or m.group(4)
        named.append(fields[option])
        if m.group(1) is None:
            return fields[option]
        value = m.group(2)
        return f"{fields[option]}={_json_value(value)}" if value else fields[option]

    message = _option_patterns(tuple(fields)).sub(field, message)
    param = named[0] if named else None
    if param is None and re.search(r"\bprompt\b" if not chat else r"\b(prompt|messages?)\b",
                                   message):  # fmt: skip
        param = "messages" if chat else "prompt"
    too_long = "context is" in message or "slot holds" in message
    return ApiError(400, message, param, "context_length_exceeded" if too_long else None)


def _token(tokenizer, lp: TokenLogprob) -> tuple[str, float, list[tuple[str, float]]]:
    def finite(x: float) -> float:  # JSON has no -inf (a token of probability 0)
        return x if math.isfinite(x) else -9999.0

    top = [(tokenizer.decode([t]), finite(x)) for t, x in lp.top]
    return tokenizer.decode([lp.token]), finite(lp.logprob), top


def _logprobs(tokenizer, lps: list[TokenLogprob], chat: bool, offset: int = 0) -> dict:
    """OpenAI's logprobs object: chat's {"content": [...]}, or completions' four lists."""
    tokens = [_token(tokenizer, lp) for lp in lps]
    if chat:

        def entry(s: str, x: float) -> dict:
            return {"token": s, "logprob": x, "bytes": list(s.encode())}

        content = [
            {**entry(s, x), "top_logprobs": [entry(*t) for t in top]} for s, x, top in tokens
        ]
        return {"content": content, "refusal": None}
    offsets = []
    for s, _, _ in tokens:
        offsets.append(offset)
        offset += len(s)
    return {"tokens": [t[0] for t in tokens], "token_logprobs": [t[1] for t in tokens],
            "top_logprobs": [dict(t[2]) for t in tokens], "text_offset": offsets}  # fmt: skip


class Call:
    """One API call: its id, its response shapes, and its Handles once submitted (one per
    choice: a chat's one, or a completion's prompts in order)."""

    def __init__(
        self, model_name: str, tokenizer, chat: bool, given: dict, handles: list[Handle]
    ) -> None:
        self.model_name, self.tokenizer = model_name, tokenizer
        self.chat, self.given, self.handles = chat, given, handles
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.want_logprobs = handles[0].request.logprobs
        self.offsets = [0] * len(handles)  # completions' text_offset, per choice

    def object(self, choices: list[dict], chunk: bool, usage: dict | None = None) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (
            ".chunk" if chunk and self.chat else ""
        )
        out = {"id": self.id, "object": kind, "created": self.created,
               "model": self.model_name, "choices": choices}  # fmt: skip
        if usage is not None:
            out["usage"] = usage
        return out

    def choice(
        self, index: int, text: str, lps: list | None, finish: str | None, chunk: bool
    ) -> dict:
        """choices[index]: text (completions), message (chat) or delta (a chat chunk)."""
        if not self.chat:
            choice: dict = {"index": index, "text": text}
        elif chunk:
            choice = {"index": index, "delta": {"content": text} if text else {}}
        else:
            choice = {"index": index, "message": {"role": "assistant", "content": text}}
        logprobs = None
        if self.want_logprobs and lps is not None:
            logprobs = _logprobs(self.tokenizer, lps, self.chat, self.offsets[index])
            self.offsets[index] += sum(len(t) for t in logprobs.get("tokens", []))
        return {**choice, "logprobs": logprobs, "finish_reason": finish}

    def usage(self) -> dict:
        prompt = sum(len(h.request.prompt_ids) for h in self.handles)
        done = sum(len(h.result(0).token_ids) for h in self.handles)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def whole(self) -> dict:
        choices = []
        for index, handle in enumerate(self.handles):
            gen = handle.result(0)
            choices.append(self.choice(index, gen.text, gen.logprobs or [],
                                       _FINISH[gen.stop_reason], False))  # fmt: skip
        return self.object(choices, False, self.usage())

    async def events(self):
        """The server-sent events of a streamed call, ending with data: [DONE]. Several
        choices (a completion's prompts) decode together; their chunks are sent one choice
        after the other, each carrying its index, as OpenAI's clients accept."""

        def event(obj: dict) -> bytes:
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        try:
            for index, handle in enumerate(self.handles):
                if self.chat:  # OpenAI's first chunk names the role
                    first = {"index": index, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}  # fmt: skip
                    yield event(self.object([first], True))
                async for steps in handle.batches():  # the steps since the last chunk
                    text = "".join(step.text for step in steps)
                    logprobs = [lp for step in steps for lp in step.logprobs]
                    if text or logprobs:
                        choice = self.choice(index, text, logprobs, None, True)
                        yield event(self.object([choice], True))
                finish = _FINISH[handle.result(0).stop_reason]
                yield event(self.object([self.choice(index, "", None, finish, True)], True))
            options = self.given.get("stream_options") or {}
            if options.get("include_usage"):
                yield event(self.object([], True, self.usage()))
        except Cancelled:
            return
        except Exception as err:  # an error past the first byte: the stream's last event
            yield event({"error": {"message": str(err), "type": "server_error", "param": None,
                                   "code": None}})  # fmt: skip
        yield b"data: [DONE]\n\n"
