"""The random-reward control: a reward plug-in that tosses a coin, knowing nothing of the task.

    python train.py --reward label examples/random_reward.py:coin --reward-weight 0 1
    python -m grpo_vlm --reward label examples/random_reward.py:coin --reward-weight 0 1

The first --reward is the accuracy the held-out evaluation reports (label, weighted 0: it earns nothing);
the coin, weighted 1, is the whole training signal. Run it with the same seeds as the setting it controls
(scripts/seeds.py): a setting "learns" only where its held-out accuracy beats this control's by more than
the seeds' spread. Its twin, the no-update control, is the same run with the learning rate at 0.

Why a control: GRPO moves the policy toward whatever its rewards favour within each group, and on some
models even random or spurious rewards raise accuracy (the update sharpens what the model already does,
for instance its format or its most likely verdict). A gain that the coin reproduces is not the task's.

The coin is a pure function of (completion, sample): the SHA-256 of the sample's id (or its place in the
data, or its prompt) and the completion's text, so the same completion of the same sample earns the same
reward in every step, run, process and machine (Python's own `hash` is salted per process), and a group's
completions that differ in text draw independent coins, heads (1.0) with probability 1/2. Standard library
only, so that either trainer imports it as a file.
"""

import hashlib
import json
from collections.abc import Mapping
from typing import Any


def coin(completion: str, sample: Mapping[str, Any]) -> float:
    """1.0 or 0.0, each with probability 1/2, the same for the same (completion, sample)."""
    key = sample.get("id", sample.get("_where", sample.get("prompt")))
    digest = hashlib.sha256(json.dumps([str(key), completion], ensure_ascii=False).encode("utf-8")).digest()
    return float(digest[0] & 1)
