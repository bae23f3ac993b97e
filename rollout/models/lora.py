"""LoRA adapters applied without merging: y = base(x) + scale * B(A(x)).

PEFT's layout and names: an adapter folder holds `adapter_config.json` (r, lora_alpha,
target_modules, use_rslora) and `adapter_model.safetensors` with tensors named
`base_model.model.<module>.lora_A.weight` [r, in] / `lora_B.weight` [out, r]. In the engine's
model the adapter lives beside the base weights as `<module>.lora_A.weight` / `.lora_B.weight`
(PEFT's names without the `base_model.model.` prefix): the base `weight` keeps its name, its
storage and its MKL pack (rollout.models.packed adds the adapter's term), so a full-weight
update and an adapter update each replace only their own tensors and compose. Why not merge:
an adapter update then moves megabytes, and the base weights stay bit-exact.

The scale (lora_alpha / r, or / sqrt(r) with rsLoRA) is a tensor too: a float32 scalar buffer
`<module>.lora_scale`, so it travels inside a pushed update (covered by its checksums and MAC
like any weight) and is applied with the adapter: a PEFT model's update always carries its own
(`peft_adapter`), so an adapter trained with another lora_alpha or use_rslora than the engine
was started with is served at the trainer's scale, never silently at the engine's. An update
without scales keeps the engine's. A buffer rather than a Python float also keeps CUDA graphs
reading the current value.

Supported targets: the attention and MLP projections (q, k, v, o, gate, up, down), including a
MoE model's attention and shared expert; LoRA on stacked experts (PEFT's `target_parameters`),
the router, the embeddings or the head is refused by name, as are DoRA, biases, per-module
ranks and `modules_to_save`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # what PEFT puts before the base model's module names
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCALE = "lora_scale"  # each LoraLinear's scale buffer: `<module>.lora_scale`
_ADAPTER_MARKERS = (".lora_A.", ".lora_B.")
# adapter_config.json keys whose non-default values change the math: refused by name
_UNSUPPORTED = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "rank_pattern": {},
    "alpha_pattern": {},
    "modules_to_save": None,
    "layers_to_transform": None,
    "target_parameters": None,
    "trainable_token_indices": None,
    "exclude_modules": None,
    "lora_bias": False,
    "layer_replication": None,
    "alora_invocation_tokens": None,
    "use_qalora": False,
    "use_bdlora": None,
    "velora_config": None,
    "monteclora_config": None,
    "kasa_config": None,
    "arrow_config": None,
}


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """What an adapter needs of the model: rank, scale and the projections it wraps."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str = TARGETS  # names (PEFT suffix match) or a regex
    use_rslora: bool = False

    @property
    def scale(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @classmethod
    def from_peft(cls, cfg: Mapping[str, Any]) -> LoraSpec:
        """An adapter_config.json dict (or a PEFT LoraConfig's dict) -> LoraSpec; ValueError
        naming every option that is not supported."""
        if cfg.get("peft_type", "LORA") not in ("LORA", None):
            raise ValueError(f"adapter peft_type {cfg.get('peft_type')!r} is not supported (LORA)")
        bad = [f"{k}={cfg[k]!r}" for k, default in _UNSUPPORTED.items()
               if cfg.get(k) not in (default, None, [], {})]  # fmt: skip
        if bad:
            raise ValueError(f"unsupported LoRA adapter options: {bad} (expert LoRA, DoRA, "
                             "biases, per-module ranks and modules_to_save are not applied)")  # fmt: skip
        r = cfg.get("r")
        if not isinstance(r, int) or r <= 0:
            raise ValueError(f"adapter r must be a positive int, got {r!r}")
        targets = cfg.get("target_modules") or TARGETS
        if targets == "all-linear":
            targets = TARGETS
        if not isinstance(targets, str):
            targets = tuple(sorted(targets))
            unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in TARGETS]
            if unknown:
                raise ValueError(f"LoRA target_modules {unknown} are not supported: only the "
                                 f"projections {list(TARGETS)} take an adapter")  # fmt: skip
        return cls(r, float(cfg.get("lora_alpha", r)), targets, bool(cfg.get("use_rslora")))


class LoraLinear(nn.Linear):
    """An nn.Linear (same `weight`/`bias` parameters, same names) plus `lora_A`/`lora_B`."""

    def __init__(self, base: nn.Linear, spec: LoraSpec) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # shared: references (packs, CUDA graphs) stay valid
        self.register_parameter("bias", base.bias)
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(base.in_features, spec.r, bias=False, **kw)
        self.lora_B = nn.Linear(spec.r, base.out_features, bias=False, **kw)
        nn.init.zeros_(self.lora_A.weight)
        nn.init.zeros_(self.lora_B.weight)  # a fresh adapter adds nothing
        scale = torch.tensor(spec.scale, dtype=torch.float32, device=base.weight.device)
        self.register_buffer(SCALE, scale)  # 0-d: the activations keep their dtype

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """scale * B(A(x)), in PEFT's order of operations."""
        return self.lora_B(self.lora_A(x)) * self.lora_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_delta(x)


def is_adapter_name(name: str) -> bool:
    return any(m in name for m in _ADAPTER_MARKERS) or is_scale_name(name)


def is_scale_name(name: str) -> bool:
    """An adapter's scale (optional in an update: without it the engine's stays)."""
    return name.endswith("." + SCALE)


def _targeted(name: str, spec: LoraSpec) -> bool:
    if isinstance(spec.target_modules, str):
        return re.fullmatch(spec.target_modules, name) is not None
    return any(name == t or name.endswith("." + t) for t in spec.target_modules)


def apply_lora(model: nn.Module, spec: LoraSpec) -> list[str]:
    """Wrap the targeted projections of `model` in LoraLinear (zero adapter); returns their
    names. ValueError when the model already has an adapter or nothing is targeted, or when a
    target is not a supported projection (the router, experts, embeddings, the head)."""
    if lora_spec(model) is not None:
        raise ValueError("the model already has a LoRA adapter")
    chosen = [(n, m) for n, m in model.named_modules() if n and _targeted(n, spec)]
    wrong = [n for n, m in chosen
             if not isinstance(m, nn.Linear) or n.rsplit(".", 1)[-1] not in TARGETS]  # fmt: skip
    if wrong:
        raise ValueError(f"LoRA target_modules match modules that cannot take an adapter: "
                         f"{wrong[:5]} (only the projections {list(TARGETS)} are supported)")  # fmt: skip
    if not chosen:
        raise ValueError(f"LoRA target_modules {spec.target_modules!r} match no projection")
    for name, module in chosen:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, LoraLinear(module, spec))
    model.lora = spec  # plain attribute: what the adapter was built for
    return [n for n, _ in chosen]


def lora_spec(model: nn.Module) -> LoraSpec | None:
    """The adapter spec of a model with LoRA applied; None without one."""
    spec = getattr(model, "lora", None)
    return spec if isinstance(spec, LoraSpec) else None


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The engine model's adapter tensors and scales (engine names), detached."""
    return {n: t.detach() for n, t in model.state_dict(keep_vars=True).items()
            if is_adapter_name(n)}  # fmt: skip


def scales_of(adapter: Iterable[str], spec: LoraSpec) -> dict[str, torch.Tensor]:
    """`<module>.lora_scale` at `spec`'s scale for each module of the adapter names given."""
    modules = {n.rsplit(".lora_A.", 1)[0] for n in adapter if ".lora_A." in n}
    return {f"{m}.{SCALE}": torch.tensor(spec.scale, dtype=torch.float32) for m in sorted(modules)}


def from_peft_names(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's adapter names (`base_model.model.X.lora_A.weight`, with or without an adapter
    name such as `.lora_A.default.weight`) -> the engine's (`X.lora_A.weight`)."""
    experts = [n for n in tensors if ".experts." in n]
    if experts:  # transformers 4.x / per-expert Linear modules: the engine stacks experts
        raise ValueError(f"LoRA on MoE experts is not supported (adapter tensors {experts[:3]}); "
                         "target the attention and shared-expert projections")  # fmt: skip
    out = {}
    for name, t in tensors.items():
        name = name.removeprefix(PEFT_PREFIX)
        name = re.sub(r"\.(lora_[AB])\.[^.]+\.weight$", r".\1.weight", name)
        out[name] = t
    return out


def load_adapter(model: nn.Module, path: str | os.PathLike) -> LoraSpec:
    """Apply the PEFT adapter folder `path` to `model` (unmerged); every adapter tensor must be
    in the file and every tensor in the file must be one (ValueError naming them)."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file, weights = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not cfg_file.is_file() or not weights.is_file():
        raise FileNotFoundError(f"a LoRA adapter folder needs {CONFIG_FILE} and {WEIGHTS_FILE}: "
                                f"{path}")  # fmt: skip
    spec = LoraSpec.from_peft(json.loads(cfg_file.read_text()))
    apply_lora(model, spec)
    tensors = from_peft_names(load_file(str(weights)))
    load_adapter_tensors(model, tensors)
    return spec


@torch.no_grad()
def load_adapter_tensors(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy a whole adapter (engine names) into `model`; ValueError before any copy."""
    params = adapter_state_dict(model)
    missing = sorted(n for n in set(params) - set(tensors) if not is_scale_name(n))
    unexpected = sorted(set(tensors) - set(params))
    wrong = [f"{n}: {tuple(t.shape)} vs model {tuple(params[n].shape)}"
             for n, t in tensors.items() if n in params and t.shape != params[n].shape]  # fmt: skip
    if missing or unexpected or wrong:
        raise ValueError(f"adapter does not fit the model: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}, mis-shaped {wrong[:5]}")  # fmt: skip
    for n, t in tensors.items():
        params[n].copy_(t)


def save_adapter(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write the model's adapter as a PEFT folder (loadable by PEFT and by `load_adapter`)."""
    from safetensors.torch import save_file

    spec = lora_spec(model)
    if spec is None:
        raise ValueError("the model has no LoRA adapter to save")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    targets = spec.target_modules
    tensors = adapter_state_dict(model)
    scales = {float(t) for n, t in tensors.items() if is_scale_name(n)}
    if len(scales) > 1:
        raise ValueError(f"the adapter's modules have different scales {sorted(scales)}: PEFT's "
                         "adapter_config.json holds one lora_alpha")  # fmt: skip
    scale = scales.pop() if scales else spec.scale  # the pushed one, if an update changed it
    alpha = scale * (math.sqrt(spec.r) if spec.use_rslora else spec.r)
    cfg = {"peft_type": "LORA", "r": spec.r, "lora_alpha": alpha,
           "use_rslora": spec.use_rslora, "bias": "none", "lora_dropout": 0.0,
           "task_type": "CAUSAL_LM",
           "target_modules": targets if isinstance(targets, str) else list(targets)}  # fmt: skip
    (path / CONFIG_FILE).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tensors = {PEFT_PREFIX + n: t.to("cpu").contiguous()
               for n, t in tensors.items() if not is_scale_name(n)}  # fmt: skip
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    return path


def peft_adapter(source: Any) -> dict[str, torch.Tensor] | None:
    """A PEFT-wrapped model's active adapter in the engine's names, with its scale per module
    (what an adapter-only `update_weights` sends: the engine applies the trainer's scale);
    None when `source` is not a PEFT model."""
    if not is_peft_model(source):
        return None
    from peft import get_peft_model_state_dict

    name = getattr(source, "active_adapter", "default")
    cfg = source.peft_config[name]
    spec = LoraSpec.from_peft(cfg.to_dict())  # refuse what the engine would not apply, by name
    sd = get_peft_model_state_dict(source, adapter_name=name)
    adapter = {n: t.detach() for n, t in from_peft_names(sd).items()}
    return {**adapter, **scales_of(adapter, spec)}


def is_peft_model(source: Any) -> bool:
    return hasattr(source, "peft_config") and hasattr(source, "get_base_model")


def peft_parts(source: Any) -> tuple[nn.Module, dict[str, torch.Tensor], LoraSpec, dict]:
    """A PEFT-wrapped transformers model -> (its transformers model, its base weights under
    transformers' names, the adapter's LoraSpec, the adapter in the engine's names): what
    `rollout.models.from_transformers` builds an unmerged engine model from."""
    name = getattr(source, "active_adapter", "default")
    spec = LoraSpec.from_peft(source.peft_config[name].to_dict())
    hf = source.get_base_model()
    base = {n.replace(".base_layer.", "."): t.detach() for n, t in hf.state_dict().items()
            if not is_adapter_name(n)}  # fmt: skip
    return hf, base, spec, peft_adapter(source)


def update_scope(target: Iterable[str], update: Iterable[str]) -> set[str]:
    """The names a complete update must cover. Without an adapter: all of the model's. With
    one: the adapter alone (an adapter update), the base alone (a full-weight update of the base
    model, the adapter kept), or both; the adapter's scales are optional."""
    target = {n for n in target if not is_scale_name(n)}
    adapter = {n for n in target if is_adapter_name(n)}
    if not adapter:
        return target
    names = {n for n in update if not is_scale_name(n)}
    if names and names <= adapter:
        return adapter
    if not names & adapter:
        return target - adapter
    return target
