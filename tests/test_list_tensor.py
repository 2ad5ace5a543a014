"""``list_tensor`` (rollout/base.py), the records' lists as tensors through NumPy: the very bits
``torch.tensor`` gives, for the values records hold and their limit cases."""

import math
import random
import struct

import pytest
import torch

from masktrl.rollout.base import list_tensor

BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.long: torch.long}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def random_doubles(rng: random.Random, n: int) -> list[float]:
    """Doubles of every kind: any bit pattern (NaN payloads aside), log-probabilities, values
    halfway between two float32s, float32 subnormals, past float32's range, signed zeros."""
    out = []
    for _ in range(n):
        kind = rng.randrange(6)
        if kind == 0:
            x = struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0]
            out.append(0.0 if math.isnan(x) else x)
        elif kind == 1:
            out.append(-rng.expovariate(0.3))
        elif kind == 2:  # exactly between two neighbouring float32s: rounding to even decides
            f = struct.unpack("<f", struct.pack("<f", rng.uniform(-10, 10)))[0]
            up = struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", f))[0] + 1))[0]
            out.append((f + up) / 2)
        elif kind == 3:
            out.append(rng.uniform(-1, 1) * 1e-40)
        elif kind == 4:
            out.append(rng.choice([1, -1]) * rng.uniform(3.4e38, 1e300))
        else:
            out.append(rng.choice([0.0, -0.0, math.inf, -math.inf]))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_floats_flat_and_nested_have_torch_tensors_bits(dtype):
    rng = random.Random(0)
    for n in (0, 1, 7, 1000):
        flat = random_doubles(rng, n)
        assert same_bits(list_tensor(flat, dtype), torch.tensor(flat, dtype=dtype))
        rows = [random_doubles(rng, 20) for _ in range(n)]
        assert same_bits(list_tensor(rows, dtype), torch.tensor(rows, dtype=dtype))
    nan = list_tensor([math.nan, -math.inf], dtype)
    assert math.isnan(nan[0].item()) and nan[1].item() == -math.inf


def test_integers_flat_and_nested_and_on_a_device():
    rng = random.Random(1)
    for n in (0, 1, 5, 1000):
        flat = [rng.randrange(-(2**63), 2**63) for _ in range(n)]
        assert same_bits(list_tensor(flat, torch.long), torch.tensor(flat, dtype=torch.long))
        rows = [[rng.randrange(151_936) for _ in range(20)] for _ in range(n)]
        assert same_bits(list_tensor(rows, torch.long, "cpu"), torch.tensor(rows, dtype=torch.long, device="cpu"))


def test_other_dtypes_go_to_torch_and_ragged_lists_are_refused_alike():
    values = [0.1, 1e-3, 3.0]
    assert torch.equal(list_tensor(values, torch.bfloat16), torch.tensor(values, dtype=torch.bfloat16))
    ragged = [[1, 2], [3]]
    with pytest.raises(ValueError):
        torch.tensor(ragged, dtype=torch.long)
    with pytest.raises(ValueError):
        list_tensor(ragged, torch.long)
