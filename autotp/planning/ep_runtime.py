"""Which expert-parallel layouts the runtime runs today, in one place: the layout search prices every ep dividing
dp x tp (``expert_cost``), ahead of the runtime, so ``parallelize`` refuses a searched layout it cannot run
rather than run it otherwise than it was priced. Delete a case here when the runtime learns it (the all-to-all
dispatch over data-parallel ranks: ep other than tp, ep with pp)."""

from __future__ import annotations

from autotp.errors import PlanError
from autotp.options import Options


def ep_unrunnable(options: Options) -> str | None:
    """Why the runtime cannot run ``options``' expert parallelism yet (None: it can): today the expert-parallel
    ranks must be the tensor-parallel ones (the tokens are whole on each, summed by all-reduce), in one stage."""
    if options.ep == 1:
        return None
    if options.ep != options.tp:
        return (f"ep={options.ep} over data-parallel ranks (ep other than tp={options.tp}) needs the all-to-all "
                "dispatch")
    if options.pp > 1:
        return f"ep={options.ep} with pp={options.pp} needs the all-to-all dispatch across pipeline stages"
    return None


def refuse_unrunnable_ep(options: Options, world: int) -> None:
    """Refuse, naming what to fix, a searched layout of ``world`` devices whose ep the runtime cannot run yet."""
    why = ep_unrunnable(options)
    if why is not None:
        raise PlanError(f"the layout search chose tp={options.tp} pp={options.pp} dp={options.dp} ep={options.ep} "
                        f"for {world} devices, which the runtime cannot run yet: {why}. Fix ep (ep=1, or ep=tp) "
                        "with world_size, or give the layout yourself (tp=, pp=, dp=, ep=)")
