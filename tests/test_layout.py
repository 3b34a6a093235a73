"""The two rooms: six reference modules at the top, the full trainer in grpo_vlm/, imports one way.

grpo.py, lora.py and rewards.py each import alone from an empty folder (copy one, it works) and name no
command-line flag; grpo.py's loss half and lora.py, copied alone, train a model of another shape; data.py and
model_io.py may use transformers and PIL; no reference module imports the package (the package's side:
tests/full/test_reference_alone.py).
"""

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ("grpo", "lora", "rewards", "data", "model_io", "train")
# Third-party packages each reference module may import besides the standard library.
THIRD_PARTY = {
    "grpo": {"torch"},
    "lora": {"torch"},
    "rewards": set(),
    "data": {"torch", "PIL", "transformers"},
    "model_io": {"torch", "transformers", "safetensors"},
    "train": {"torch", "tyro"},
}


def imported(path: Path) -> set[str]:
    """The top-level names of every module `path` imports, anywhere in it ('.' for a relative import)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else node.module.split(".")[0])
    return names


def test_the_top_level_holds_the_six_reference_modules_and_nothing_else():
    assert sorted(p.stem for p in ROOT.glob("*.py")) == sorted(REFERENCE)


@pytest.mark.parametrize("name", REFERENCE)
def test_each_reference_module_imports_only_the_reference_and_its_allowed_libraries(name):
    names = imported(ROOT / f"{name}.py")
    own = names & set(REFERENCE)
    extra = names - set(sys.stdlib_module_names) - THIRD_PARTY[name] - own
    assert not extra, f"{name}.py imports {sorted(extra)}"
    assert "grpo_vlm" not in names and "." not in names
    if name in ("grpo", "lora", "rewards"):
        assert not own, f"{name}.py imports {sorted(own)}: it must copy alone"


@pytest.mark.parametrize("name", ["grpo", "lora", "rewards"])
def test_a_leaf_module_imports_alone_from_an_empty_folder_and_names_no_flag(name, tmp_path):
    shutil.copy(ROOT / f"{name}.py", tmp_path)
    command = [sys.executable, "-c", f"import {name}"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)}  # not the project's folder
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    flags = re.findall(r"--[a-z][a-z-]*", (ROOT / f"{name}.py").read_text(encoding="utf-8"))
    assert not flags, f"{name}.py names flags {flags}: it raises in its own terms, train.py names the flag"


# A nanoGPT-shaped model (its own forward, no transformers), LoRA in its last two blocks (`blocks=`), and GRPO
# from grpo.py's loss half: each prompt's G sampled completions, rewarded by their share of one token.
COPY_ALONE = '''"""grpo.py's loss half and lora.py, copied alone, train a nanoGPT-shaped model."""

import torch
from torch import nn
from torch.nn import functional as F

import grpo
import lora

VOCAB, EOS, TARGET, B, G, T = 8, 0, 3, 4, 8, 6


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(self.ln_1(x)).split(x.shape[-1], dim=-1)
        x = x + self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, d: int = 32, n_layer: int = 3) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, d), nn.Embedding(16, d)
        self.h = nn.ModuleList(Block(d) for _ in range(n_layer))
        self.lm_head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(x)  # (rows, length, VOCAB)


torch.manual_seed(0)
model = GPT().eval()
lora.inject_lora(model, r=4, alpha=8.0, blocks=model.h[-2:], targets=("c_attn", "c_proj", "c_fc", "mlp_proj"))
optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=2e-2)
config = grpo.LossConfig(loss_type="dapo", beta=0.04)
prompts = torch.randint(1, VOCAB, (B, 2)).repeat_interleave(G, dim=0)  # (N, 2): prompt b at rows b*G..
for step in range(8):
    with torch.no_grad():  # sample G completions of each prompt, token by token
        ids = prompts
        for _ in range(T):
            probs = F.softmax(model(ids)[:, -1], dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1)], dim=1)
    completion = ids[:, 2:]  # (N, T)
    mask, _ = grpo.completion_mask(completion, EOS)
    reward = ((completion == TARGET) & mask).sum(1) / mask.sum(1)  # the share of TARGET tokens
    adv = grpo.group_advantages(reward, G)

    def logprobs() -> torch.Tensor:  # (N, T): position j predicts token j + 1
        return torch.log_softmax(model(ids)[:, 1:-1].float(), -1).gather(-1, completion[..., None])[..., 0]

    with torch.no_grad(), lora.adapters_disabled(model):
        ref_logp = logprobs()
    logp = logprobs()
    loss, stats = grpo.grpo_loss(logp, logp.detach(), ref_logp, adv, mask, config)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step:2d} reward {reward.mean().item():.3f} loss {loss.item():+.4f} kl {stats['kl']:.4f}")
'''


def test_grpo_and_lora_copied_alone_train_a_nanogpt_shaped_model(tmp_path):
    for name in ("grpo", "lora"):
        shutil.copy(ROOT / f"{name}.py", tmp_path)
    (tmp_path / "train_toy.py").write_text(COPY_ALONE, encoding="utf-8")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "train_toy.py"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    rewards = [float(line.split()[3]) for line in done.stdout.splitlines()]
    assert len(rewards) == 8 and rewards[-1] > rewards[0] + 0.3, done.stdout  # it learns to say TARGET
