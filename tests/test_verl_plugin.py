"""rollout as a verl 0.9.x rollout backend, driven by verl's own code on CPU.

What of verl runs here: `import verl` loads our `verl.plugins` entry point; verl's hydra config
(`ppo_trainer.yaml`) is composed with `actor_rollout_ref.rollout.name=rollout`; verl's
`LLMServerManager.create` builds the standalone replica exactly as its trainer does (its resource
pool on a local Ray with fake GPUs, one `CheckpointEngineWorker` whose server adapter comes from
verl's `get_rollout_class`, our `launch_servers`, verl's `GlobalRequestLoadBalancer`), and
verl's `LLMServerClient.generate` generates through that balancer against our server actor.
The replica's lifecycle calls (abort_all_requests, resume_generation, sleep, wake_up) and the
adapter's `update_weights(generator of (name, tensor))` are verl's entry points, called
directly. Not run: verl's trainer itself (FSDP/Megatron workers and its checkpoint-engine
transfer need GPUs), so the weights come from a generator here as its colocated sync yields them.
"""

from __future__ import annotations

import asyncio
import copy
import os
import pathlib

import pytest
import torch

verl = pytest.importorskip("verl")
ray = pytest.importorskip("ray")
from hydra import compose, initialize_config_dir  # noqa: E402
from reference import greedy  # noqa: E402

from rollout.models import ModelConfig, build_model, save_pretrained  # noqa: E402

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(600)]


def verl_config(model_dir: str, *extra: str):
    import verl.trainer.config as trainer_config

    overrides = [
        "actor_rollout_ref.rollout.name=rollout", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.prompt_length=32",
        "actor_rollout_ref.rollout.response_length=512", f"actor_rollout_ref.model.path={model_dir}",
        "+actor_rollout_ref.model.load_tokenizer=false", *extra,
    ]  # fmt: skip
    with initialize_config_dir(
        config_dir=os.path.dirname(trainer_config.__file__), version_base=None
    ):
        return compose("ppo_trainer", overrides=overrides)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    old = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # token auth off for this local Ray, explicitly
    ray.init(num_cpus=2, num_gpus=1, object_store_memory=100 << 20, include_dashboard=False,
             log_to_driver=False)  # fmt: skip
    d = tmp_path_factory.mktemp("tiny")
    cfg = ModelConfig.preset("tiny", vocab_size=259)
    model = build_model(cfg, seed=0)
    save_pretrained(model, cfg, pathlib.Path(d))
    try:
        yield model, str(d)
    finally:
        ray.shutdown()
        if old is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = old


def test_verl_registry_loads_the_plugin_and_refuses_what_rollout_cannot_do(setup):
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import RolloutReplicaRegistry, get_rollout_replica_class

    import rollout.verl.adapter
    import rollout.verl.replica

    _, model_dir = setup
    assert get_rollout_replica_class("rollout") is rollout.verl.replica.RolloutReplica
    assert get_rollout_class("rollout", "async") is rollout.verl.adapter.ServerAdapter
    config = verl_config(model_dir, "actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2"):
        RolloutReplicaRegistry.get("rollout")(0, config.actor_rollout_ref.rollout,
                                              config.actor_rollout_ref.model)  # fmt: skip


def test_verl_generates_through_its_client_and_updates_weights_through_the_adapter(setup):
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.llm_server import LLMServerManager

    model, model_dir = setup
    config = verl_config(model_dir)
    manager = LLMServerManager.create(config)
    client = manager.get_client()
    replica = manager.rollout_replicas[0]
    prompt = [256, *b"hello"]
    greedy_sp = {"temperature": 0.0, "max_tokens": 8, "logprobs": True}

    async def generate(rid: str, sp: dict):
        return await client.generate(rid, prompt_ids=prompt, sampling_params=sp)

    try:
        out = asyncio.run(generate("a", greedy_sp))
        assert out.token_ids == greedy(model, prompt, 8) and len(out.log_probs) == 8
        assert out.stop_reason == "completed"
        assert out.extra_fields["token_versions"] == [0] * 8
        assert out.extra_fields["policy_staleness"] == [0] * 8

        # abort_all_requests: the request in flight comes back "aborted" with what it had;
        # new ones wait for resume_generation
        async def abort_midway():
            long = asyncio.ensure_future(generate("b", {**greedy_sp, "max_tokens": 400,
                                                        "ignore_eos": True}))  # fmt: skip
            server = replica.servers[0]
            while not await server.inflight.remote():  # it runs on the engines now
                assert not long.done(), "it finished before it could be aborted"
                await asyncio.sleep(0.02)
            await replica.abort_all_requests()
            held = asyncio.ensure_future(generate("c", greedy_sp))
            first = await long
            assert not held.done()
            await replica.resume_generation()
            return first, await held

        aborted, after = asyncio.run(abort_midway())
        assert aborted.stop_reason == "aborted" and len(aborted.token_ids) < 400
        assert after.token_ids == out.token_ids
        asyncio.run(replica.sleep())
        asyncio.run(replica.wake_up())

        # verl's adapter, resolved by verl's registry, fed a generator of (name, tensor)
        trained = copy.deepcopy(model)
        with torch.no_grad():
            for p in trained.parameters():
                p.add_(0.05 * torch.randn_like(p))
        adapter_cls = get_rollout_class("rollout", "async")
        adapter = adapter_cls(config=config.actor_rollout_ref.rollout,
                              model_config=config.actor_rollout_ref.model, device_mesh=None,
                              replica_rank=0)  # fmt: skip
        asyncio.run(adapter.resume(["weights"]))
        ack = asyncio.run(adapter.update_weights(((n, t) for n, t in trained.state_dict().items()),
                                                 global_steps=3))  # fmt: skip
        asyncio.run(adapter.resume(["kv_cache"]))
        assert ack["version"] == 3 and len(ack["checksums"]) == 1
        ray.get(replica.servers[0].set_global_steps.remote(3))
        new = asyncio.run(generate("d", greedy_sp))
        assert new.token_ids == greedy(trained.eval(), prompt, 8) != out.token_ids
        assert new.extra_fields["token_versions"] == [3] * 8
        assert new.extra_fields["global_steps"] == 3
        with pytest.raises(NotImplementedError, match="wire_format"):
            asyncio.run(adapter.update_weights(iter(()), wire_format="delta_flush"))
        with pytest.raises(Exception, match="image_data"):
            asyncio.run(client.generate("e", prompt_ids=prompt, sampling_params=greedy_sp,
                                        image_data=["x"]))  # fmt: skip
    finally:
        for server in replica.servers:
            ray.get(server.shutdown.remote())


def test_server_returns_routed_experts_with_routing_replay(setup, tmp_path):
    """R3 through the server actor (verl's TokenOutput.routed_experts): a tiny Qwen3-MoE, one
    [layers, top_k] row of experts per generated token, what our engine recorded."""
    import transformers

    from rollout.verl.server import RolloutServer

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, eos_token_id=None,
    )  # fmt: skip
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(tmp_path)
    config = verl_config(
        str(tmp_path), "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"
    )
    server = ray.remote(RolloutServer).remote(config.actor_rollout_ref.rollout, str(tmp_path))
    try:
        out = ray.get(
            server.generate.remote([5, 17, 3], {"temperature": 0.0, "max_tokens": 6}, "r")
        )
        experts = torch.tensor(out.routed_experts)
        assert experts.shape == (6, 2, 2) and int(experts.max()) < 6
        assert out.extra_fields["token_versions"] == [0] * 6
    finally:
        ray.get(server.shutdown.remote())
        ray.kill(server)
