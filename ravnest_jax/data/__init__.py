"""Token data for fine-tuning: tokenise text with a Hugging Face ``tokenizer.json``, pack it into
fixed-length sequences, one shard per peer, with a checkpointable position. Needs the ``llm``
extra (``tokenizers``)."""

from ._tokens import PackedTokens as PackedTokens
from ._tokens import eos_token_id as eos_token_id
from ._tokens import load_tokenizer as load_tokenizer
from ._tokens import split_held_out as split_held_out
from ._tokens import tokenize as tokenize

__all__ = ["PackedTokens", "eos_token_id", "load_tokenizer", "split_held_out", "tokenize"]
