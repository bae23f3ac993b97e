"""vLLM's sleep for the weights, at engine level (rollout.engine.weights_residency): discarded
weights free every byte of the state dict, no step runs until an update lands, in-flight
requests carry over, and an update (in place or staged) restores a model that generates exactly
what a plain forward of the new weights does. On a CPU engine "offload" moves nothing."""

from __future__ import annotations

import pytest
import torch
from reference import greedy, prompts_of, tiny_model

from rollout.engine import weights_residency as residency
from rollout.engine.weights_residency import HOST_NOTE, WeightsResidency
from tests.test_engine import GREEDY, engine


def _bytes(model: torch.nn.Module) -> int:
    seen = {}
    for t in model.state_dict(keep_vars=True).values():
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _run(eng, ids):
    while eng.has_unfinished_requests():
        eng.step()
    return [eng._seqs.get(i) for i in ids]


def test_discard_frees_every_weight_byte_and_holds_until_an_update():
    model, new = tiny_model(seed=0), tiny_model(seed=5)
    eng = engine(model, block_size=4)
    (p,) = prompts_of([9], seed=2)
    rec = eng.add_request(None, p, GREEDY.replace(num_tokens_to_generate=12))
    for _ in range(4):  # prefill + a few decode steps: in flight with tokens of version 0
        eng.step()
    with pytest.raises(RuntimeError, match="suspend"):
        eng.release_weights("discard")
    size = _bytes(model)
    eng.suspend("recompute")
    out = eng.release_weights("discard")
    assert out == {"weights": "discarded", "weights_bytes_freed": size} and size > 0
    assert all(t.untyped_storage().nbytes() == 0 for t in model.state_dict().values())
    assert eng.stats()["weights"] == "discarded"
    eng.resume()  # the KV pool back; the weights are not
    with pytest.raises(RuntimeError, match="discarded"):
        eng.step()
    assert not rec.requests[-1].generated_tokens or len(rec.merge().generated_tokens) < 12
    sd = {k: v.clone() for k, v in new.state_dict().items()}
    eng.update_weights(sd, 1)
    assert eng.stats()["weights"] == "resident" and _bytes(model) == size
    _run(eng, [rec.request_id])
    req = rec.merge()
    pairs = zip(req.generated_tokens, req.generated_weight_versions, strict=True)
    before = [t for t, v in pairs if v == 0]
    assert len(req.generated_tokens) == 12 and 0 < len(before) < 12
    want = greedy(new, p + before, 12 - len(before))  # the rest: the new weights' own tokens
    assert req.generated_tokens[len(before) :] == want
    assert eng.generate([p], GREEDY)[0].generated_tokens == greedy(new, p, 8)


def test_staged_updates_after_a_discard_flip_into_fresh_memory():
    model, new, newer = tiny_model(seed=0), tiny_model(seed=6), tiny_model(seed=7)
    eng = engine(model, block_size=4, weight_update="staged")
    (p,) = prompts_of([7], seed=3)
    eng.stage_weights(dict(new.state_dict()), 1)  # the buffer exists: it is freed too
    eng.weight_stage.staged = None
    buffer = sum(t.nbytes for t in new.state_dict().values())  # one per name, tied ones too
    eng.suspend("recompute")
    out = eng.release_weights("discard")
    assert out["weights_bytes_freed"] == _bytes(new) + buffer  # the weights and the buffer
    eng.resume()
    for version, m in ((1, new), (2, newer)):  # the second stage reuses the swapped buffer
        with eng.weight_stage.hold():
            staged = eng.stage_weights(dict(m.state_dict()), version)
            eng.flip_weights(staged)
        assert eng.generate([p], GREEDY)[0].generated_tokens == greedy(m, p, 8)


def test_offload_on_cpu_moves_nothing():
    model = tiny_model(seed=0)
    eng = engine(model, block_size=4)
    (p,) = prompts_of([6], seed=4)
    eng.suspend("offload")
    assert eng.release_weights("offload") == {"weights": HOST_NOTE, "weights_bytes_freed": 0}
    eng.resume()
    assert eng.generate([p], GREEDY)[0].generated_tokens == greedy(model, p, 8)


def test_offload_copies_out_and_back_where_the_device_is_not_the_host(monkeypatch):
    """The CUDA path's logic on CPU memory: each storage goes to a host copy, its device
    memory is freed, and resume brings back the same bytes (the weights serve unchanged)."""
    monkeypatch.setattr(residency, "on_host", lambda model: False)
    model = tiny_model(seed=0)
    eng = engine(model, block_size=4)
    (p,) = prompts_of([6], seed=8)
    size = _bytes(model)
    eng.suspend("offload")
    assert eng.release_weights("offload") == {"weights": "offloaded", "weights_bytes_freed": size}
    assert eng.release_weights("offload")["weights_bytes_freed"] == 0  # idempotent
    assert all(t.untyped_storage().nbytes() == 0 for t in model.state_dict().values())
    eng.resume()
    assert eng.stats()["weights"] == "resident" and _bytes(model) == size
    assert eng.generate([p], GREEDY)[0].generated_tokens == greedy(tiny_model(seed=0), p, 8)


def test_an_update_after_a_discard_must_rebuild_every_storage():
    m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    res = WeightsResidency(m)
    assert res.release("discard")["weights_bytes_freed"] == 4 * (6 + 2 + 4 + 2)
    with pytest.raises(ValueError, match="whole model; missing"):
        res.check_covers(["0.weight", "0.bias"])  # a LoRA-style partial update
    res.check_covers(["0.weight", "0.bias", "1.weight", "1.bias"])
    res.materialize()
    assert m[0].weight.untyped_storage().nbytes() == 24 and res.missing
    res.loaded()
    assert not res.missing and res.state == "resident"
