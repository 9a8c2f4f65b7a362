"""The runtime: process groups and meshes, the modules a user trains, pipeline schedules, state dicts."""

from autotp.runtime.pipeline import Mesh, PipelineModule, tied_groups
from autotp.runtime.process import check_same_plan, check_world, device_for, ensure_process_group
from autotp.runtime.tensor_parallel import ParallelModule, StateNames, default_loss, gather_tp, state_names

__all__ = ["Mesh", "ParallelModule", "PipelineModule", "StateNames", "check_same_plan", "check_world",
           "default_loss", "device_for", "ensure_process_group", "gather_tp", "state_names", "tied_groups"]
