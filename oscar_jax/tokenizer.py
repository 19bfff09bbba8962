"""Re-export: the tokenizer is backend-neutral and lives in shared_math.tokenizer."""

from shared_math.tokenizer import Tokenizer, load_tokenizer

__all__ = ["Tokenizer", "load_tokenizer"]
