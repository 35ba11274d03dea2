"""``bagua_lightning.torch_api.checkpoint``: Bagua's layout, rank 0 writes, every rank loads; weights_only loading."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch

from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.torch_api.checkpoint import load_checkpoint, save_checkpoint
from bagua_lightning.torch_api.checkpoint.checkpointing import TRACKER_FILE
from tests.torch_api.launch import run_case


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))


def test_round_trip_across_two_ranks(tmp_path: Path) -> None:
    out = run_case("checkpoint", world_size=2, log_dir=tmp_path, args=(str(tmp_path / "ckpt"),))
    assert out.count("checkpoint ok") == 2


def test_layout_and_single_process_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    a, b = model(), model()
    opt = torch.optim.Adam(a.parameters(), lr=0.01)
    a(torch.randn(2, 3)).sum().backward()
    opt.step()
    save_checkpoint(3, str(tmp_path), a, opt)
    assert (tmp_path / TRACKER_FILE).read_text() == "3"
    assert (tmp_path / "iter_0000003" / "mp_rank_00_model_states.pt").is_file()
    opt_b = torch.optim.Adam(b.parameters(), lr=0.5)
    assert load_checkpoint(str(tmp_path), b, opt_b) == 3
    for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y)
    assert opt_b.param_groups[0]["lr"] == 0.01 and opt_b.state_dict()["state"][0]["step"] == 1


def test_no_tracker_is_iteration_zero(tmp_path: Path) -> None:
    m = model()
    before = [p.clone() for p in m.parameters()]
    assert load_checkpoint(str(tmp_path / "none"), m) == 0
    assert all(torch.equal(x, y) for x, y in zip(before, m.parameters(), strict=True))


def test_release_and_bad_tracker(tmp_path: Path) -> None:
    a = model()
    (tmp_path / "release").mkdir()
    torch.save({"iteration": 0, "model": a.state_dict()}, tmp_path / "release" / "mp_rank_00_model_states.pt")
    (tmp_path / TRACKER_FILE).write_text("release\n")
    b = model()
    assert load_checkpoint(str(tmp_path), b) == 0
    assert torch.equal(a[0].weight, b[0].weight)
    (tmp_path / TRACKER_FILE).write_text("latest")
    with pytest.raises(ConfigurationError, match="'latest'"):
        load_checkpoint(str(tmp_path), b)


def test_strict_and_missing_optimizer(tmp_path: Path) -> None:
    save_checkpoint(1, str(tmp_path), model())
    bigger = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1), torch.nn.Linear(1, 1))
    with pytest.raises(RuntimeError, match="Missing key"):
        load_checkpoint(str(tmp_path), bigger)
    assert load_checkpoint(str(tmp_path), bigger, strict=False) == 1
    with pytest.raises(ConfigurationError, match="no optimizer state"):
        load_checkpoint(str(tmp_path), model(), torch.optim.SGD(model().parameters(), lr=0.1))


def test_wrapper_prefixes_are_stripped(tmp_path: Path) -> None:
    a = model()
    state = {"iteration": 5, "model": collections.OrderedDict(("module." + k, v) for k, v in a.state_dict().items())}
    (tmp_path / "iter_0000005").mkdir()
    torch.save(state, tmp_path / "iter_0000005" / "mp_rank_00_model_states.pt")
    (tmp_path / TRACKER_FILE).write_text("5")
    b = model()
    assert load_checkpoint(str(tmp_path), b) == 5
    assert torch.equal(a[1].bias, b[1].bias)


class Custom:
    pass


def test_only_weights_are_unpickled(tmp_path: Path) -> None:
    (tmp_path / "iter_0000002").mkdir()
    torch.save({"iteration": 2, "model": model().state_dict(), "optimizer": Custom()},
               tmp_path / "iter_0000002" / "mp_rank_00_model_states.pt")
    (tmp_path / TRACKER_FILE).write_text("2")
    with pytest.raises(ConfigurationError, match="add_safe_globals"):
        load_checkpoint(str(tmp_path), model())


def test_views_of_a_flat_buffer_are_saved_alone(tmp_path: Path) -> None:
    m = torch.nn.Linear(4, 4)
    flat = torch.zeros(1_000_000)
    with torch.no_grad():  # parameters as views into one big buffer, as flattened buckets make them
        flat[:16].copy_(m.weight.view(-1))
        m.weight.data = flat[:16].view(4, 4)
    save_checkpoint(1, str(tmp_path), m)
    assert (tmp_path / "iter_0000001" / "mp_rank_00_model_states.pt").stat().st_size < 100_000


def test_negative_iteration(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="iteration=-1"):
        save_checkpoint(-1, str(tmp_path), model())
