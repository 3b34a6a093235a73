"""The full trainer: the reference's GRPO with every speed-up, torchrun, run folders, tools and tasks.

It imports the six reference modules at the top level (grpo, lora, rewards, data, model_io) for what they
hold and extends them; they never import it. `python -m grpo_vlm --help` lists its flags.
"""
