"""Which expert-parallel layouts the runtime runs, in one place: the layout search prices every ep dividing
dp x tp (``expert_cost``), ahead of the runtime, so ``parallelize`` refuses a searched layout it cannot run
rather than run it otherwise than it was priced. Delete a case here when the runtime learns it."""

from __future__ import annotations

from autotp.errors import PlanError
from autotp.options import DataParallelMode, Options


def ep_unrunnable(options: Options) -> str | None:
    """Why the runtime cannot run ``options``' expert parallelism (None: it can): the all-to-all dispatch takes ep
    groups of whole tp groups (ep a multiple of tp), over data-parallel replicas only when they replicate, and
    across pipeline stages only at ep = tp (``runtime.expert_groups``)."""
    if options.ep == 1 or options.ep == options.tp:
        return None
    if options.ep % options.tp:
        return f"ep={options.ep} is not a multiple of tp={options.tp} (an ep group is made of whole tp groups)"
    if options.dp_mode is DataParallelMode.FSDP and options.mixed_precision is not None:
        return f"ep={options.ep} above tp={options.tp} under dp_mode='fsdp' with mixed_precision"
    return None


def refuse_unrunnable_ep(options: Options, world: int) -> None:
    """Refuse, naming what to fix, a searched layout of ``world`` devices whose ep the runtime cannot run yet."""
    why = ep_unrunnable(options)
    if why is not None:
        raise PlanError(f"the layout search chose tp={options.tp} pp={options.pp} dp={options.dp} ep={options.ep} "
                        f"for {world} devices, which the runtime cannot run yet: {why}. Fix ep (ep=1, or ep=tp) "
                        "with world_size, or give the layout yourself (tp=, pp=, dp=, ep=)")
