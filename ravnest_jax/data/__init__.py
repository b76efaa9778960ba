"""Data for fine-tuning: plain text tokenised and packed into windows (``PackedTokens``), and
instruction / chat datasets (jsonl or parquet in TRL's formats and alpaca's) rendered with the
checkpoint's chat template, loss-masked to the completion / assistant tokens and packed without
crossing documents (``PackedExamples``); one shard per peer, with a checkpointable position.
Needs the ``llm`` extra (``tokenizers``, and ``jinja2`` for chat templates). See docs/data.md.
"""

from ._chat import ChatTemplate as ChatTemplate
from ._chat import TokenizerConfig as TokenizerConfig
from ._chat import load_tokenizer_config as load_tokenizer_config
from ._pack import Example as Example
from ._pack import PackedExamples as PackedExamples
from ._pack import encode_chat as encode_chat
from ._pack import encode_record as encode_record
from ._pack import encode_records as encode_records
from ._pack import load_examples as load_examples
from ._pack import packed_dataset as packed_dataset
from ._pack import split_examples as split_examples
from ._records import FORMATS as FORMATS
from ._records import Record as Record
from ._records import as_records as as_records
from ._records import detect_format as detect_format
from ._records import iter_records as iter_records
from ._records import read_records as read_records
from ._records import resolve_files as resolve_files
from ._records import scan as scan
from ._tokens import PackedTokens as PackedTokens
from ._tokens import eos_token_id as eos_token_id
from ._tokens import load_tokenizer as load_tokenizer
from ._tokens import split_held_out as split_held_out
from ._tokens import tokenize as tokenize

__all__ = [
    "FORMATS",
    "ChatTemplate",
    "Example",
    "PackedExamples",
    "PackedTokens",
    "Record",
    "TokenizerConfig",
    "as_records",
    "detect_format",
    "encode_chat",
    "encode_record",
    "encode_records",
    "eos_token_id",
    "iter_records",
    "load_examples",
    "load_tokenizer",
    "load_tokenizer_config",
    "packed_dataset",
    "read_records",
    "resolve_files",
    "scan",
    "split_examples",
    "split_held_out",
    "tokenize",
]
