"""Chat templates from a model directory (Jinja, sandboxed) against transformers'
apply_chat_template on the same directory: the rendered text and the ids, for conversations
with and without a system message, multi-turn, DeepSeek's <think> reasoning in assistant turns
and special-token names typed in messages; template selection, the message checks and a
template's raise_exception.
"""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import LLAMA2C
from transformers import AutoTokenizer

from rheo_engine.io.tokenizer import LLAMA3_SYSTEM, Tokenizer

TEMPLATED = ["hf_tiny_llama31_dir", "hf_tiny_deepseek_dir", "hf_llama31_dir", "hf_deepseek_dir"]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
     {"role": "user", "content": " q2 with spaces \n"}],
    [{"role": "system", "content": "你是助手。"}, {"role": "user", "content": "你好 🦙"},
     {"role": "assistant", "content": "<think>\nThe user greets.\n</think>\n\n你好！"},
     {"role": "user", "content": "typed <|eot_id|> and <｜User｜> and </s>"}],
    [{"role": "user", "content": ""}],
]  # fmt: skip


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


@pytest.fixture(scope="module", params=TEMPLATED)
def pair(request) -> tuple[Tokenizer, object]:
    path = request.getfixturevalue(request.param)
    return Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def test_render_and_ids_match_apply_chat_template(pair):
    tok, hf = pair
    assert tok.default_chat_template == "model"
    for messages in CONVERSATIONS:
        text = tok.render_chat(messages)
        want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert text == want, messages
        ids = _ids(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
        assert tok.encode_chat(messages) == ids, messages
        assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id  # the template's own BOS
        assert tok.decode(tok.encode_chat(messages)) == text


def test_turns_equal_messages(pair):
    tok, _ = pair
    turns = ["q1", "a1", "q2"]
    messages = [
        {"role": r, "content": c} for r, c in zip(["user", "assistant", "user"], turns, strict=True)
    ]
    assert tok.render_chat(turns) == tok.render_chat(messages)  # system=None: none for "model"
    with_system = [{"role": "system", "content": "S"}, *messages]
    assert tok.encode_chat(turns, system="S") == tok.encode_chat(with_system)


def test_deepseek_strips_reasoning_and_opens_think(hf_tiny_deepseek_dir):
    tok = Tokenizer.from_dir(hf_tiny_deepseek_dir)
    text = tok.render_chat(CONVERSATIONS[3])
    assert "The user greets." not in text and "\n\n你好！<｜end▁of▁sentence｜>" in text
    assert text.startswith("<｜begin▁of▁sentence｜>你是助手。<｜User｜>")
    assert text.endswith("<｜Assistant｜><think>\n")
    think = tok.encode("<think>", bos=False)
    assert len(think) == 1 and tok.encode_chat(["hi"])[-2] == think[0]  # "<think>" + "\n"


def test_llama31_preamble_and_trimming(hf_tiny_llama31_dir):
    tok = Tokenizer.from_dir(hf_tiny_llama31_dir)
    text = tok.render_chat([" hi \n"])
    assert "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>" in text
    assert "user<|end_header_id|>\n\nhi<|eot_id|>" in text
    # The built-in llama-3 (EAGLE's eval) stays selectable: no preamble, LLAMA3_SYSTEM.
    builtin = tok.render_chat(["hi"], template="llama-3")
    assert "Cutting Knowledge" not in builtin and LLAMA3_SYSTEM in builtin
    assert tok.decode(tok.encode_chat(["hi"], template="llama-3")) == builtin


def test_builtin_llama3_on_tokenizer_json_equals_tiktoken(hf_llama31_dir):
    hf = Tokenizer.from_dir(hf_llama31_dir)
    tiktoken = Tokenizer.from_file(LLAMA2C / "llama3_tokenizer.model")
    for turns in (["Hi there"], ["q1", "a1", "q2 你好 <|eot_id|>"]):
        assert hf.encode_chat(turns, template="llama-3") == tiktoken.encode_chat(turns)


def test_raise_exception_is_one_line_value_error(hf_tiny_llama31_dir):
    tok = Tokenizer.from_dir(hf_tiny_llama31_dir)
    messages = [{"role": "user", "content": "q"}, {"role": "system", "content": "late"}]
    with pytest.raises(ValueError, match="rejects the messages: Only user and assistant") as err:
        tok.render_chat(messages)
    assert "\n" not in str(err.value)


def test_template_selection_and_errors(hf_tiny_llama31_dir, hf_tiny_deepseek_dir):
    tok = Tokenizer.from_dir(hf_tiny_llama31_dir)
    with pytest.raises(ValueError, match="known: model, vicuna_v1.1, llama-3"):
        tok.render_chat(["hi"], template="chatml")
    with pytest.raises(ValueError, match="needs the tokens </s>"):
        tok.render_chat(["hi"], template="vicuna_v1.1")
    deepseek = Tokenizer.from_dir(hf_tiny_deepseek_dir)
    with pytest.raises(ValueError, match="needs the tokens <|begin_of_text|>"):
        deepseek.render_chat(["hi"], template="llama-3")


def test_message_checks(hf_tiny_llama31_dir):
    tok = Tokenizer.from_dir(hf_tiny_llama31_dir)
    bad = [
        ([{"role": "tool", "content": "x"}], "role 'tool'"),
        ([{"role": "user", "content": ["part"]}], "content part 0 is 'str'; only text parts"),
        ([{"role": "user", "content": 3}], "content must be a str or a list of text parts"),
        ([{"role": "user"}], "the keys 'role' and 'content' \\(and optionally 'name'\\), got "
         "\\['role'\\]"),
        ([{"role": "user", "content": "x", "tool_calls": []}], "got \\['content', 'role', "
         "'tool_calls'\\]"),
        ([{"role": "user", "content": None}], "content must be a str"),
        ([{"role": "user", "content": "x"}, "y"], "message 1 must be a dict"),
        ("hi", "turns must be a list of str"),
        ([], "odd length"),
    ]
    for messages, message in bad:
        with pytest.raises(ValueError, match=message):
            tok.render_chat(messages)
    with pytest.raises(ValueError, match="put the system message first"):
        tok.render_chat([{"role": "user", "content": "x"}], system="S")
    with pytest.raises(ValueError, match="message 2 is 'user' where 'assistant' belongs"):
        tok.render_chat([{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
                         {"role": "user", "content": "b"}], template="llama-3")  # fmt: skip


def _variant(src, dst, **config_changes):
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.update(config_changes)
    (dst / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return dst


def test_template_sources(hf_tiny_llama31_dir, tmp_path):
    src = hf_tiny_llama31_dir
    named = [{"name": "tool_use", "template": "T"},
             {"name": "default", "template": "D{{ bos_token }}"}]  # fmt: skip
    one = _variant(src, tmp_path, chat_template=named)
    assert Tokenizer.from_dir(one).render_chat(["q"]) == "D<|begin_of_text|>"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages[0]['content'] }}")
    tok, hf = Tokenizer.from_dir(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert (
        tok.render_chat(["q"])
        == "Jq"
        == hf.apply_chat_template(
            [{"role": "user", "content": "q"}], add_generation_prompt=True, tokenize=False
        )
    )  # the separate file wins, in transformers too
    (tmp_path / "chat_template.jinja").unlink()
    _variant(src, tmp_path, chat_template=[{"name": "tool_use", "template": "T"}])
    with pytest.raises(ValueError, match="none named 'default'"):
        Tokenizer.from_dir(tmp_path)
    _variant(src, tmp_path, chat_template="{% if %}")
    with pytest.raises(ValueError, match="is not valid Jinja"):
        Tokenizer.from_dir(tmp_path)
    _variant(src, tmp_path, chat_template=None)  # no template: the built-in that fits
    assert Tokenizer.from_dir(tmp_path).default_chat_template == "llama-3"


def test_sandbox_and_tojson(hf_tiny_llama31_dir, tmp_path):
    _variant(hf_tiny_llama31_dir, tmp_path,
             chat_template="{{ messages | tojson }}{{ strftime_now('%Y') | length }}")  # fmt: skip
    tok = Tokenizer.from_dir(tmp_path)
    messages = [{"role": "user", "content": "<b>你好</b> & 'x'"}]
    assert tok.render_chat(messages) == json.dumps(messages, ensure_ascii=False) + "4"
    _variant(hf_tiny_llama31_dir, tmp_path,
             chat_template="{{ messages.__class__.__mro__ }}")  # fmt: skip
    with pytest.raises(ValueError, match="rejects the messages"):
        Tokenizer.from_dir(tmp_path).render_chat(["q"])
