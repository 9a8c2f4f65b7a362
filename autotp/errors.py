"""The exceptions autotp raises. Every user-facing failure is one of these, never a bare assert."""


class AutotpError(Exception):
    """Base class of every error autotp raises on purpose."""


class InputError(AutotpError, TypeError):
    """An argument has the wrong type or value (a model that is not an nn.Module, bad tp, ...)."""


class CaptureError(AutotpError):
    """The model could not be captured into a torch.fx graph."""


class TrainingSettingError(CaptureError):
    """The capture failed in a branch the model takes only in training, switched on by config settings (SpecAugment's
    ``mask_time_prob``, LayerDrop's ``layerdrop``); ``settings`` maps each to the value that switches it off."""

    def __init__(self, message: str, settings: dict[str, object]):
        super().__init__(message)
        self.settings = dict(settings)


class UnseenExpertError(AutotpError, RuntimeError):
    """A batch routes tokens to an expert that a loop over the experts hit was not captured for (the capture runs
    the loop over the experts the example inputs route tokens to)."""


class PlanError(AutotpError):
    """No exact plan exists for the requested setting (say, tp does not divide the heads)."""


class CheckpointError(InputError):
    """A checkpoint or another file cannot be used as it is: it would run code, names paths outside its folder, is
    incomplete or damaged, or does not match the model (shapes, dtypes, missing tensors)."""


class RuntimeSetupError(AutotpError):
    """The distributed environment does not fit the plan (world size, mismatched plans, ...)."""


class UnsupportedTorchError(AutotpError, ImportError):
    """The installed torch is older than autotp needs (its capture reads operator tags and export internals that
    earlier releases lack)."""


class UntestedTorchWarning(UserWarning):
    """The installed torch is newer than the releases autotp is tested with (warned once per process): it may
    work, but a release can change the torch internals autotp's capture reads."""


class RankFailure(AutotpError, RuntimeError):
    """A collective could not complete because another rank failed, stopped or did not answer in time."""


class DriftError(AutotpError, RuntimeError):
    """Parameters every tensor-parallel rank holds whole have drifted apart: the ranks no longer hold one model."""


class ModelPartError(AutotpError, AttributeError):
    """Code asked the parallel module for one of the original model's parts (``pm.model``, ``pm.lm_head``,
    ``pm.base_model``): the parallel module runs the captured model as a whole and has no such submodules. It is an
    ``AttributeError``, so ``hasattr`` and ``getattr(pm, name, default)`` still answer False and the default."""


class InternalError(AutotpError, RuntimeError):
    """An invariant of autotp itself failed: a bug in autotp, not a mistake in what it was given."""

    def __init__(self, message: str):
        super().__init__(f"internal error in autotp (a bug in autotp, not in your model or settings; "
                         f"please report it with the model and command): {message}")
