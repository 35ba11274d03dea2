"""SyncBatchNorm on real Gloo ranks equals one BatchNorm over the concatenated batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bagua_lightning.engine.contrib.sync_batchnorm import SyncBatchNorm
from tests.ranks import run_ranks

WORKER = str(Path(__file__).with_name("workers.py"))


@pytest.mark.parametrize(("world", "uneven"), [(2, False), (2, True), (4, True)])
def test_matches_batchnorm_over_all_ranks(tmp_path: Path, world: int, uneven: bool) -> None:
    args = ["sync_bn", "--backend", "gloo"] + (["--uneven"] if uneven else [])
    out = run_ranks(WORKER, args, world_size=world, log_dir=tmp_path, timeout_s=120)
    assert out.count("sync_bn ok") == world


def test_single_process_is_plain_batchnorm() -> None:
    torch.manual_seed(0)
    ref = torch.nn.BatchNorm1d(4)
    bn = SyncBatchNorm.convert_sync_batchnorm(torch.nn.BatchNorm1d(4))
    assert isinstance(bn, SyncBatchNorm)
    x = torch.randn(8, 4)
    torch.testing.assert_close(bn(x), ref(x))
    torch.testing.assert_close(bn.running_var, ref.running_var)


def test_bad_input_names_the_shape() -> None:
    with pytest.raises(ValueError, match="1D input"):
        SyncBatchNorm(4)(torch.randn(4))
    with pytest.raises(ValueError, match="3 channels"):
        SyncBatchNorm(4)(torch.randn(2, 3))
