"""Chat templates render exactly as Hugging Face transformers renders them.

Each template below follows the structure of a real checkpoint's (Llama 3, Llama 3.1 with tools,
Qwen2.5 with tools and a default system prompt, ChatML, a Mistral-style template that checks
role alternation). Each is written into a tmp checkpoint dir beside a tiny tokenizer.json, then
loaded and rendered both by `rollout.serving.http.chat` and by transformers'
`apply_chat_template(tokenize=False)`: the strings must be identical.
"""

from __future__ import annotations

import json
import re

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from rollout.serving.http.chat import load_chat_template, render_chat, special_tokens_of

transformers = pytest.importorskip("transformers")

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

LLAMA31_TOOLS = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if tools is not none %}
    {{- "<|start_header_id|>user<|end_header_id|>\\n\\nTools:\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- "<|eot_id|>" }}
{%- endif %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# No whitespace control markers: trim_blocks and lstrip_blocks decide the output.
CHATML = """{% for message in messages %}
    {% if message['role'] == 'skip' %}
        {% continue %}
    {% endif %}
    <|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

# Role alternation checked with namespace() and raise_exception, as Mistral templates do.
MISTRAL = """{{ bos_token }}
{% set ns = namespace(expect='user') %}
{% for message in messages %}
    {% if message['role'] != ns.expect %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {{ '[INST] ' + message['content'] + ' [/INST]' }}
        {% set ns.expect = 'assistant' %}
    {% else %}
        {{ message['content'] + eos_token }}
        {% set ns.expect = 'user' %}
    {% endif %}
{% endfor %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city, <in °C> & wind",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "Zürich, say"}},
                "required": ["city"],
            },
        },
    }
]

TOOL_CALL = {
    "role": "assistant",
    "content": None,  # as OpenAI clients send it
    "tool_calls": [
        {
            "id": "call_0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Zürich"}},
        }
    ],
}

CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello <b>world</b> & ünïcode"}],
    "system_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "  What is 2+2?  "},
    ],
    "multi_turn": [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
}

TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Zürich?"},
    TOOL_CALL,
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "tool", "content": '{"wind": 3}'},
]

BOS, EOS = "<|begin_of_text|>", "<|eot_id|>"


def _checkpoint(tmp_path, chat_template=None, jinja_file=None):
    """A tmp checkpoint dir with a tiny WordLevel tokenizer.json and a tokenizer_config.json."""
    vocab = {"<unk>": 0, BOS: 1, EOS: 2, "<pad>": 3, "hello": 4}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": {
            "__type": "AddedToken",
            "content": BOS,
            "lstrip": False,
            "rstrip": False,
            "special": True,
        },
        "eos_token": EOS,
        "pad_token": "<pad>",
        "unk_token": "<unk>",
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja_file is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja_file)
    return tmp_path


def _hf(model_dir):
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(model_dir))


def _assert_same(model_dir, messages, add_generation_prompt, **kwargs):
    ours = render_chat(
        load_chat_template(model_dir),
        messages,
        add_generation_prompt=add_generation_prompt,
        **special_tokens_of(model_dir),
        **kwargs,
    )
    theirs = _hf(model_dir).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    assert ours == theirs
    return ours


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize(
    "template",
    [LLAMA3, LLAMA31_TOOLS, QWEN25, CHATML],
    ids=["llama3", "llama31", "qwen25", "chatml"],
)
def test_renders_like_transformers(tmp_path, template, conversation, add_generation_prompt):
    messages = CONVERSATIONS[conversation]
    kwargs = {"date_string": "26 Jul 2024"} if template is LLAMA31_TOOLS else {}
    _assert_same(_checkpoint(tmp_path, template), messages, add_generation_prompt, **kwargs)


@pytest.mark.parametrize("template", [LLAMA31_TOOLS, QWEN25], ids=["llama31", "qwen25"])
def test_tool_definitions_and_calls_render_like_transformers(tmp_path, template):
    model_dir = _checkpoint(tmp_path, template)
    kwargs = {"date_string": "26 Jul 2024"} if template is LLAMA31_TOOLS else {}
    messages = TOOL_CONVERSATION[:2] if template is LLAMA31_TOOLS else TOOL_CONVERSATION
    text = _assert_same(model_dir, messages, True, tools=TOOLS, **kwargs)
    # tojson keeps non-ASCII and HTML characters as they are.
    assert "Zürich" in text and "<in °C> & wind" in text


def test_qwen_default_system_prompt(tmp_path):
    model_dir = _checkpoint(tmp_path, QWEN25)
    text = _assert_same(model_dir, CONVERSATIONS["user"], True)
    assert text.startswith("<|im_start|>system\nYou are Qwen")


def test_strftime_now_matches_transformers(tmp_path):
    model_dir = _checkpoint(tmp_path, LLAMA31_TOOLS)
    _assert_same(model_dir, CONVERSATIONS["user"], True)


def test_namespace_and_special_tokens_like_transformers(tmp_path):
    model_dir = _checkpoint(tmp_path, MISTRAL)
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    text = _assert_same(model_dir, messages, False)
    assert text.startswith(BOS) and f"b{EOS}" in text


def test_list_form_chat_template_takes_default(tmp_path):
    model_dir = _checkpoint(
        tmp_path,
        [{"name": "tool_use", "template": QWEN25}, {"name": "default", "template": CHATML}],
    )
    assert load_chat_template(model_dir) == CHATML
    assert load_chat_template(model_dir, name="tool_use") == QWEN25
    _assert_same(model_dir, CONVERSATIONS["multi_turn"], True)


def test_chat_template_jinja_file(tmp_path):
    model_dir = _checkpoint(tmp_path, jinja_file=CHATML)
    assert load_chat_template(model_dir) == CHATML
    _assert_same(model_dir, CONVERSATIONS["system_user"], True)


def test_no_template(tmp_path):
    assert load_chat_template(_checkpoint(tmp_path)) is None
    assert load_chat_template(tmp_path / "missing") is None


def test_special_tokens_of_reads_strings_and_added_token_dicts(tmp_path):
    tokens = special_tokens_of(_checkpoint(tmp_path))
    assert tokens == {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": "<pad>",
        "unk_token": "<unk>",
    }
    assert tokens == _hf(tmp_path).special_tokens_map


def test_raise_exception_becomes_value_error_with_its_message(tmp_path):
    model_dir = _checkpoint(tmp_path, MISTRAL)
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ValueError, match="roles must alternate"):
        render_chat(load_chat_template(model_dir), messages, **special_tokens_of(model_dir))


@pytest.mark.parametrize(
    "template, problem",
    [
        ("{% for m in messages %}{{ m.content }}", "does not parse"),
        ("{% if %}x{% endif %}", "does not parse"),
        ("{{ messages[0].content + 1 }}", "failed on these messages"),
        ("{{ 1 / (messages | length - 1) }}", "failed on these messages"),
        ("{{ messages.__class__.__mro__ }}", "chat template error"),
        ("{% set ns = namespace(_x=1) %}", "not allowed"),
    ],
)
def test_broken_template_is_value_error(template, problem):
    with pytest.raises(ValueError, match=problem):
        render_chat(template, [{"role": "user", "content": "hi"}])


def test_empty_conversation_is_value_error():
    with pytest.raises(ValueError, match="empty conversation"):
        render_chat(CHATML, [])


def test_special_tokens_of_includes_model_specific_tokens_like_transformers(tmp_path):
    """Any `*_token` string (here image_token) reaches templates; flags such as add_bos_token
    and null tokens do not."""
    _checkpoint(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(image_token="<image>", add_bos_token=True, sep_token=None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokens = special_tokens_of(tmp_path)
    assert tokens["image_token"] == "<image>" and "add_bos_token" not in tokens
    assert tokens == _hf(tmp_path).special_tokens_map


def test_prepare_messages_joins_text_parts_and_refuses_other_parts():
    from rollout.serving.http.chat import prepare_messages

    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": parts},
            {"role": "assistant", "content": None, "tool_calls": []}]  # fmt: skip
    assert prepare_messages(msgs) == [msgs[0], {"role": "user", "content": "a\nb"}, msgs[2]]
    refused = [
        ([{"role": "user", "content": [{"type": "input_audio"}]}], "'input_audio'"),
        ([{"role": "user", "content": ["a"]}], "messages[0].content[0]"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "string 'text'"),
        ([{"role": "user", "content": {"x": 1}}], "messages[0].content must be"),
        ([{"content": "x"}], "string 'role'"),
    ]
    for messages, problem in refused:
        with pytest.raises(ValueError, match=re.escape(problem)):
            prepare_messages(messages)
