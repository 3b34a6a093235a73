"""checkpoints.py: a checkpoint is data, not code. The trainer state (RNG states included) loads with
`torch.load(weights_only=True)`; a state file whose pickle would run code is refused before anything in it
runs, and a state that is not plain data is refused when it is saved rather than when a resume needs it."""

import pathlib
import random
import re

import numpy as np
import pytest
import torch

from grpo_vlm import checkpoints


class TouchesAMarker:
    """Unpickles by calling Path.touch(marker): the side effect shows whether the pickle was run."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def write_adapter_file(folder: pathlib.Path) -> None:
    (folder / "adapter_model.safetensors").write_bytes(b"weights")


def draws() -> tuple:
    """One draw from every stream, gaussians included (each generator caches the second of a pair)."""
    return (
        torch.rand(4).tolist(),
        random.random(),
        random.gauss(0.0, 1.0),
        np.random.rand(3).tolist(),
        np.random.randn(1).tolist(),
    )


def trained_optimizer() -> torch.optim.Optimizer:
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1)
    layer(torch.randn(5, 3)).sum().backward()
    opt.step()
    return opt


def test_a_state_file_carrying_a_pickled_object_is_refused_without_running_it(tmp_path):
    folder = tmp_path / "checkpoint-000001"
    folder.mkdir()
    marker = tmp_path / "the-pickle-ran"
    torch.save({"step": 1, "payload": TouchesAMarker(marker)}, folder / checkpoints.STATE_FILE)
    assert not marker.exists()  # saving does not run it; only unpickling would
    state_file = re.escape(str(folder / checkpoints.STATE_FILE))
    with pytest.raises(ValueError, match=rf"^{state_file}: not a plain-data trainer state .*refusing"):
        checkpoints.load_checkpoint(folder)
    assert not marker.exists()


def test_a_state_file_of_the_older_format_is_refused_with_a_clear_message(tmp_path):
    folder = tmp_path / "checkpoint-000001"
    folder.mkdir()
    # The format before plain data: numpy's RNG state as an ndarray, python's as tuples.
    old_rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save({"step": 1, "rng": old_rng}, folder / checkpoints.STATE_FILE)
    with pytest.raises(ValueError, match=r"run code to load: numpy\..*older version\?"):
        checkpoints.load_checkpoint(folder)


def test_a_saved_checkpoint_loads_as_plain_data_and_restores_optimizer_and_rng_exactly(tmp_path):
    opt = trained_optimizer()
    random.gauss(0.0, 1.0)  # leave a cached gaussian in python's and numpy's state
    np.random.randn(1)
    folder = checkpoints.save_checkpoint(
        tmp_path / "checkpoint-000007",
        write_adapter=write_adapter_file,
        state={"step": 7, "optimizer": opt.state_dict()},
        keep_last=None,
    )
    after_save = draws()
    plain = torch.load(folder / checkpoints.STATE_FILE, map_location="cpu", weights_only=True)
    state = checkpoints.load_checkpoint(folder)
    assert state["step"] == plain["step"] == 7
    assert (folder / "adapter_model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-000007"]  # no temporary folder left
    fresh = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=0.1)
    fresh.load_state_dict(state["optimizer"])
    for index, tensors in opt.state_dict()["state"].items():
        for key, value in tensors.items():
            assert torch.equal(fresh.state_dict()["state"][index][key], value), key
    assert fresh.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    checkpoints.set_rng_state(plain["rng"])
    assert draws() == after_save


def test_rng_state_survives_a_weights_only_round_trip_and_replays_every_stream(tmp_path):
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    draws()
    torch.save(checkpoints.rng_state(), tmp_path / "rng.pt")
    first = draws()
    draws()
    checkpoints.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert draws() == first


def test_a_state_that_is_not_plain_data_is_refused_at_save_time_and_the_previous_checkpoint_survives(
    tmp_path,
):
    checkpoints.save_checkpoint(
        tmp_path / "checkpoint-1", write_adapter=write_adapter_file, state={"step": 1}, keep_last=1
    )
    with pytest.raises(TypeError, match=r"not plain data \(.*pathlib"):
        checkpoints.save_checkpoint(
            tmp_path / "checkpoint-2",
            write_adapter=write_adapter_file,
            state={"step": 2, "output_dir": pathlib.Path("runs/x")},
            keep_last=1,
        )
    assert [p.name for p in checkpoints.list_checkpoints(tmp_path)] == ["checkpoint-1"]
    assert checkpoints.load_checkpoint(tmp_path / "checkpoint-1")["step"] == 1


@pytest.mark.parametrize("damage", ["garbage", "empty", "cut short"])
def test_a_damaged_or_cut_short_state_file_is_refused_as_unreadable_naming_it(tmp_path, damage):
    folder = checkpoints.save_checkpoint(
        tmp_path / "checkpoint-000001", write_adapter=write_adapter_file, state={"step": 1}, keep_last=None
    )
    path = folder / checkpoints.STATE_FILE
    whole = path.read_bytes()
    path.write_bytes(
        {"garbage": b"not a checkpoint\n", "empty": b"", "cut short": whole[: len(whole) // 2]}[damage]
    )
    with pytest.raises(
        ValueError, match=rf"^{re.escape(str(path))}: unreadable \(.+\); is it damaged or cut short\?$"
    ):
        checkpoints.load_checkpoint(folder)
