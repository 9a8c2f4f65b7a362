"""The exceptions autotp raises. Every user-facing failure is one of these, never a bare assert."""


class AutotpError(Exception):
    """Base class of every error autotp raises on purpose."""


class InputError(AutotpError, TypeError):
    """An argument has the wrong type or value (a model that is not an nn.Module, bad tp, ...)."""


class CaptureError(AutotpError):
    """The model could not be captured into a torch.fx graph."""


class PlanError(AutotpError):
    """No exact plan exists for the requested setting (say, tp does not divide the heads)."""


class PassError(AutotpError):
    """A graph pass failed; the message names the pass and the passes that ran before it."""


class RuntimeSetupError(AutotpError):
    """The distributed environment does not fit the plan (world size, mismatched plans, ...)."""
