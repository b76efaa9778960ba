"""Pipeline parallelism over the swarm: a model cut into stages at layer boundaries, each stage
on its own peer, activations and activation-gradients between neighbouring stages over the
authenticated transport, a 1F1B schedule (synchronous and exact, or asynchronous), and DiLoCo
among the peers that hold the same stage (docs/pipeline.md).

References: Narayanan et al., PipeDream, arXiv 1806.03377; PipeDream-2BW, arXiv 2006.09503;
Ryabinin et al., SWARM parallelism, arXiv 2301.11913; Douillard et al., DiLoCo, arXiv 2311.08105.
"""

from ._balance import StagePlan as StagePlan
from ._balance import balance as balance
from ._balance import plan_stages as plan_stages
from ._balance import unit_seconds as unit_seconds
from ._drive import SimResult as SimResult
from ._drive import simulate as simulate
from ._model import LayerSplit as LayerSplit
from ._model import StageModel as StageModel
from ._model import token_cross_entropy as token_cross_entropy
from ._model import transformer_split as transformer_split
from ._model import whole_params as whole_params
from ._peer import PipelineBroken as PipelineBroken
from ._peer import StageMetrics as StageMetrics
from ._peer import StagePeer as StagePeer
from ._placement import Placement as Placement
from ._placement import place as place
from ._pretrained import pretrained_split as pretrained_split
from ._schedule import stage_ops as stage_ops
from ._stage_memory import plan_stage_memory as plan_stage_memory
from ._stage_memory import pool_message as pool_message
from ._worker import ASYNC_MODE as ASYNC_MODE
from ._worker import MODES as MODES
from ._worker import StageWorker as StageWorker

__all__ = [
    "ASYNC_MODE",
    "LayerSplit",
    "MODES",
    "PipelineBroken",
    "Placement",
    "SimResult",
    "StageMetrics",
    "StageModel",
    "StagePeer",
    "StagePlan",
    "StageWorker",
    "balance",
    "place",
    "plan_stage_memory",
    "plan_stages",
    "pool_message",
    "pretrained_split",
    "simulate",
    "stage_ops",
    "token_cross_entropy",
    "transformer_split",
    "unit_seconds",
    "whole_params",
]
