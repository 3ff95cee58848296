"""Python client and PyTorch bridge for losshead, a service that owns a model's LM head.

    from losshead import Client, RemoteLMHead, RemoteHeadOptimizer

`Client` speaks the v1 gRPC contract (heads, steps, gradient pulls, weight pushes, stats,
health); `RemoteLMHead` is an nn.Module whose forward/backward run on the server;
`RemoteHeadOptimizer` mirrors the remote W locally so any torch.optim optimizer can step it.
"""

from losshead.client import (Client, Gradient, GradientSummary, LossOptions, StepResult,
                             StepStream, Weights, combine_results)
from losshead.errors import LossheadError
from losshead.torch_bridge import (RemoteHeadOptimizer, RemoteLMHead, scale_gradients_,
                                   token_losses)

__all__ = [
    "Client", "Gradient", "GradientSummary", "LossOptions", "LossheadError",
    "RemoteHeadOptimizer", "RemoteLMHead", "StepResult", "StepStream", "Weights",
    "combine_results", "scale_gradients_", "token_losses",
]
__version__ = "0.1.0"
