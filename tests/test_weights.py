"""In-process weight updates: validate everything first, copy in place, never half-apply."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rollout.weights.layout import bucket_checksum, plan_layout
from rollout.weights.state import as_state_dict, copy_weights_, state_dict_checksum


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 11))
    net[3].weight = net[0].weight  # tied, like lm_head / embed_tokens
    return net


def test_copy_from_module_in_place_keeps_storage_and_ties():
    dst, src = _net(0), _net(1)
    ptr = dst[1].weight.data_ptr()
    nbytes = copy_weights_(dst, src)
    assert dst[1].weight.data_ptr() == ptr
    assert nbytes == sum(t.numel() * t.element_size() for t in dst.state_dict().values())
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k
    assert dst[3].weight is dst[0].weight
    assert state_dict_checksum(dst) == state_dict_checksum(src)


def test_mismatch_leaves_old_weights_and_names_every_problem():
    dst = _net(0)
    before = state_dict_checksum(dst)
    sd = as_state_dict(_net(1))
    sd["1.weight"] = torch.zeros(8, 9)  # wrong shape, validated after a good tensor in order
    sd["2.bias"] = sd["2.bias"].double()
    sd["extra"] = torch.zeros(1)
    del sd["1.bias"]
    with pytest.raises(ValueError) as e:
        copy_weights_(dst, sd)
    msg = str(e.value)
    for needle in ("1.weight: shape", "2.bias: dtype", "unexpected tensors ['extra']", "missing"):
        assert needle in msg, msg
    assert state_dict_checksum(dst) == before


def test_partial_and_cast_are_opt_in():
    dst = _net(0)
    sd = {"2.bias": torch.ones(8, dtype=torch.float64)}
    with pytest.raises(ValueError, match="missing"):
        copy_weights_(dst, sd, allow_cast=True)
    copy_weights_(dst, sd, strict=False, allow_cast=True)
    assert torch.equal(dst[2].bias, torch.ones(8))
    with pytest.raises(TypeError, match=r"nn\.Module or a state_dict"):
        copy_weights_(dst, [1, 2])


def test_layout_is_aligned_and_checksums_catch_swaps():
    sd = {"a": torch.ones(3, dtype=torch.bfloat16), "b": torch.arange(5), "c": torch.zeros(0)}
    slots, total = plan_layout(sd)
    assert [s.offset % 16 for s in slots] == [0, 0, 0] and total % 16 == 0
    buf = torch.arange(64, dtype=torch.uint8)
    swapped = buf.clone()
    swapped[[0, 4]] = swapped[[4, 0]]
    for algo in ("crc32", "sum"):
        assert bucket_checksum(buf, algo) == bucket_checksum(buf.clone(), algo)
        assert bucket_checksum(buf, algo) != bucket_checksum(swapped, algo)
    with pytest.raises(ValueError, match="checksum algo"):
        bucket_checksum(buf, "md5")


def test_sum_checksum_catches_changes_row_swaps_shifts_and_truncation():
    """The documented power of `sum`: any changed word, rows (4 KiB) moved, a range shifted or
    cut short, the ragged tail. Swapping two words inside one row is out of scope (no byte-range
    transfer can do that) and stays undetected: pinned so a change of algorithm is deliberate."""
    buf = torch.randint(0, 256, (3 * 512 * 8 + 13,), dtype=torch.uint8)
    ref = bucket_checksum(buf, "sum")
    words = buf[: 3 * 512 * 8].view(torch.int64)
    for a, b in ((0, 512), (5, 517), (7, 1500)):  # different rows
        w = buf.clone()
        w[: 3 * 512 * 8].view(torch.int64)[[a, b]] = words[[b, a]]
        assert bucket_checksum(w, "sum") != ref, (a, b)
    for i in (0, 700, 1535):
        w = buf.clone()
        w[: 3 * 512 * 8].view(torch.int64)[i] += 1
        assert bucket_checksum(w, "sum") != ref, i
    shifted = torch.cat([buf[16:], buf[:16]])
    assert bucket_checksum(shifted, "sum") != ref
    assert bucket_checksum(buf[:-8], "sum") != ref
    flipped = buf.clone()
    flipped[-1] ^= 1  # the tail
    assert bucket_checksum(flipped, "sum") != ref
    same_row = buf.clone()
    same_row[: 3 * 512 * 8].view(torch.int64)[[0, 1]] = words[[1, 0]]
    assert bucket_checksum(same_row, "sum") == ref
