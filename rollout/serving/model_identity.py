"""Which model an engine serves, in a few hundred bytes: what the coordinator compares when an
engine registers.

An engine started with another model than the service's (the right token, other shapes) would
take requests, answer them from the wrong model, and make every weight update fail: the
trainer's tensors do not fit it, and an update is all-or-nothing. So each engine registers with
its model's identity (`model_identity`): the architecture, the config numbers that fix the
shapes, the parameter count, the dtypes, and a fingerprint of every parameter's name, shape and
dtype. The coordinator keeps the first registered engine's identity as the service's and refuses
an engine whose identity differs (`mismatch` names what differs), so the misfit exits with that
message and never becomes a member the others' updates wait for.

The same architecture with other weights (base vs instruct, another step) has the same shapes:
so the identity also holds `weights`, a digest of the weights computed at load (`weights_digest`:
blake2b over a fixed sample of each tensor's bytes, 64 KiB of each). While no trainer pushes
weights, the service's weights are its checkpoint's and an engine with another digest is refused
(`refusal(..., weights_managed=False)`); once a trainer pushes them, the digest says nothing
about what an engine will serve (the coordinator holds an engine until the trainer sent it the
current weights), so it is not compared.
"""

from __future__ import annotations

import hashlib
from typing import Any

# The config numbers that fix a decoder's parameter shapes (rollout.models.config.ModelConfig)
SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)
# What `mismatch` compares, most telling first (the fingerprint catches what the rest miss)
COMPARED = ("architecture", *SHAPE_KEYS, "parameters", "tensors", "dtypes", "fingerprint")
MAX_ENTRIES = 32  # an identity is a small flat dict; anything larger is refused unread
SAMPLE_CHUNKS, CHUNK_BYTES = 16, 4096  # the bytes of a tensor the weights digest reads
Identity = dict[str, Any]


def model_identity(engine: Any) -> Identity:
    """The identity of the model `engine` serves. An engine without a torch model (a stand-in,
    a cluster) is identified by its type alone."""
    from torch import nn  # here: the coordinator compares identities without loading torch

    model = engine.model
    if not isinstance(model, nn.Module):
        return {"architecture": type(engine).__name__}
    config = getattr(model, "config", None)
    ident: Identity = {"architecture": str(getattr(config, "architecture", type(model).__name__))}
    for key in SHAPE_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, (bool, int)):
            ident[key] = value
    tensors = model.state_dict()
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}\n".encode())
    ident["parameters"] = sum(p.numel() for p in model.parameters())
    ident["tensors"] = len(tensors)
    ident["dtypes"] = ",".join(
        sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
    )
    ident["fingerprint"] = digest.hexdigest()[:16]
    ident["weights"] = weights_digest(tensors)
    return ident


def weights_digest(tensors: dict) -> str:
    """blake2b of each tensor's name and a fixed sample of its bytes: all of a tensor up to
    SAMPLE_CHUNKS * CHUNK_BYTES, else that many chunks evenly spread. Cheap (milliseconds for
    the 'small' preset where hashing every byte takes ~0.5 s) and deterministic; two
    checkpoints of one architecture differ in nearly every tensor, so any sample tells them
    apart."""
    import torch

    digest = hashlib.blake2b(digest_size=8)
    for name in sorted(tensors):
        flat = tensors[name].detach().contiguous().reshape(-1).view(torch.uint8)
        n = flat.numel()
        if n > SAMPLE_CHUNKS * CHUNK_BYTES:
            stride = (n - CHUNK_BYTES) // (SAMPLE_CHUNKS - 1)
            flat = torch.cat([flat[i * stride : i * stride + CHUNK_BYTES]
                              for i in range(SAMPLE_CHUNKS)])  # fmt: skip
        digest.update(name.encode())
        digest.update(flat.cpu().numpy().tobytes())
    return digest.hexdigest()


def malformed(ident: Any) -> str | None:
    """Why a registration's identity is unusable, or None."""
    if not isinstance(ident, dict) or not ident or len(ident) > MAX_ENTRIES:
        return f"model identity must be a dict of 1 to {MAX_ENTRIES} entries"
    for k, v in ident.items():
        if not isinstance(k, str) or not isinstance(v, (str, int, float, bool, type(None))):
            return f"model identity entry {k!r} must map a name to a number or a string"
    return None


def mismatch(engine: Identity, service: Identity) -> str | None:
    """What differs between an engine's identity and the service's ("hidden_size 128 here, 64
    in the service; ..."), or None when they match. The fingerprint is named only when nothing
    more telling differs (parameter names, or shapes the config numbers do not show)."""
    diffs = [
        f"{key} {engine.get(key)!r} here, {service.get(key)!r} in the service"
        for key in COMPARED[:-1]
        if engine.get(key) != service.get(key) and (key in engine or key in service)
    ]
    if not diffs and engine.get("fingerprint") != service.get("fingerprint"):
        diffs.append(f"parameter names or shapes: fingerprint {engine.get('fingerprint')!r} "
                     f"here, {service.get('fingerprint')!r} in the service")  # fmt: skip
    return "; ".join(diffs) or None


def summary(ident: Identity) -> str:
    """One line for logs: 'llama hidden_size=64 ... (fingerprint 1a2b...)'."""
    fields = " ".join(f"{k}={ident[k]}" for k in COMPARED[1:-1] if k in ident)
    return f"{ident.get('architecture')} {fields} (fingerprint {ident.get('fingerprint')})"


def refusal(engine: Any, service: Identity | None, weights_managed: bool = False) -> str | None:
    """The coordinator's answer to a registration naming `engine` as its model, when the service
    serves `service` (None: this is the first engine, whose model becomes the service's): the
    refusal message, or None to admit it. The weights digest is compared only while no trainer
    pushes weights (`weights_managed` False)."""
    why = malformed(engine)
    if why is not None:
        return f"invalid registration: {why}"
    diff = None if service is None else mismatch(engine, service)
    if diff is not None:
        return (f"model mismatch: this engine's model is not the service's ({diff}); "
                f"start it with the model the service runs")  # fmt: skip
    if service is None or weights_managed or engine.get("weights") == service.get("weights"):
        return None
    return (f"model mismatch: this engine's weights are not the service's (weights digest "
            f"{engine.get('weights')!r} here, {service.get('weights')!r} in the service: another "
            f"checkpoint of the same architecture); start it from the service's checkpoint, or "
            f"attach a trainer that pushes its weights")  # fmt: skip
