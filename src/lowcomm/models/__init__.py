from .gpt import GPT, lm_loss

__all__ = ["GPT", "lm_loss"]
