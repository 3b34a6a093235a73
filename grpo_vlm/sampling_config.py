"""How completions are drawn, on the package's command lines: the settings group (--max-new-tokens,
--temperature, --top-p) and the keyword arguments every sampler takes (grpo.sample_completions and
speedups.sample_shared_prefill): the checkpoint's end-of-turn ids, the tokens never sampled (data.py).
"""

from dataclasses import dataclass

import data


@dataclass
class SamplingConfig:
    """How completions are drawn. Field names are the command line's flags."""

    max_new_tokens: int = 24
    """Longest completion; a completion that reaches it without EOS counts as truncated."""
    temperature: float = 1.0
    """Sampling temperature; the recompute divides logits by the same value."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0: off)."""

    def check(self) -> None:
        """ValueError naming the field ('top_p: must be in (0, 1], got 0.0'), as grpo.py's settings do."""
        greedy = "must be > 0: at 0 every completion of a group is the same"
        for name, ok, message in [
            ("max_new_tokens", self.max_new_tokens >= 1, "must be >= 1"),
            ("temperature", self.temperature > 0, greedy),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
        ]:
            if not ok:
                raise ValueError(f"{name}: {message}, got {getattr(self, name)}")


def sampler_options(
    tokenizer, generation_config=None, *, max_new_tokens: int, temperature: float, top_p: float = 1.0
) -> dict:
    """The samplers' keyword arguments: these settings, every id that ends a turn, the ids never drawn."""
    ends = data.end_of_turn_ids(tokenizer, generation_config)
    suppress = data.suppressed_tokens(tokenizer, ends)
    options = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, eos_token_id=ends)
    return options | dict(pad_token_id=tokenizer.pad_token_id, suppress_token_ids=suppress)
