"""Pure, jittable optimizer math (no I/O, no asyncio)."""

from ._diloco import DiLoCo as DiLoCo
from ._diloco import DiLoCoState as DiLoCoState
from ._diloco import RoundSnapshot as RoundSnapshot
from ._diloco import SimulatedCodec as SimulatedCodec
from ._diloco import default_outer as default_outer
from ._diloco import diloco as diloco
from ._simulation import replicate as replicate
from ._simulation import unreplicate as unreplicate
