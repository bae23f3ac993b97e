"""The typed schema of a run: one dataclass per config group, composed into `RunConfig`.

Registered in Hydra's ConfigStore as `base_config` (conf/config.yaml starts from it), so every
YAML option and command-line override is type-checked by OmegaConf: a wrong type or an unknown
enum value fails with the key and the allowed values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore

from rollout.engine.config import ATTENTION_BACKENDS, KV_POLICIES, WEIGHT_UPDATES
from rollout.protocol import SUSPEND_MODES
from rollout.sampling import LOGPROBS_MODES
from rollout.serving.coordinator.routing import POLICIES
from rollout.serving.launcher import LAUNCHERS, PLACEMENT_STRATEGIES

GROUPS = ("model", "engine", "coordinator", "rollout", "trainer", "logger", "recipe")
HF_DIR = "hf_dir"


def _enum(name: str, *values: str) -> type[Enum]:
    """str-valued Enum: OmegaConf checks names, and members compare equal to their strings."""
    return Enum(name, {v: v for v in values}, type=str)  # type: ignore[return-value]


DType = _enum("DType", "float32", "bfloat16", "float16")
SuspendMode = _enum("SuspendMode", *SUSPEND_MODES)
RoutingPolicy = _enum("RoutingPolicy", *POLICIES)
RolloutMode = _enum("RolloutMode", "colocated", "async")
StalePolicy = _enum("StalePolicy", "drop", "regenerate")
KVPolicy = _enum("KVPolicy", *KV_POLICIES)
WeightUpdate = _enum("WeightUpdate", *WEIGHT_UPDATES)
Optimizer = _enum("Optimizer", "adamw")
LrSchedule = _enum("LrSchedule", "constant", "cosine")
LossType = _enum("LossType", "grpo", "ppo_clip")
LossAgg = _enum("LossAgg", "token_mean", "seq_mean")
WandbMode = _enum("WandbMode", "offline", "online", "disabled")
WeightsSnapshot = _enum("WeightsSnapshot", "memory", "disk")
WeightSyncTransport = _enum("WeightSyncTransport", "auto", "broadcast", "ipc")
LogprobsMode = _enum("LogprobsMode", *LOGPROBS_MODES)
AttentionBackend = _enum("AttentionBackend", *ATTENTION_BACKENDS)
Launcher = _enum("Launcher", *LAUNCHERS)
PlacementStrategy = _enum("PlacementStrategy", *PLACEMENT_STRATEGIES)


class ConfigError(ValueError):
    """A run config that cannot work; the message lists each offending key and what is allowed."""


# -- groups ----------------------------------------------------------------------------------------


@dataclass
class ModelCfg:
    """`name`: a preset (tiny | small | medium, built from scratch) or hf_dir (load `path`)."""

    name: str = "tiny"
    path: str | None = None  # HF checkpoint folder (config.json + *.safetensors) for hf_dir
    adapter_path: str | None = None  # PEFT LoRA adapter folder, applied unmerged (models.lora)
    tokenizer: str | None = "byte"  # "byte" (ByteTokenizer) or a tokenizer path; None = path
    vocab_size: int | None = None  # presets: None = the tokenizer's vocabulary
    dtype: DType = DType.float32
    device: str = "cpu"  # "cpu", "cuda", "cuda:N" or "auto" (cuda when available)


@dataclass
class EngineCfg:
    """One inference engine (mirrors `rollout.engine.config.InferenceConfig`)."""

    block_size: int = 16
    num_blocks: int | None = None  # None = as many as kv_cache_memory_bytes holds
    kv_cache_memory_bytes: int = 64 * 2**20
    max_requests: int = 64
    max_tokens_per_step: int = 1024
    max_sequence_length: int = 256
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    suspend_mode: SuspendMode = SuspendMode.recompute
    streaming_interval: int = 0
    cuda_graphs: bool = True  # decode steps replayed from CUDA graphs (CUDA only)
    async_scheduling: bool = False  # decode step k+1 launches before step k's tokens are read
    # paged attention: torch (CPU-tuned), flex (FlexAttention kernels), auto (flex on CUDA)
    attention_backend: AttentionBackend = AttentionBackend.auto
    batch_invariant: bool = False  # rows' logits/log-probs the same bits whatever the batch


@dataclass
class CoordinatorCfg:
    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port (the bound address is reported)
    policy: RoutingPolicy = RoutingPolicy.longest_prefix
    prefix_alpha: float = 0.5  # score = alpha * prefix match + (1 - alpha) * load
    prefix_table_size: int = 65536
    # Shared secret peers must present. None: token_file, else $ROLLOUT_AUTH_TOKEN(_FILE), else
    # one generated per launch (engines started by the run get it; remote ones need a file).
    token: str | None = None
    token_file: str | None = None
    heartbeat_s: float = 1.0
    engine_timeout_s: float = 10.0  # no heartbeat for this long = dead engine, re-dispatch
    deterministic: bool = False
    schedule_log: str | None = None  # JSON schedule log path
    # Supervision (dp > 1): a dead engine restarts after restart_backoff_s, doubling per recent
    # crash up to restart_backoff_max_s; after max_restarts within restart_window_s it stays
    # down (0 = never restart). Restarted engines load the last weights pushed, kept in memory
    # (one CPU copy of the model) or on disk (one file write per update).
    max_restarts: int = 5
    restart_window_s: float = 600.0
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 30.0
    weights_snapshot: WeightsSnapshot = WeightsSnapshot.memory
    # How update_weights reaches the engines (dp > 1): a process-group broadcast, or ipc (they
    # map the trainer's packed weights: shared memory / CUDA IPC); auto = ipc when the trainer's
    # weights sit on the engines' device (rollout.weights.trainer_sync AUTO_IPC_DEVICES).
    weight_sync_transport: WeightSyncTransport = WeightSyncTransport.auto
    # What vouches for each broadcast chunk's bytes (rollout.weights.chunk_digest): auto = keyed
    # BLAKE2b when there is a secret and the chunks are on CPU (gloo), else sum; keyed | sum |
    # crc32 | none. sum is ~3x faster on CPU but a man in the middle of the broadcast can forge it.
    weight_sync_checksum: str = "auto"
    # The interface engines on other hosts reach this trainer's weight-sync store on (its
    # rendezvous travels with every update). The store has no authentication: loopback unless
    # the engines run elsewhere, and then only on a trusted network.
    weight_sync_host: str = "127.0.0.1"


@dataclass
class RayCfg:
    """The ray launcher (rollout.launcher=ray): where the Ray cluster is, how engines are placed."""

    address: str | None = (
        None  # ray.init address ("auto", "ray://h:10001"); None: $RAY_ADDRESS, else a new local Ray
    )
    namespace: str | None = None
    # one placement group, one bundle per engine: PACK fills few nodes, SPREAD one engine a node
    placement_strategy: PlacementStrategy = PlacementStrategy.PACK
    cpus_per_engine: float = 1.0
    gpus_per_engine: float | None = (
        None  # None: 1 when model.device is cuda, else 0 (CPU-only bundles)
    )
    object_store_memory: int | None = (
        None  # bytes, for a local Ray this run starts (None: Ray's default)
    )
    placement_timeout_s: float = 300.0  # the placement group must be placed within this


@dataclass
class RolloutCfg:
    mode: RolloutMode = RolloutMode.colocated
    dp: int = 1  # engines; 1 = one in-process engine, > 1 = engine processes
    samples_per_prompt: int = 8  # GRPO group size
    prompts_per_step: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # Sampling seed: each sample draws from its own stream derived from it (group, member,
    # request), so with batch_invariant a colocated run is bit-reproducible; None = random streams
    seed: int | None = None
    # behaviour log-probs: processed = log_softmax(logits / temperature), what was sampled from
    # (the loss recomputes them at that temperature); raw = at temperature 1
    logprobs_mode: LogprobsMode = LogprobsMode.processed
    routing_replay: bool = False  # MoE: record each token's experts for the trainer (R3)
    # engines and the trainer's forward run the same batch-invariant ops: behaviour log-probs
    # equal the trainer's bit for bit (trainer_hooks.batch_invariant)
    batch_invariant: bool = False
    max_staleness: int = 1  # weight updates a trained token may lag behind
    stale_policy: StalePolicy = StalePolicy.drop
    kv_policy: KVPolicy = KVPolicy.recompute
    # pause: decoding waits for each update's transfer; staged: received into a second buffer
    # while decoding goes on, flipped between two steps (rollout.engine.staging)
    weight_update: WeightUpdate = WeightUpdate.pause
    partial_rollouts: bool = True
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal
    max_extra_groups: int | None = None  # dynamic sampling's extra groups per batch (None: batch)
    max_turns: int = 8  # multi-turn episodes: model turns
    max_episode_tokens: int | None = None  # episodes: all tokens (None: engine.max_sequence_length)
    env_timeout_s: float = 60.0  # episodes: one environment call
    max_failed_fraction: float = 0.5  # a batch with more failed samples raises BatchFailed
    # "tcp://HOST:PORT": attach to a running coordinator (`rollout serve` and the engines that
    # joined it from any host) instead of starting engines; dp = how many must have joined.
    # Its secret: coordinator.token / token_file.
    coordinator_address: str | None = None
    # local: the coordinator and dp engines as child processes (dp > 1); ray: as Ray actors
    # placed by one placement group (any dp, on a Ray cluster; the `ray` extra)
    launcher: Launcher = Launcher.local
    ray: RayCfg = field(default_factory=RayCfg)


@dataclass
class TrainerCfg:
    optimizer: Optimizer = Optimizer.adamw
    lr: float = 5e-4
    lr_schedule: LrSchedule = LrSchedule.constant  # cosine: decays to lr * min_lr_ratio at `steps`
    min_lr_ratio: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0
    steps: int = 100
    batch: int = 64  # samples per micro-batch (gradient accumulation over the step's samples)
    ppo_epochs: int = 1  # optimizer passes over one rollout batch
    loss: LossType = LossType.grpo
    loss_agg: LossAgg = LossAgg.token_mean
    normalize_adv_std: bool = True
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    tis_cap: float | None = None  # truncated importance sampling cap; None = off
    kl_coef: float = 0.0
    warmup_sft_steps: int = 0
    warmup_sft_lr: float | None = None  # None = lr


@dataclass
class LoggerCfg:
    mode: WandbMode = WandbMode.offline
    project: str = "rollout"
    dir: str | None = None  # None = the Hydra run folder
    name: str | None = None
    entity: str | None = None
    log_every: int = 1
    plot: bool = True  # reward/staleness PNG beside the run


@dataclass
class RecipeCfg:
    name: str = "grpo_reverse"
    # The module whose get_task(name, **kwargs) builds `task`, named in config (as Hydra names a
    # _target_) so the library never imports the applications built on it; None = no task.
    task_module: str | None = None
    task: str = "reverse"
    task_kwargs: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    eval_every: int = 0  # steps between greedy evaluations; 0 = off
    eval_prompts: int = 64


@dataclass
class RunConfig:
    model: ModelCfg = field(default_factory=ModelCfg)
    engine: EngineCfg = field(default_factory=EngineCfg)
    coordinator: CoordinatorCfg = field(default_factory=CoordinatorCfg)
    rollout: RolloutCfg = field(default_factory=RolloutCfg)
    trainer: TrainerCfg = field(default_factory=TrainerCfg)
    logger: LoggerCfg = field(default_factory=LoggerCfg)
    recipe: RecipeCfg = field(default_factory=RecipeCfg)


def register_configs() -> None:
    """Store RunConfig as `base_config` (the schema conf/config.yaml starts from); idempotent.

    One schema for the whole tree is enough: every group option merges into a typed node.
    """
    ConfigStore.instance().store(name="base_config", node=RunConfig)


register_configs()
