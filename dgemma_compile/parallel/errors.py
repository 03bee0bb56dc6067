"""The error type of tensor and expert parallel runs: callers (the CLI's rank runner) tell a parallel failure from
any other error by its class, never by its message."""


class ParallelError(RuntimeError):
    """A tensor-parallel run cannot start, lost a rank, or was asked for something its group cannot do (the message
    says which and why). A RuntimeError, as torch.distributed's own failures are."""
