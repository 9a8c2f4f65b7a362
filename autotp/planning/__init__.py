"""Planning: from a captured model and the passes' results to a ``Plan``, a frozen value keyed by names.

``plan`` holds the value (placements, collectives, regions, stages); ``planner`` makes one for
tensor parallelism; ``stages`` and ``balance`` split the model into balanced pipeline stages.
"""

from autotp.planning.plan import (
    REPLICATED,
    Collective,
    FrozenMap,
    Placement,
    PlacementKind,
    Plan,
    Region,
    Stage,
    check_plan_fits,
)
from autotp.planning.planner import make_plan

__all__ = ["REPLICATED", "Collective", "FrozenMap", "Placement", "PlacementKind", "Plan", "Region", "Stage",
           "check_plan_fits", "make_plan"]
