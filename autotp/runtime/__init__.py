"""The runtime: process groups and meshes, the modules a user trains, pipeline schedules, state dicts."""

from autotp.runtime.data_parallel import DataParallel
from autotp.runtime.mesh import Mesh
from autotp.runtime.pipeline import PipelineModule, tied_groups
from autotp.runtime.process import check_same_plan, check_world, device_for, ensure_process_group
from autotp.runtime.outputs import default_loss
from autotp.runtime.tensor_parallel import ParallelModule, StateNames, gather_tp, state_names

__all__ = ["DataParallel", "Mesh", "ParallelModule", "PipelineModule", "StateNames", "check_same_plan", "check_world",
           "default_loss", "device_for", "ensure_process_group", "gather_tp", "state_names", "tied_groups"]
