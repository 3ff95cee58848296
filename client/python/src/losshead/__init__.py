"""Python client and PyTorch bridge for losshead, a service that owns a model's LM head.

    from losshead import Client, RemoteLMHead, RemoteHeadOptimizer

`Client` speaks the v1 gRPC contract (heads, steps, gradient pulls, weight pushes, stats,
health, checkpoints), with retries (`RetryPolicy`), bearer tokens and TLS; its tensors travel
through the C++ client (liblosshead_capi.so) when `native_available()`, else through grpcio.
`RemoteLMHead` is an nn.Module whose forward/backward run on the server (how a batch travels:
its `StepPlan`), `losshead.functional.linear_cross_entropy` the same as a function;
`RemoteAdamW` / `RemoteSGD` step the head on the server (exactly once per step for every rank
of a data-parallel job), `JointOptimizer` holds a trunk's optimizer and the head as one
(schedules, global-norm clipping, GradScaler, state dicts), and `RemoteHeadOptimizer` mirrors
the remote W locally so any torch.optim optimizer can step it. `OffloadedEmbedding` is an input
embedding whose table is a head's W (a model's tied embedding, served by its offloaded head).
`export_checkpoint` turns a server checkpoint file into safetensors (offline, through the
`losshead` tool); `import_safetensors` seeds a head from one.
"""

from losshead.client import (Client, ClientProgress, Gradient, GradientSummary, HeadCheckpoint,
                             LossOptions, StepResult, StepStream, TokenOutputs, Weights,
                             combine_results)
from losshead import functional
from losshead._native import NativeLibraryWarning, native_available, native_library
from losshead._plan import StepPlan
from losshead._window import UnsteppedHeadWarning
from losshead.errors import LossheadError
from losshead.joint import JointOptimizer
from losshead.embedding import OffloadedEmbedding
from losshead.export import export_checkpoint, import_safetensors, load_safetensors
from losshead.optim import ApplyResult, RemoteAdamW, RemoteSGD, step_with_clipping
from losshead.retry import RetryPolicy
from losshead.torch_bridge import (RemoteHeadOptimizer, RemoteLMHead, scale_gradients_,
                                   token_losses)

__all__ = [
    "ApplyResult", "Client", "ClientProgress", "Gradient", "GradientSummary", "HeadCheckpoint",
    "JointOptimizer", "LossOptions", "LossheadError", "NativeLibraryWarning",
    "OffloadedEmbedding", "RemoteAdamW",
    "RemoteHeadOptimizer",
    "RemoteLMHead", "RemoteSGD", "RetryPolicy", "StepPlan", "StepResult", "StepStream",
    "TokenOutputs", "UnsteppedHeadWarning", "Weights", "combine_results", "native_available",
    "native_library",
    "scale_gradients_", "step_with_clipping", "token_losses",
    "export_checkpoint", "functional", "import_safetensors", "load_safetensors",
]
__version__ = "0.1.0"
