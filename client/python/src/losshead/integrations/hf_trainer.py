"""The Hugging Face Trainer's own loop driving an offloaded head: one line after building it.

    offloaded = offload_lm_head(model, client, "llama-head")
    trainer = offloaded.attach(Trainer(model=model, args=args, train_dataset=...))
    trainer.train()                                 # or train(resume_from_checkpoint=True)

`attach` hooks the Trainer (transformers 4.4x .. 5.x, accelerate 1.x) at its public seams:

- Optimizer: the optimizer the Trainer builds (`create_optimizer`, or one passed in
  `optimizers` without a scheduler) becomes a `JointOptimizer`: its param groups plus a head
  group with the Trainer's learning rate, weight decay (`args.weight_decay`), betas and eps, so
  the Trainer's scheduler, warm-up included, sets the head's lr too, and its `optimizer.step()`
  applies the head exactly once per global step, on every rank (`losshead._head_stepper`). A
  head with an output bias (Phi) steps b without weight decay, as the Trainer puts every bias
  in its no-decay group (`bias_weight_decay` among the options sets another).
- Clipping: `accelerator.clip_grad_norm_`, which the Trainer calls with `max_grad_norm` (or
  with inf, only to log the norm), clips trunk and head by one global norm through the head's
  apply: the trunk's squared norm (summed over the shards under FSDP) goes to the server, the
  trunk's gradients are scaled by the coefficient it returns, and the logged `grad_norm` is the
  total norm, as for a local head. Under fp16 the gradients are unscaled first; an overflow
  (non-finite trunk norm) applies nothing and discards the head's window, and the GradScaler
  skips the step and lowers its scale as it would for a local model.
- Gradient accumulation: the Trainer's `num_items_in_batch` reaches the offloaded forward; the
  server divides the window (every micro-batch of every rank in the step) by its token count,
  which is the same number: the head's gradient is the token mean of the global batch.
- Steps: after every global step (`on_step_end`) whatever is still in the head's window (a step
  skipped on overflow) is discarded.
- Checkpoints: `save_model` (every checkpoint, and your own calls) adds `lm_head.weight` (W as
  trained, in the model's dtype; a tied model's under its embedding's key instead, as its own
  save_pretrained keeps it: `OffloadedHead.weight_keys()`) to the saved weights, and
  `lm_head.bias` for a head with an output bias (both in one file of a sharded checkpoint), so
  the directory loads with
  `from_pretrained` anywhere (under FSDP the Trainer resumes from its own model state, which
  lacks it: `lm_head.safetensors` beside it carries W and b, and a resume uploads them); the
  optimizer's state (`optimizer.pt`) names a server snapshot of the head's whole state (W,
  fp32 master, moments, step); `losshead.json` beside it says which (head, server, snapshot,
  weights version, optimizer step, global step). Snapshots of checkpoints the Trainer deleted
  (`save_total_limit`) are deleted on the server too. Saving the optimizer's state needs a
  server started with --checkpoint_dir: attach refuses a Trainer that will save it otherwise
  (or use `save_only_model=True`).
- Resume: `train(resume_from_checkpoint=...)` loads the model's weights (lm_head.weight, with
  lm_head.bias, is uploaded to the server's head) and the optimizer's state (the snapshot is restored: W, moments
  and step as they were at that checkpoint, however far the server went since and whether or not
  it restarted). A checkpoint saved without the optimizer's state resumes with W and a fresh
  optimizer state, as the trunk does. The process that resumes attaches to the existing head:
  `offload_lm_head(model, client, head, create=False)`.
- Evaluation: `evaluate()` / `predict()` run the model in eval() mode under no_grad: forward-only
  steps, nothing added to the head's gradient.

Not supported (refused with the reason): DeepSpeed (it owns the optimizer step),
`label_smoothing_factor` (the Trainer would take the labels away from the model; give
`label_smoothing` to offload_lm_head instead), `compute_loss_func` and `model_init`.
"""

from __future__ import annotations

import glob
import inspect
import json
import os
import warnings
from typing import TYPE_CHECKING, Any, Dict, Optional, Set

import grpc

from losshead.errors import LossheadError
from losshead.integrations._checkpoint_files import add_tensors, weights_format
from losshead.integrations._offloaded_head import BIAS_KEY
from losshead.integrations.accelerate import (attach_accelerator, joint_optimizer_of,
                                              trunk_is_fsdp1)
from losshead.joint import JointOptimizer

if TYPE_CHECKING:
    from losshead.integrations.causal_lm import OffloadedHead

__all__ = ["LOSSHEAD_JSON", "attach", "joint_optimizer_of"]

LOSSHEAD_JSON = "losshead.json"
# W of a checkpoint whose model weights are FSDP's sharded state (pytorch_model_fsdp_*), which
# neither from_pretrained nor add_tensor can read or extend.
LM_HEAD_FILE = "lm_head.safetensors"
_CHECKPOINT_PREFIX = "checkpoint-"


def _unwrapped(model: Any) -> Any:
    while hasattr(model, "module") and not hasattr(model, "_losshead_offloaded_head"):
        model = model.module
    return model


def _check(offloaded: "OffloadedHead", trainer: Any) -> None:
    model = _unwrapped(trainer.model)
    if getattr(model, "_losshead_offloaded_head", None) is not offloaded:
        raise ValueError(f"losshead: the Trainer's model is not the one whose head "
                         f"{offloaded.head!r} is offloaded (attach the Trainer of that model)")
    args = trainer.args
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(args, "deepspeed", None):
        raise ValueError("losshead: DeepSpeed owns the optimizer step and clipping; an offloaded "
                         "head is driven through the Trainer's torch optimizer (DDP, FSDP)")
    if getattr(args, "n_gpu", 1) > 1:
        raise ValueError(f"losshead: the Trainer would run torch.nn.DataParallel over "
                         f"{args.n_gpu} GPUs in this one process, and its replicas cannot share "
                         "the offloaded head; run one process per GPU (torchrun or accelerate "
                         "launch: DDP or FSDP), or make one GPU visible (CUDA_VISIBLE_DEVICES)")
    if getattr(args, "label_smoothing_factor", 0):
        raise ValueError("losshead: label_smoothing_factor makes the Trainer take the labels away "
                         "from the model, whose offloaded forward needs them; pass "
                         "label_smoothing to offload_lm_head instead (the server smooths)")
    if getattr(trainer, "compute_loss_func", None) is not None:
        raise ValueError("losshead: compute_loss_func needs logits, which an offloaded head does "
                         "not produce; the model's forward computes the loss on the server")
    if getattr(trainer, "model_init", None) is not None:
        raise ValueError("losshead: model_init builds a new model for every train(); offload the "
                         "head of the model you pass as `model` instead")
    if getattr(trainer, "lr_scheduler", None) is not None:
        raise ValueError("losshead: a scheduler passed to the Trainer was built on an optimizer "
                         "without the head; pass the optimizer alone (the Trainer builds the "
                         "schedule on it after attach), or build both on "
                         "`offloaded.optimizer(trunk_optimizer)`")


def _saves_optimizer(args: Any) -> bool:
    strategy = str(getattr(args, "save_strategy", "no"))
    return not strategy.lower().endswith("no") and not getattr(args, "save_only_model", False)


def _check_snapshots(offloaded: "OffloadedHead") -> None:
    try:
        offloaded.client.list_snapshots(offloaded.head)
    except LossheadError as e:
        if e.code == grpc.StatusCode.FAILED_PRECONDITION:
            raise ValueError(
                f"losshead: the Trainer saves its optimizer's state, which for head "
                f"{offloaded.head!r} is a snapshot on the server, and {offloaded.client.target} "
                f"keeps none ({e.message}): start it with --checkpoint_dir on persistent "
                "storage, or save the model only (TrainingArguments(save_only_model=True))"
            ) from None
        raise


class _Attachment:
    """What attach installed on one Trainer."""

    def __init__(self, offloaded: "OffloadedHead", trainer: Any, options: Dict[str, Any]) -> None:
        self.offloaded = offloaded
        self.trainer = trainer
        self.options = options
        self.known_tags: Set[str] = set()

    @property
    def joint(self) -> Optional[JointOptimizer]:
        return joint_optimizer_of(self.trainer.optimizer)

    def wrap(self, optimizer: Any) -> Any:
        if optimizer is None or joint_optimizer_of(optimizer) is not None:
            return optimizer
        return JointOptimizer(optimizer, self.offloaded.client, self.offloaded.head,
                              sharded=trunk_is_fsdp1(self.trainer.accelerator),
                              **self.options)

    # -- files ------------------------------------------------------------------------------
    def add_weight(self, directory: str) -> None:
        # Under FSDP the Trainer resumes from its own model state (pytorch_model_fsdp_*), which
        # lacks lm_head.weight and cannot be extended: W goes beside it (LM_HEAD_FILE) as well.
        fsdp = bool(getattr(self.trainer, "is_fsdp_enabled", False))
        layout = weights_format(directory)
        if layout is None and not fsdp:
            warnings.warn(f"losshead: {directory} holds no model weights (an adapter-only "
                          "save?): lm_head.weight not added")
            return
        weight, bias = self.offloaded.download_head()
        if layout is not None:
            # A tied model's checkpoint keeps W under the embedding's key only, as its own
            # save_pretrained would (from_pretrained ties lm_head to it). W and b in one file, so
            # that a sharded load hands both to one push.
            tensors = {key: weight for key in self.offloaded.weight_keys()}
            if bias is not None:
                tensors[BIAS_KEY] = bias
            add_tensors(directory, tensors)
        if fsdp:
            from safetensors.torch import save_file
            path = os.path.join(directory, LM_HEAD_FILE)
            beside = {"lm_head.weight": weight.contiguous()}
            if bias is not None:
                beside[BIAS_KEY] = bias.contiguous()
            save_file(beside, path + ".tmp", metadata={"format": "pt"})
            os.replace(path + ".tmp", path)

    def write_json(self, directory: str, reference: Optional[Dict[str, Any]],
                   global_step: int) -> None:
        record = {"head": self.offloaded.head, "target": self.offloaded.client.target,
                  "global_step": int(global_step), "optimizer_saved": reference is not None,
                  "lm_head_dtype": str(self.offloaded._dtype).replace("torch.", ""),
                  "head_dtype": str(self.offloaded.head_dtype).replace("torch.", "")}
        if reference is not None:
            record.update({k: reference.get(k) for k in (
                "snapshot", "weights_version", "optimizer_step", "run", "kind")})
        else:
            record["weights_version"] = self.offloaded.weights_version
        tmp = os.path.join(directory, LOSSHEAD_JSON + ".tmp")
        with open(tmp, "w") as f:
            json.dump(record, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, os.path.join(directory, LOSSHEAD_JSON))

    def referenced_tags(self, output_dir: str) -> Set[str]:
        tags = set()
        for path in glob.glob(os.path.join(output_dir, _CHECKPOINT_PREFIX + "*", LOSSHEAD_JSON)):
            try:
                with open(path) as f:
                    record = json.load(f)
            except (OSError, ValueError):
                continue
            if record.get("head") == self.offloaded.head and record.get("snapshot"):
                tags.add(record["snapshot"])
        return tags

    def prune(self, output_dir: str) -> None:
        """Deletes the snapshots of this run that no checkpoint in output_dir refers to."""
        joint = self.joint
        if joint is None:
            return
        referenced = self.referenced_tags(output_dir)
        candidates = (self.known_tags | set(joint.stepper.created_snapshots)) - referenced
        for tag in sorted(candidates):
            joint.stepper.delete_snapshot(tag)
        self.known_tags = referenced

    def resume_from_json(self, checkpoint: str) -> None:
        joint = self.joint
        path = os.path.join(checkpoint, LOSSHEAD_JSON)
        if joint is None or not os.path.isfile(path):
            return
        with open(path) as f:
            record = json.load(f)
        if record.get("head") != self.offloaded.head:
            raise ValueError(f"losshead: {path} is of head {record.get('head')!r}, not "
                             f"{self.offloaded.head!r}")
        if not record.get("optimizer_saved"):
            joint.stepper.reset_state()
            return
        joint.stepper.load_reference({
            "head": record["head"], "target": record.get("target"),
            "snapshot": record.get("snapshot"), "weights_version": record.get("weights_version"),
            "optimizer_step": record.get("optimizer_step"), "run": None, "generation": None,
            "changes": None, "kind": record.get("kind")})


def _callback(attachment: _Attachment) -> Any:
    from transformers import TrainerCallback

    class LossheadCallback(TrainerCallback):  # type: ignore[misc, valid-type]
        """Discards a skipped step's window; records and prunes snapshots on save."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            attachment.known_tags |= attachment.referenced_tags(args.output_dir)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            joint = attachment.joint
            if joint is not None:
                joint.end_step()

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            joint = attachment.joint
            directory = os.path.join(args.output_dir, f"{_CHECKPOINT_PREFIX}{state.global_step}")
            reference = None
            if joint is not None and not getattr(args, "save_only_model", False):
                # Written already when the Trainer saved the optimizer's state (rank 0); the
                # same reference on every rank.
                reference = joint.stepper.state_reference()
            if args.should_save and os.path.isdir(directory):
                attachment.write_json(directory, reference, state.global_step)
                attachment.prune(args.output_dir)

    return LossheadCallback()


def attach(offloaded: "OffloadedHead", trainer: Any, **options: Any) -> Any:
    """See the module docstring; returns `trainer`. `options` set the head's optimizer
    (JointOptimizer's: kind, lr, weight_decay, betas, eps, momentum, grad_divisor, ...); by
    default it follows the Trainer's (AdamW with its betas and eps, args.weight_decay)."""
    _check(offloaded, trainer)
    args = trainer.args
    head_options = {"weight_decay": args.weight_decay}
    if offloaded.has_bias:
        # The Trainer's param groups leave every bias out of weight decay (its
        # get_decay_parameter_names): lm_head.bias too, were it local.
        head_options["bias_weight_decay"] = 0.0
    head_options.update(options)
    attachment = _Attachment(offloaded, trainer, head_options)
    if _saves_optimizer(args):
        _check_snapshots(offloaded)
    trainer._losshead_attachment = attachment

    # The optimizer: one passed in is wrapped now, one the Trainer builds when it does.
    trainer.optimizer = attachment.wrap(trainer.optimizer)
    create_optimizer = trainer.create_optimizer
    takes_model = "model" in inspect.signature(create_optimizer).parameters

    def create_optimizer_with_head(model: Any = None) -> Any:
        made = create_optimizer(model) if takes_model else create_optimizer()
        trainer.optimizer = attachment.wrap(made if made is not None else trainer.optimizer)
        return trainer.optimizer

    trainer.create_optimizer = create_optimizer_with_head

    # Clipping: one global norm over trunk and head, through the head's apply.
    attach_accelerator(trainer.accelerator, lambda: attachment.joint)

    # Saving: lm_head.weight in the saved weights (rank 0, which writes them).
    save_model = trainer.save_model

    def save_model_with_head(output_dir: Optional[str] = None,
                             _internal_call: bool = False) -> None:
        save_model(output_dir, _internal_call=_internal_call)
        if trainer.args.should_save:
            attachment.add_weight(output_dir if output_dir is not None else trainer.args.output_dir)

    trainer.save_model = save_model_with_head

    # Resuming, the model's weights: W from lm_head.weight among them (the placeholder's load
    # uploads it), or from LM_HEAD_FILE beside FSDP's sharded state, which lacks it.
    load_model = getattr(trainer, "_load_from_checkpoint", None)
    if load_model is not None:
        def load_model_with_head(checkpoint: Optional[str], *args: Any, **kwargs: Any) -> Any:
            path = os.path.join(checkpoint, LM_HEAD_FILE) if checkpoint else ""
            if not os.path.isfile(path):
                return load_model(checkpoint, *args, **kwargs)
            placeholder = offloaded._placeholder
            placeholder.weight_elsewhere = True
            try:
                out = load_model(checkpoint, *args, **kwargs)
            finally:
                placeholder.weight_elsewhere = False
            from safetensors.torch import load_file
            beside = load_file(path)
            offloaded.upload_weight(beside["lm_head.weight"], beside.get(BIAS_KEY))
            return out

        trainer._load_from_checkpoint = load_model_with_head

    # Resuming: the optimizer's state restores the snapshot; where it could not carry the
    # reference (FSDP's sharded optimizer state), losshead.json does.
    load = getattr(trainer, "_load_optimizer_and_scheduler", None)
    if load is not None:
        def load_with_head(checkpoint: Optional[str]) -> None:
            joint = attachment.joint
            before = joint.stepper.loads if joint is not None else 0
            load(checkpoint)
            joint = attachment.joint
            if checkpoint is not None and joint is not None and joint.stepper.loads == before:
                attachment.resume_from_json(checkpoint)

        trainer._load_optimizer_and_scheduler = load_with_head

    trainer.add_callback(_callback(attachment))
    return trainer
