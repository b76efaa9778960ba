"""Pretrained decoder-only LLMs in flax nnx: the Llama 3 / Mistral / Qwen 2.5 / Qwen 3 layout and
Hugging Face checkpoints (``load_pretrained``, ``save_pretrained``). Needs the ``llm`` extra
(``safetensors``) for checkpoints."""

from ._config import ARCHITECTURES as ARCHITECTURES
from ._config import TransformerConfig as TransformerConfig
from ._hf import hf_config as hf_config
from ._hf import load_pretrained as load_pretrained
from ._hf import save_pretrained as save_pretrained
from ._transformer import Transformer as Transformer

__all__ = ["ARCHITECTURES", "Transformer", "TransformerConfig", "hf_config", "load_pretrained", "save_pretrained"]
