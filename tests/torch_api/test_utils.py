"""``bagua_lightning.torch_api.utils`` and ``bagua_define``: Bagua's helpers with Bagua's values."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from bagua_lightning.torch_api import utils
from bagua_lightning.torch_api.bagua_define import (
    BaguaHyperparameter,
    TensorDeclaration,
    TensorDtype,
    get_tensor_declaration_bytes,
)


def test_statistical_average_interpolates_windows() -> None:
    # Bagua's own case: 1 s after these records, record 6.0, then ask for several window lengths.
    m = utils.StatisticalAverage(last_update_time=time.time() - 1.0, records=[5.0, 4.5005175, 3.5034241850204078],
                                 record_tail=(2.0166309999999985, 2.499061185570463))
    m.record(6.0)
    answers = [(1.0, 6.0), (2.0, (6.0 + 5.0) / 2), (3.0, (6.0 + 4.5005175 * 2) / 3),
               (5.0, (6.0 + 3.5034241850204078 * 4) / 5), (7.0, (6.0 + 2.499061185570463 * 6.0166309999999985) / 7)]
    for seconds, want in answers:
        assert m.get_records_mean(seconds) == pytest.approx(want, abs=0.1), (seconds, str(m))
    assert m.total_recording_time() == pytest.approx(4.0 + 2.0166309999999985 + 1, abs=0.1)


def test_statistical_average_edges() -> None:
    m = utils.StatisticalAverage()
    assert m.get_records_mean(0.0) == 0.0 and m.total_recording_time() == 0.0
    m.record(2.0)
    m.record(4.0)  # within a second: no window is full yet, the tail holds the mix
    tail_len, tail_mean = m.record_tail
    assert m.records == [] and 0.0 <= tail_len < 1.0 and 2.0 <= tail_mean <= 4.0, str(m)
    assert m.get(100.0) == tail_mean and m.get_records_mean(0.5) == tail_mean


def test_flatten_round_trip_and_contiguity() -> None:
    ts = [torch.arange(3.0), torch.ones(2, 2)]
    flat = utils.flatten(ts)
    assert flat.tolist() == [0.0, 1.0, 2.0, 1.0, 1.0, 1.0, 1.0]
    back = utils.unflatten(flat, ts)
    assert [b.shape for b in back] == [torch.Size([3]), torch.Size([2, 2])]
    assert utils.check_contiguous(back) and not utils.check_contiguous([ts[1], ts[0]])
    assert utils.get_flattened_tensor(ts).tolist() == flat.tolist() and utils.get_flattened_tensor([]) is None
    assert utils.align_size(10, 8) == 16 and utils.align_size(16, 8) == 16


def test_apply_flattened_call_writes_back() -> None:
    ts = [torch.ones(2), torch.ones(3)]
    utils.apply_flattened_call_all(ts, lambda flat: flat.mul_(3))
    assert ts[0].tolist() == [3.0, 3.0] and ts[1].tolist() == [3.0] * 3


def test_dtype_and_op_names() -> None:
    assert [utils.to_bagua_datatype(d) for d in (torch.float32, torch.float16, torch.uint8, torch.int64)] == \
        ["f32", "f16", "u8", "i64"]
    with pytest.raises(ValueError, match="bfloat16"):
        utils.to_bagua_datatype(torch.bfloat16)
    assert utils.to_bagua_reduce_op(dist.ReduceOp.BXOR) == 9 and utils.to_bagua_reduce_op(dist.ReduceOp.MAX) == 3


def test_average_by_removing_extreme_values() -> None:
    mean, std, kept = utils.average_by_removing_extreme_values([100.0, 1.0, 2.0, 10.0, 10.0, 10.0, 11.0, 9.0, 50.0])
    assert 50.0 not in kept and 100.0 not in kept and mean == pytest.approx(sum(kept) / len(kept))
    assert std >= 0


def test_bagua_hyperparameter() -> None:
    hp = BaguaHyperparameter(is_hierarchical_reduce=False)
    buckets = [[TensorDeclaration({"name": "A", "num_elements": 123, "dtype": TensorDtype.F32})]]
    assert hp.update({"buckets": buckets, "bucket_size": 492}) is hp
    assert hp.buckets == buckets and hp.bucket_size == 492 and hp.is_hierarchical_reduce is False
    assert BaguaHyperparameter.parse_obj(hp.dict()) == hp
    assert get_tensor_declaration_bytes(buckets[0][0]) == 492
    with pytest.raises(ValueError, match="bucket_sizes"):
        hp.update({"bucket_sizes": 1})


def test_bagua_define_at_the_package_root() -> None:
    from bagua_lightning.bagua_define import BaguaHyperparameter as Root

    assert Root is BaguaHyperparameter
