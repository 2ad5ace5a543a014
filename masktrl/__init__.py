"""masktrl: trust-region masking experiments for LLM RL."""

__version__ = "0.1.0"
