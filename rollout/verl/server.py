"""`RolloutServer`: the server actor a verl replica talks to, over our engines.

verl's client and load balancer call `generate(prompt_ids, sampling_params, request_id, ...)`
on a server actor and expect a `TokenOutput`; the replica calls its lifecycle methods (wake_up,
sleep, abort_all_requests, resume_generation, the KV-cache calls). This actor owns an
`EngineCluster` (a coordinator and `data_parallel_size` engine processes on its node) and maps
each call onto it. Token-in, token-out: prompts are ids and engines load no tokenizer.

Per token it returns what verl's vLLM server cannot: the weight version that sampled it and its
policy staleness (`extra_fields["token_versions"]`, `["policy_staleness"]`), and with
`enable_rollout_routing_replay` the experts that routed it (`routed_experts`, R3).
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import torch

from rollout.sampling import SamplingParams
from rollout.serving.cluster import EngineCluster

log = logging.getLogger(__name__)

# vLLM SamplingParams keys verl may send that we accept only at their neutral value
NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "n": 1,
           "min_p": 0.0, "min_tokens": 0, "skip_special_tokens": True, "detokenize": True,
           "spaces_between_special_tokens": True, "include_stop_str_in_output": False}  # fmt: skip
MULTIMODAL = ("image_data", "video_data", "audio_data", "mm_processor_kwargs")


def to_sampling_params(d: dict[str, Any], max_tokens: int, logprobs_mode: str) -> SamplingParams:
    """verl's (vLLM-style) sampling dict -> SamplingParams; ValueError naming any key we cannot
    honour (a non-neutral penalty, an unknown field)."""
    d = {k: v for k, v in d.items() if v is not None}
    for k in list(d):
        if k in NEUTRAL and (v := d.pop(k)) != NEUTRAL[k]:
            raise ValueError(f"sampling_params[{k!r}]={v!r}: rollout supports only "
                             f"{NEUTRAL[k]!r}")  # fmt: skip
    top_k = int(d.pop("top_k", 0))
    logprobs = d.pop("logprobs", False)
    sp = SamplingParams(
        temperature=float(d.pop("temperature", 1.0)), top_p=float(d.pop("top_p", 1.0)),
        top_k=0 if top_k < 0 else top_k,
        num_tokens_to_generate=int(d.pop("max_tokens", d.pop("max_new_tokens", max_tokens))),
        stop_token_ids=list(d.pop("stop_token_ids", [])), ignore_eos=bool(d.pop("ignore_eos", False)),
        seed=d.pop("seed", None), return_log_probs=logprobs is not False,
        logprobs_mode="raw" if logprobs_mode == "raw_logprobs" else "processed",
        return_routed_experts=bool(d.pop("return_routed_experts", False)),
    )  # fmt: skip
    if d:
        raise ValueError(f"sampling_params keys rollout does not support: {sorted(d)}")
    return sp


class RolloutServer:
    """One verl replica's server: our coordinator and engines (see the module docstring)."""

    def __init__(self, config: Any, model_path: str, replica_rank: int = 0) -> None:
        self.config = config
        self.replica_rank = replica_rank
        self.global_steps: int | None = None
        self.version = 0
        self.routing_replay = bool(getattr(config, "enable_rollout_routing_replay", False))
        self.max_tokens = int(config.response_length)
        hf = json.loads((Path(model_path) / "config.json").read_text())
        eos = hf.get("eos_token_id")
        self.eos = [eos] if isinstance(eos, int) else list(eos or [])
        icfg = {"max_sequence_length": int(config.prompt_length) + self.max_tokens,
                "max_requests": min(int(config.max_num_seqs), 256)}  # fmt: skip
        self.cluster = EngineCluster(
            int(config.data_parallel_size), model_path, tokenizer="none", inference_config=icfg,
            device="cuda" if torch.cuda.is_available() else "cpu",
        ).start()  # fmt: skip
        self.address = self.cluster.address
        self._futures: set[Any] = set()  # the client's futures in flight (cluster loop thread)
        self._open = asyncio.Event()  # cleared by abort_all_requests until resume_generation
        self._open.set()

    def get_server_address(self) -> str:
        return self.address

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        mm_processor_kwargs: Any = None,
        priority: int = 0,
        **kwargs: Any,
    ) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        given = {"image_data": image_data, "video_data": video_data, "audio_data": audio_data,
                 "mm_processor_kwargs": mm_processor_kwargs}  # fmt: skip
        mm = [k for k, v in given.items() if v]
        if mm or kwargs:
            raise ValueError(
                f"rollout generates from token ids only; refused: {mm + sorted(kwargs)}"
            )
        sp = to_sampling_params(dict(sampling_params), self.max_tokens,
                                str(getattr(self.config, "logprobs_mode", "processed_logprobs")))  # fmt: skip
        if self.routing_replay:
            sp = sp.replace(return_routed_experts=True)
        if not sp.ignore_eos:
            sp = sp.replace(stop_token_ids=sorted({*sp.stop_token_ids, *self.eos}))
        await self._open.wait()
        record = await asyncio.wrap_future(self.cluster.loop.submit(
            self._run([int(t) for t in prompt_ids], sp, str(request_id))))  # fmt: skip
        req = record.merge()
        if getattr(req, "error", None):
            raise RuntimeError(f"request {request_id} failed: {req.error}")
        n = len(req.generated_tokens)
        staleness = req.policy_staleness
        staleness = staleness[-n:].tolist() if staleness is not None and n else [0] * n
        experts = (torch.stack(req.routed_experts).tolist()
                   if self.routing_replay and req.routed_experts else None)  # fmt: skip
        extra = {"global_steps": self.global_steps, "token_versions": list(req.generated_weight_versions),
                 "policy_staleness": staleness, "weight_version": self.version}  # fmt: skip
        return TokenOutput(
            token_ids=list(req.generated_tokens),
            log_probs=list(req.generated_log_probs) if sp.return_log_probs else None,
            routed_experts=experts, num_preempted=0, extra_fields=extra,
            stop_reason="aborted" if req.stop_reason == "abort" else "completed",
        )  # fmt: skip

    async def _run(self, prompt: list[int], sp: SamplingParams, key: str) -> Any:
        fut = self.cluster.client.add_request(prompt, sp, routing_key=key[:128] or None)
        self._futures.add(fut)
        try:
            return await fut
        finally:
            self._futures.discard(fut)

    # ---- lifecycle (verl's names -> our controls) ----------------------------------------

    def _control(self, name: str, *args: Any) -> Any:
        return self.cluster.call(lambda: getattr(self.cluster.client, name)(*args))

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        """Stop every request in flight; each returns what it generated, as "aborted". New ones
        wait until `resume_generation` (`reject_request` is not supported: refused by name)."""
        if reject_request:
            raise NotImplementedError("abort_all_requests(reject_request=True): rollout holds "
                                      "new requests until resume_generation instead")  # fmt: skip
        self._open.clear()

        def abort() -> None:
            for fut in list(self._futures):
                self.cluster.client.abort(fut)

        self.cluster.loop.loop.call_soon_threadsafe(abort)

    async def resume_generation(self) -> None:
        self._open.set()

    async def sleep(self) -> None:
        """Free the KV cache (recompute on wake-up); requests in flight wait."""
        self._control("pause_engines")
        self._control("suspend_engines", "recompute")

    async def wake_up(self) -> None:
        stats = self.cluster.stats()
        if stats["state"] == "SUSPENDED":
            self._control("resume_engines")
        self._control("unpause_engines")

    release_kv_cache = sleep
    resume_kv_cache = wake_up

    async def clear_kv_cache(self) -> None:
        """Drop every cached KV block (and the prefix cache): a suspend-recompute cycle."""
        await self.sleep()
        await self.wake_up()

    async def start_profile(self, **kwargs: Any) -> None:
        raise NotImplementedError("start_profile: rollout has no profiler hook")

    async def stop_profile(self) -> None:
        raise NotImplementedError("stop_profile: rollout has no profiler hook")

    def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = int(global_steps)

    # ---- weights --------------------------------------------------------------------------

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int | None) -> dict:
        """Our update path (`EngineCluster.update_weights`): every engine applies it or none."""
        version = self.version + 1 if version is None or version <= self.version else int(version)
        acks = self.cluster.update_weights(state_dict, version)
        self.version = version
        return {"version": version, "checksums": sorted({a["checksum"] for a in acks.values()})}

    def weight_version(self) -> int:
        return self.version

    def inflight(self) -> int:
        """Requests running on the engines now (not those held for resume_generation)."""
        return len(self._futures)

    def shutdown(self) -> None:
        self.cluster.close()
