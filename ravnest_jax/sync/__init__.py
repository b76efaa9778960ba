"""Host-side driver: starts rounds, overlaps them with inner steps, applies results."""

from ._contract import SwarmContract as SwarmContract
from ._digest import device_digest as device_digest
from ._digest import digest_hex as digest_hex
from ._join import Joined as Joined
from ._join import checkpoint_extra as checkpoint_extra
from ._join import join_or_resume as join_or_resume
from ._outer_sync import MODES as MODES
from ._outer_sync import OuterSync as OuterSync
from ._outer_sync import RoundMetrics as RoundMetrics
from ._prometheus import PrometheusExporter as PrometheusExporter
from ._restart import common_checkpoint_step as common_checkpoint_step
from ._restart import running_peers as running_peers
from ._restart import wait_for_info as wait_for_info
