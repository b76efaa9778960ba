"""Pretrained decoder-only LLMs in flax nnx: the Llama 3 / Mistral / Qwen 2.5 / Qwen 3 layout,
Hugging Face checkpoints (``load_pretrained``, ``save_pretrained``), LoRA / QLoRA adapters with
qwix (``LoraConfig``, ``apply_lora``, ``split_lora``) and the memory planner (``plan_memory``).
Needs the ``llm`` extra (``safetensors``, ``tokenizers``, ``qwix``)."""

from ._config import ARCHITECTURES as ARCHITECTURES
from ._config import TransformerConfig as TransformerConfig
from ._hf import adapter_sharding as adapter_sharding
from ._hf import base_sharding as base_sharding
from ._hf import hf_config as hf_config
from ._hf import load_pretrained as load_pretrained
from ._hf import save_pretrained as save_pretrained
from ._lora import PROJECTIONS as PROJECTIONS
from ._lora import QUANTIZE as QUANTIZE
from ._lora import LoraConfig as LoraConfig
from ._lora import LoraModel as LoraModel
from ._lora import apply_lora as apply_lora
from ._lora import merge_adapters as merge_adapters
from ._lora import split_lora as split_lora
from ._scan import stack_layers as stack_layers
from ._scan import unstack_layers as unstack_layers
from ._transformer import REMAT as REMAT
from ._transformer import Transformer as Transformer

__all__ = [
    "ARCHITECTURES",
    "PROJECTIONS",
    "QUANTIZE",
    "REMAT",
    "LoraConfig",
    "LoraModel",
    "Transformer",
    "TransformerConfig",
    "adapter_sharding",
    "apply_lora",
    "base_sharding",
    "hf_config",
    "load_pretrained",
    "merge_adapters",
    "save_pretrained",
    "split_lora",
    "stack_layers",
    "unstack_layers",
]
