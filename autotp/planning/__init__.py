"""Planning: from a captured model and the passes' results to a ``Plan``, a frozen value keyed by names.

``plan`` holds the value (placements, collectives, regions, stages); ``planner`` makes one for
tensor parallelism (``vocab_split`` the vocabulary's part, ``planned_collectives`` the collectives it implies);
``stage_split`` and ``balance`` split the model into balanced pipeline stages;
``pricing`` prices split against whole. A placement itself is ``autotp.passes.placement``'s.
"""

from autotp.passes.placement import REPLICATED, Placement, PlacementKind
from autotp.planning.plan import Collective, FrozenMap, Plan, Region, Stage, check_plan_fits
from autotp.planning.planner import make_plan

__all__ = ["REPLICATED", "Collective", "FrozenMap", "Placement", "PlacementKind", "Plan", "Region", "Stage",
           "check_plan_fits", "make_plan"]
