"""The proto contract: stubs are fresh, plans convert losslessly, bad declarations are refused."""

from __future__ import annotations

import pytest

from bagua_lightning.proto import codegen
from bagua_lightning.proto.plan import (
    BucketPlan,
    TensorDeclaration,
    plan_from_proto,
    plan_to_proto,
    split_into_buckets,
)

MB = 1024**2


def _abcde() -> list[TensorDeclaration]:
    return [TensorDeclaration(n, s * MB // 4, "f32") for n, s in zip("ABCDE", [4, 8, 12, 16, 20], strict=True)]


def test_committed_stubs_match_the_proto() -> None:
    assert codegen.stale_files() == []


def test_plan_round_trips_through_the_wire_message() -> None:
    plan = BucketPlan(split_into_buckets(_abcde(), 20 * MB), bucket_size=20 * MB, is_hierarchical_reduce=True,
                      version=3)
    back = plan_from_proto(plan_to_proto(plan))
    assert back == plan
    assert back.tensor_names == [["A", "B", "C"], ["D", "E"]]


def test_split_closes_buckets_at_size_and_groups_by_dtype() -> None:
    tensors = [TensorDeclaration("h1", MB, "f16"), TensorDeclaration("f1", MB, "f32"),
               TensorDeclaration("h2", MB, "f16"), TensorDeclaration("f2", MB, "f32")]
    assert [[t.name for t in b] for b in split_into_buckets(tensors, 4 * MB)] == [["h1", "h2"], ["f1"], ["f2"]]
    assert [[t.name for t in b] for b in split_into_buckets(tensors, MB, whether_to_bucket=False)] == [
        ["h1", "h2"], ["f1", "f2"]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "", "num_elements": 1}, "non-empty"),
        ({"name": "w", "num_elements": 0}, "must be > 0"),
        ({"name": "w", "num_elements": 3, "dtype": "f128"}, "'f128'"),
    ],
)
def test_bad_declarations_name_the_value(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TensorDeclaration(**kwargs)  # type: ignore[arg-type]


def test_plan_rejects_mixed_dtype_buckets_and_duplicates() -> None:
    a, b = TensorDeclaration("a", 1, "f32"), TensorDeclaration("b", 1, "f16")
    with pytest.raises(ValueError, match="mixes dtypes"):
        BucketPlan(((a, b),))
    with pytest.raises(ValueError, match="more than one bucket"):
        BucketPlan(((a,), (a,)))


def test_dict_shape_matches_bagua() -> None:
    plan = BucketPlan.from_dict({"buckets": [[{"name": "w", "num_elements": 4, "dtype": "f32"}]],
                                 "bucket_size": 16, "is_hierarchical_reduce": False})
    assert plan.to_dict()["buckets"] == [[{"name": "w", "num_elements": 4, "dtype": "f32"}]]
    with pytest.raises(ValueError, match="unknown keys"):
        TensorDeclaration.coerce({"name": "w", "num_elements": 4, "dtyp": "f32"})
