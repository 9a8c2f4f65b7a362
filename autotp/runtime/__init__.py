"""The runtime: process groups and meshes, the modules a user trains, pipeline schedules, state dicts."""

from autotp.runtime.data_parallel import DataParallel
from autotp.runtime.mesh import Mesh
from autotp.runtime.loss import default_loss
from autotp.runtime.parallel_base import ParallelBase, RankParts
from autotp.runtime.pipeline import PipelineModule, tied_groups
from autotp.runtime.process import (
           check_same_plan,
           check_world,
           device_for,
           ensure_process_group,
)
from autotp.runtime.state import StateNames, gather_tp, state_names
from autotp.runtime.tensor_module import ParallelModule

__all__ = ["DataParallel", "Mesh", "ParallelBase", "ParallelModule", "PipelineModule", "RankParts", "StateNames",
           "check_same_plan", "check_world", "default_loss", "device_for", "ensure_process_group", "gather_tp",
           "state_names", "tied_groups"]
