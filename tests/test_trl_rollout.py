"""trainer_hooks.trl without TRL: the rollout_func contract against a real embedded engine and a
stand-in trainer (TRL's GRPOTrainer itself runs in tests/clients/test_trl_grpo.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerControl, TrainerState

from rollout import InferenceConfig
from rollout.rl.manager import RolloutManager
from rollout.rl.manager_config import RolloutManagerConfig
from rollout.tokenizers import ByteTokenizer
from trainer_hooks.losses import sequence_log_probs
from trainer_hooks.trl import TRLRollout, prompt_runs


class ByteProcessor:
    """What TRL calls on its processing_class: tok(text=...) and apply_chat_template(...)."""

    def __init__(self) -> None:
        self.tok = ByteTokenizer()
        self.templated: list = []

    def __call__(self, text: str) -> dict:
        return {"input_ids": self.tok.encode(text, add_bos=True)}

    def apply_chat_template(self, conversation, add_generation_prompt, tokenize, return_dict,
                            chat_template=None):  # fmt: skip
        self.templated.append(conversation)
        text = "".join(f"{m['role']}:{m['content']}\n" for m in conversation[0]) + "assistant:"
        return {"input_ids": [self.tok.encode(text, add_bos=True)]}


def trainer_like(**changes):
    args = SimpleNamespace(generation_kwargs=None)
    t = SimpleNamespace(processing_class=ByteProcessor(), temperature=0.7, top_p=1.0, top_k=0,
                        min_p=None, repetition_penalty=1.0, max_completion_length=5, args=args)  # fmt: skip
    for k, v in changes.items():
        setattr(t, k, v)
    return t


@pytest.fixture
def manager(model):
    cfg = RolloutManagerConfig()
    with RolloutManager(cfg, model=model, tokenizer=ByteTokenizer(), inference_config=InferenceConfig(num_blocks=64)) as m:  # fmt: skip
        yield m


def test_prompt_runs_fold_repeats():
    assert prompt_runs(["a", "a", "b", "b", "a"]) == [("a", 2), ("b", 2), ("a", 1)]
    assert prompt_runs([]) == []


def test_groups_are_sent_once_and_come_back_in_trl_order(manager, model):
    rollout = TRLRollout(manager)
    prompts = ["12>"] * 3 + ["345>"] * 3 + [[{"role": "user", "content": "hi"}]] * 3
    out = rollout(prompts, trainer_like())
    groups = [s.group_id for s in rollout.last_samples]  # one group of n=3 per run
    assert groups[0:3] == [groups[0]] * 3 and groups[3:6] == [groups[3]] * 3
    assert len(set(groups)) == 3 and [s.index for s in rollout.last_samples] == [0, 1, 2] * 3
    assert all(1 <= len(x) <= 5 for x in out["completion_ids"])
    tok = ByteTokenizer()
    assert out["prompt_ids"][:6] == [tok.encode("12>", add_bos=True)] * 3 + [tok.encode("345>", add_bos=True)] * 3  # fmt: skip
    assert out["prompt_ids"][6] == tok.encode("user:hi\nassistant:", add_bos=True)
    assert rollout.metrics["rollout/groups"] == 3.0
    assert set(out) == {"prompt_ids", "completion_ids", "logprobs", "policy_staleness", "weight_versions"}  # fmt: skip
    # processed log-probs at the trainer's temperature: TRL's recompute gives ratio 1
    for p, c, lp in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"], strict=True):
        ids = torch.tensor([p + c])
        with torch.no_grad():
            mine = sequence_log_probs(model(ids), ids, temperature=0.7)[0, len(p) :]
        assert torch.allclose(mine, torch.tensor(lp), atol=1e-4)


@pytest.mark.parametrize(
    "change, name",
    [({"min_p": 0.1}, "min_p"), ({"repetition_penalty": 1.2}, "repetition_penalty"),
     ({"args": SimpleNamespace(generation_kwargs={"do_sample": False})}, "generation_kwargs")],
)  # fmt: skip
def test_unsupported_trl_args_are_refused_by_name(manager, change, name):
    with pytest.raises(ValueError, match=name):
        TRLRollout(manager)(["1>"] * 2, trainer_like(**change))


def test_a_raw_manager_is_refused(model):
    cfg = RolloutManagerConfig(logprobs_mode="raw")
    icfg = InferenceConfig(num_blocks=64)
    with (
        RolloutManager(cfg, model=model, tokenizer=ByteTokenizer(), inference_config=icfg) as m,
        pytest.raises(ValueError, match="logprobs_mode='processed'"),
    ):
        TRLRollout(m)


def test_on_log_adds_the_managers_metrics_to_logs_and_history(manager):
    rollout = TRLRollout(manager)
    rollout(["1>"] * 2, trainer_like())
    state = TrainerState()
    state.global_step = 3
    state.log_history.append({"loss": 0.5, "step": 3})
    logs = {"loss": 0.5}
    rollout.callback.on_log(None, state, TrainerControl(), logs=logs)
    for key in ("rollout/version", "staleness/policy_max", "engine/steps", "rollout/groups"):
        assert key in logs and key in state.log_history[-1], key
