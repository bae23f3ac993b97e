"""Trainer hooks drive a RolloutManager through real (tiny) training runs: plain loop, HF Trainer,
Lightning. After every step the engine serves exactly the trainer's weights at a new version, and
in colocated mode every forward of the trained model runs with the engine's KV pool freed."""

from __future__ import annotations

import pytest
import torch

from rollout.engine.config import InferenceConfig
from rollout.models import ModelConfig, build_model
from rollout.rl.manager import RolloutManager
from rollout.sampling import SamplingParams
from trainer_hooks import RolloutHooks, grpo_loss, train

CFG = ModelConfig.preset("tiny", vocab_size=64)
SP = SamplingParams(num_tokens_to_generate=5, ignore_eos=True)
N = 4


def _reward(sample) -> float:
    return sum(t % 2 == 0 for t in sample.completion_tokens) / len(sample.completion_tokens)


def _prompts():
    i = 0
    while True:
        i += 1
        yield [i % 60 + 1, 3]


def _record_kv_at_forward(model: torch.nn.Module, manager: RolloutManager) -> list[bool]:
    """Every forward of the trained model records whether the engine's KV pool was released at
    that moment (the manager suspended and the engine holding no KV tensor)."""
    seen: list[bool] = []

    def probe(module, args):
        seen.append(manager.suspended and manager.engine.kv.cache is None)

    model.register_forward_pre_hook(probe)
    return seen


def _setup(**kw):
    torch.manual_seed(0)
    trainer_model = build_model(CFG)
    engine_model = build_model(CFG)
    icfg = InferenceConfig(num_blocks=64, block_size=8, max_requests=16, max_tokens_per_step=128)
    manager = RolloutManager(
        model=engine_model, inference_config=icfg, suspend_mode="recompute", **kw
    )
    return trainer_model, manager


def _assert_engine_has(manager: RolloutManager, model: torch.nn.Module) -> None:
    engine_sd = manager.engine.model.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(engine_sd[k], v), k


def test_plain_loop_three_steps():
    model, manager = _setup()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    hooks = RolloutHooks(manager, model, sync_on_start=True)
    seen = _record_kv_at_forward(model, manager)
    with manager:
        history = train(manager, model, opt, _prompts(), 3, 2, N, _reward, SP, hooks=hooks)
        assert len(history) == 3 and all(
            torch.isfinite(torch.tensor(h["train/loss"])) for h in history
        )
        assert all(h["engine/kv_bytes_freed"] > 0 for h in history)
        assert manager.version == 4  # initial sync + 3 steps
        _assert_engine_has(manager, model)
        assert manager.suspended  # on_train_end: no KV outlives training
    assert seen == [True] * 3  # every forward ran with the KV pool already freed


def test_rollout_phase_suspends_even_when_generation_fails():
    model, manager = _setup()
    hooks = RolloutHooks(manager, model)
    with manager:
        with pytest.raises(ValueError, match="batch_size_groups"), hooks.rollout():
            assert not manager.suspended
            manager.collect(_prompts(), 0, N, _reward, SP)
        assert manager.suspended and manager.engine.kv.cache is None
        assert len(hooks.collect(_prompts(), 1, N, _reward, SP)) == N  # resumes by itself
        assert manager.suspended


def test_generating_outside_the_rollout_phase_fails_at_the_optimizer_step():
    model, manager = _setup()
    hooks = RolloutHooks(manager, model)
    with manager:
        hooks.on_train_start(model)
        samples = manager.collect(_prompts(), 1, N, _reward, SP)  # not hooks.collect
        grpo_loss(model, samples, N)[0].backward()
        with pytest.raises(RuntimeError, match=r"step 0: the colocated engines were still resumed"):
            hooks.on_before_optimizer(0)


def test_async_loop_does_not_suspend():
    model, manager = _setup(mode="async", max_staleness=1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    seen = _record_kv_at_forward(model, manager)
    with manager:
        hooks = RolloutHooks(manager, model)
        history = train(manager, model, opt, _prompts(), 2, 2, N, _reward, SP, hooks=hooks)
        assert len(history) == 2 and manager.version == 2
        assert manager.stats()["rollout/suspends"] == 1  # only at train end
        _assert_engine_has(manager, model)
    assert seen == [False, False]  # the engine kept generating through training


def test_grpo_loss_needs_rewards():
    model, manager = _setup()
    with manager:
        samples = manager.generate([[1, 2]], n=2, sampling_params=SP)
    with pytest.raises(ValueError, match="numeric rewards"):
        grpo_loss(model, samples, n=2)


def test_hf_trainer_callback(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # the HF Trainer needs it (extra `hf`)
    from trainer_hooks.hf import RolloutCallback

    model, manager = _setup()
    prompts = _prompts()
    losses = []
    callback = RolloutCallback(manager)
    seen = _record_kv_at_forward(model, manager)

    class GRPOTrainer(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            samples = callback.collect(prompts, 2, N, _reward, SP)
            loss, _ = grpo_loss(model, samples, N)
            losses.append(float(loss.detach()))
            return loss

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=1,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    data = [{"step": torch.tensor(i)} for i in range(8)]
    with manager:
        trainer = GRPOTrainer(model=model, args=args, train_dataset=data, callbacks=[callback])
        trainer.train()
        assert len(losses) == 3 and manager.version == 3
        assert manager.stats()["rollout/suspends"] >= 3
        _assert_engine_has(manager, model)
    assert seen == [True] * 3  # each compute_loss forward ran with the KV pool freed


def test_lightning_callback():
    pl = pytest.importorskip("lightning.pytorch")
    from trainer_hooks.lightning import RolloutCallback

    model, manager = _setup()
    prompts = _prompts()
    callback = RolloutCallback(manager, model_attr="model")
    seen = _record_kv_at_forward(model, manager)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            samples = callback.collect(prompts, 2, N, _reward, SP)
            return grpo_loss(self.model, samples, N)[0]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=1)
    with manager:
        trainer = pl.Trainer(max_steps=3, callbacks=[callback], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             accelerator="cpu")  # fmt: skip
        trainer.fit(Module(), loader)
        assert manager.version == 3
        _assert_engine_has(manager, model)
    assert seen == [True] * 3  # each training_step forward ran with the KV pool freed
