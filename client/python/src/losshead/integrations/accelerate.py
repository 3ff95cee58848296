"""accelerate's `clip_grad_norm_` made to clip trunk and offloaded head by one global norm.

    joint = offloaded.optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4))
    model, joint, loader, schedule = accelerator.prepare(model, joint, loader, schedule)
    offloaded.attach(accelerator)
    ...
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)   # trunk and head, one norm
    joint.step(); schedule.step(); joint.zero_grad()        # every rank, as usual

A training loop written for accelerate clips with `accelerator.clip_grad_norm_` and steps the
prepared optimizer on every process. The JointOptimizer already steps the head once per step for
all of them; `attach_accelerator` routes the clip through it too: gradients are unscaled first
(fp16), the trunk's squared norm (summed over FSDP's shards) goes with the head's apply, the
trunk's gradients are scaled by the coefficient the server returns, and the total norm is
returned, as for a model whose head is local. A loop that clips nothing calls nothing: the
head is applied in `step()`. Other norms than L2 are refused (the server's is L2).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from losshead.joint import JointOptimizer

__all__ = ["attach_accelerator", "joint_optimizer_of", "trunk_is_fsdp1"]


def joint_optimizer_of(optimizer: Any) -> Optional[JointOptimizer]:
    """The JointOptimizer inside `optimizer` (accelerate wraps it), or None."""
    for _ in range(8):
        if optimizer is None or isinstance(optimizer, JointOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


def trunk_is_fsdp1(accelerator: Any) -> bool:
    """Whether the trunk's gradients are FSDP1's per-rank shards (FSDP2's are DTensors)."""
    if "FSDP" not in str(getattr(accelerator, "distributed_type", "")):
        return False
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    return getattr(plugin, "fsdp_version", 1) == 1


def attach_accelerator(accelerator: Any,
                       find: Optional[Callable[[], Optional[JointOptimizer]]] = None) -> Any:
    """Routes `accelerator.clip_grad_norm_` through the JointOptimizer it prepared (or the one
    `find` returns); returns the accelerator. Idempotent."""
    if getattr(accelerator, "_losshead_clip", False):
        return accelerator
    original = accelerator.clip_grad_norm_

    def locate() -> Optional[JointOptimizer]:
        if find is not None:
            return find()
        for optimizer in getattr(accelerator, "_optimizers", []):
            joint = joint_optimizer_of(optimizer)
            if joint is not None:
                return joint
        return None

    def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        joint = locate()
        if joint is None:
            return original(parameters, max_norm, norm_type=norm_type)
        joint.sharded = joint.sharded or trunk_is_fsdp1(accelerator)
        accelerator.unscale_gradients()
        return joint.clip_grad_norm_(max_norm, parameters, norm_type)

    accelerator.clip_grad_norm_ = clip_grad_norm_
    accelerator._losshead_clip = True
    return accelerator
