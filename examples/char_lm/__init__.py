"""The char-LM example as a package: a byte-level transformer trained with DiLoCo on real text.

``main.py`` is the main job (a local swarm, one peer, or the replica simulation); ``train.py``
the same peer as plain user code for ``ravnest-jax local``. The benchmarks import the data,
model and simulation functions from here (``sys.path`` holding ``examples/``).
"""

from char_lm.data import VOCAB, eval_batches, load_corpus, sample_batch, stdlib_files
from char_lm.main import main, parse_args
from char_lm.model import ModelConfig, build_model, inner_optimizer, make_evaluator, make_loss
from char_lm.peer import peer_mesh, place_on_mesh
from char_lm.report import json_safe, machine_info
from char_lm.simulate import train_data_parallel, train_diloco_simulation

__all__ = [
    "VOCAB",
    "ModelConfig",
    "build_model",
    "eval_batches",
    "inner_optimizer",
    "json_safe",
    "load_corpus",
    "machine_info",
    "main",
    "make_evaluator",
    "make_loss",
    "parse_args",
    "peer_mesh",
    "place_on_mesh",
    "sample_batch",
    "stdlib_files",
    "train_data_parallel",
    "train_diloco_simulation",
]
