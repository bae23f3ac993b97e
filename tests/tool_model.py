"""A tiny byte-level checkpoint trained in seconds to answer two chat prompts by heart: the
question with a tool call (Hermes format), and the question plus the tool's result with the
final answer. What tool-calling clients run an agent loop against."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rollout.models import ModelConfig, build_model, save_pretrained
from rollout.serving.http.chat import render_chat
from rollout.tokenizers import ByteTokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>"
    '{"name": "{{ c["function"]["name"] }}", "arguments": {{ c["function"]["arguments"] }}}'
    "</tool_call>{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
QUESTION = "What is 6*7?"
TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "evaluate arithmetic",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}]  # fmt: skip
CALL = {"name": "calc", "arguments": {"expr": "6*7"}}
CALL_TEXT = f"Let me compute.<tool_call>{json.dumps(CALL)}</tool_call>"
RESULT = "42"
ANSWER = "The answer is 42."


def conversation(with_result: bool) -> list[dict]:
    msgs = [{"role": "user", "content": QUESTION}]
    if with_result:
        call = {"id": "c1", "type": "function",
                "function": {"name": "calc", "arguments": json.dumps(CALL["arguments"])}}  # fmt: skip
        msgs += [{"role": "assistant", "content": "Let me compute.", "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "c1", "content": RESULT}]  # fmt: skip
    return msgs


def train_tool_model(path: Path, steps: int = 400) -> Path:
    """The checkpoint dir: weights, a byte tokenizer marker, the chat template file."""
    tok = ByteTokenizer()
    texts = [render_chat(CHAT_TEMPLATE, conversation(False)) + CALL_TEXT,
             render_chat(CHAT_TEMPLATE, conversation(True)) + ANSWER]  # fmt: skip
    ids = [[*tok.encode(t), tok.eos_id] for t in texts]  # the server renders no BOS: nor here
    width = max(map(len, ids))
    batch = torch.tensor([x + [tok.pad_id] * (width - len(x)) for x in ids])
    targets = torch.tensor([x[1:] + [-100] * (width - len(x)) for x in ids])  # pads ignored
    config = ModelConfig.preset("tiny", vocab_size=tok.vocab_size)
    model = build_model(config, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    path.mkdir(parents=True, exist_ok=True)
    save_pretrained(model.eval(), config, path)
    tok.save(path)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path
