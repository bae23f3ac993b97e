"""A small local checkpoint (random tiny Llama weights, a byte-level BPE tokenizer trained here,
a ChatML template with Hermes-style tools) and a `rollout serve --http-port 0` process on it:
what the client tests point real clients at, and what lm-eval's `hf` backend loads to compare.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from proc_io import read_until

CORPUS = [
    "The capital of france is Paris. The capital of Italy is Rome.",
    "Question: what is the capital of france? Answer: Paris",
    "Question: 2 + 2 = ? Answer: 4",
    "the weather in Paris is sunny and the weather in Rome is warm",
]
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
CHATML_TOOLS = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>"
    '{"name": "{{ c["function"]["name"] }}", "arguments": {{ c["function"]["arguments"] }}}'
    "</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_checkpoint(path: Path, seed: int = 0) -> Path:
    """The checkpoint in HF layout, loadable by transformers (lm-eval's `hf` backend) and by
    `rollout serve --model`. ' france' is one token, so stop strings must match inside it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from rollout.models import ModelConfig, build_model, save_pretrained

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(CORPUS * 4, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "<|im_end|>", "pad_token": "</s>", "chat_template": CHATML_TOOLS,
              "model_max_length": 2048}  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    model_config = ModelConfig.preset("tiny", vocab_size=tok.get_vocab_size())
    save_pretrained(build_model(model_config, seed=seed), model_config, path)
    return path


@contextmanager
def serve(model: Path, *extra: str) -> Iterator[str]:
    """`rollout serve` on `model`; yields its HTTP base URL (no auth, loopback)."""
    cmd = [sys.executable, "-m", "rollout.cli", "serve", "--model", str(model), "--dp", "1",
           "--http-port", "0", *extra]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("ROLLOUT_HTTP_TOKEN", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)  # fmt: skip
    try:
        yield read_until(proc, r"^http (http://\S+)")[1]
        proc.terminate()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
