"""Pretrained decoder-only LLMs in flax nnx: the Llama 3 / Mistral / Qwen 2.5 / Qwen 3 layout,
Hugging Face checkpoints (``load_pretrained``, ``save_pretrained``), LoRA / QLoRA adapters with
qwix (``LoraConfig``, ``apply_lora``, ``split_lora``; base in int8, int4 or nf4) and their export in
PEFT's format (``save_peft_adapters``; a pipeline's stage by stage, ``save_peft_part`` and
``assemble_peft_parts``), memory-efficient
attention with segment ids (``attention``), text generation with a key/value cache (``generate``; PEFT adapters
folded in with ``merge_peft_adapters``), the training step (``TokenBatch``, ``make_train_step``,
``make_eval_loss``, ``chunked_cross_entropy``), device widths and the allocator's pool
(``device_bits``, ``nbytes``, ``allocator_pool_bytes``) and the memory planner (``plan_memory``).
Needs the ``llm`` extra (``safetensors``, ``tokenizers``, ``qwix``)."""

from ._attention import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from ._attention import attention as attention
from ._config import ARCHITECTURES as ARCHITECTURES
from ._config import TransformerConfig as TransformerConfig
from ._generate import generate as generate
from ._generate import merge_peft_adapters as merge_peft_adapters
from ._generate import read_peft_adapters as read_peft_adapters
from ._hf import INDEX as INDEX
from ._hf import adapter_sharding as adapter_sharding
from ._hf import base_sharding as base_sharding
from ._hf import hf_config as hf_config
from ._hf import load_pretrained as load_pretrained
from ._hf import open_checkpoint as open_checkpoint
from ._hf import save_pretrained as save_pretrained
from ._lora import PROJECTIONS as PROJECTIONS
from ._lora import QUANTIZE as QUANTIZE
from ._lora import LoraConfig as LoraConfig
from ._lora import LoraModel as LoraModel
from ._lora import apply_lora as apply_lora
from ._lora import check_quantize as check_quantize
from ._lora import merge_adapters as merge_adapters
from ._lora import split_lora as split_lora
from ._loss import chunked_cross_entropy as chunked_cross_entropy
from ._memory import allocator_pool_bytes as allocator_pool_bytes
from ._memory import device_bits as device_bits
from ._memory import nbytes as nbytes
from ._merge_files import merge_adapters_into_files as merge_adapters_into_files
from ._peft import save_peft_adapters as save_peft_adapters
from ._peft_parts import assemble_peft_parts as assemble_peft_parts
from ._peft_parts import save_peft_part as save_peft_part
from ._plan import POOL_RESERVE as POOL_RESERVE
from ._plan import PRESETS as PRESETS
from ._plan import load_config as load_config
from ._plan import plan_json as plan_json
from ._plan import plan_memory as plan_memory
from ._remat import REMAT as REMAT
from ._scan import stack_layers as stack_layers
from ._scan import unstack_layers as unstack_layers
from ._step import TokenBatch as TokenBatch
from ._step import init_opt_state as init_opt_state
from ._step import make_eval_loss as make_eval_loss
from ._step import make_train_step as make_train_step
from ._transformer import Transformer as Transformer

__all__ = [
    "ARCHITECTURES",
    "ATTENTION_IMPLEMENTATIONS",
    "INDEX",
    "LoraConfig",
    "LoraModel",
    "POOL_RESERVE",
    "PRESETS",
    "PROJECTIONS",
    "QUANTIZE",
    "REMAT",
    "TokenBatch",
    "Transformer",
    "TransformerConfig",
    "adapter_sharding",
    "allocator_pool_bytes",
    "apply_lora",
    "assemble_peft_parts",
    "attention",
    "base_sharding",
    "check_quantize",
    "chunked_cross_entropy",
    "device_bits",
    "generate",
    "hf_config",
    "init_opt_state",
    "load_config",
    "load_pretrained",
    "make_eval_loss",
    "make_train_step",
    "merge_adapters",
    "merge_adapters_into_files",
    "merge_peft_adapters",
    "nbytes",
    "open_checkpoint",
    "plan_json",
    "plan_memory",
    "read_peft_adapters",
    "save_peft_adapters",
    "save_peft_part",
    "save_pretrained",
    "split_lora",
    "stack_layers",
    "unstack_layers",
]
