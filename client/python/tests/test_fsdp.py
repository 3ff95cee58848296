"""FSDP with an offloaded head: the trunk sharded over two ranks, the head on the server.

The trunk's gradient norm must be summed over the shards (DTensor gradients under FSDP2; each
rank's plain flat shard under FSDP1, `sharded=True`), the head needs no gather, and every rank
stepping the JointOptimizer with clip_grad_norm_ must equal one process training the same model
on the concatenated batch with clip_grad_norm_ over all parameters.

FSDP2 (`fully_shard`) needs torch >= 2.6; the ranks talk over gloo on the CPU, or NCCL when two
GPUs are there. The sharded-norm sum itself is checked on any torch.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, List

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from losshead import Client
from losshead._dist import Ranks
from losshead._grad_norm import trunk_squared_norm
from losshead.integrations.causal_lm import offload_causal_lm
from test_integrations import TinyCausalLM, TinyTrunk, _batch

try:
    from torch.distributed.fsdp import fully_shard  # torch >= 2.6
except Exception:  # older torch: absent, or (1.13 on Python 3.11) failing to import at all
    fully_shard = None

WORLD = 2
STEPS = 3
MAX_NORM = 0.3
ADAMW = dict(lr=0.02, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
REL = 5e-5


def _micro_batches(step: int) -> List[Any]:
    """Two micro-batches per rank and step."""
    return [[_batch(100 * step + 10 * rank + i) for i in range(2)] for rank in range(WORLD)]


def _tokens(step: int) -> int:
    return sum(int((labels[..., 1:] != -100).sum())
               for rank in _micro_batches(step) for _, _, labels in rank)


class TupleTrunk(TinyTrunk):
    """TinyTrunk returning a tuple: FSDP2 finds a forward's output tensors (to hook their
    backward) by pytree, which knows tuples and Hugging Face's ModelOutput, not a plain
    dataclass; without them its post-backward cleanup never runs and gradients pile up."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return (super().forward(*args, **kwargs).last_hidden_state,)


def _cuda_pair() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= WORLD


def _sharded_norm_main(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    try:
        full = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
        shard = torch.nn.Parameter(torch.zeros(6))
        shard.grad = full.reshape(-1)[rank * 6:(rank + 1) * 6].clone()
        total, _ = trunk_squared_norm([shard], sharded=True, ranks=Ranks())
        torch.save(total, Path(out_dir) / f"norm{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_the_sharded_norm_is_summed_over_the_ranks(tmp_path: Path) -> None:
    mp.spawn(_sharded_norm_main, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD,
             join=True)
    want = float((torch.arange(12, dtype=torch.float64) / 7).pow(2).sum())
    for rank in range(WORLD):
        # fp32 norms of each tensor, summed in float64
        assert torch.load(tmp_path / f"norm{rank}.pt") == pytest.approx(want, rel=1e-6)


def _fsdp_main(rank: int, address: str, head: str, init_file: str, out_dir: str) -> None:
    cuda = _cuda_pair()
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        client = Client(address, client_id=f"fsdp-rank{rank}")
        model = TinyCausalLM(seed=21).to(device)
        model.model.__class__ = TupleTrunk
        if rank != 0:
            dist.barrier()  # rank 0 creates the head, the others attach to it
        offloaded = offload_causal_lm(model, client, head, create=rank == 0,
                                      head_dtype=torch.float32, wire_dtype=torch.float32)
        if rank == 0:
            dist.barrier()
        fully_shard(model.model, mesh=init_device_mesh(device.type, (WORLD,)))
        joint = offloaded.optimizer(torch.optim.AdamW(model.parameters(), foreach=False,
                                                      **ADAMW))
        norms, heads, trunks = [], [], []
        for step in range(STEPS):
            tokens = _tokens(step)
            for input_ids, mask, labels in _micro_batches(step)[rank]:
                # FSDP averages the ranks' gradients: each rank's token sum over the global
                # count, times the ranks.
                loss = model(input_ids.to(device), attention_mask=mask.to(device),
                             labels=labels.to(device), num_items_in_batch=tokens).loss
                (loss * WORLD).backward()
            trunks.append(trunk_squared_norm(model.model.parameters(), ranks=Ranks())[0] ** 0.5)
            norms.append(float(joint.clip_grad_norm_(MAX_NORM)))
            heads.append(joint.last_result.head_grad_norm)
            joint.step()
            joint.zero_grad()
        trunk = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
                 for k, v in model.model.state_dict().items()}
        torch.save({"norms": norms, "heads": heads, "trunks": trunks, "trunk": trunk,
                    "w": offloaded.download_weight()},
                   Path(out_dir) / f"rank{rank}.pt")
        client.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(fully_shard is None, reason="FSDP2 (torch.distributed.fsdp.fully_shard) "
                                                "needs torch >= 2.6")
def test_fsdp_trunk_and_offloaded_head_equal_one_process(client: Client, server_address: str,
                                                         tmp_path: Path) -> None:
    head = "fsdp-head"
    try:
        mp.spawn(_fsdp_main, args=(server_address, head, str(tmp_path / "init"), str(tmp_path)),
                 nprocs=WORLD, join=True)
        assert client.get_head(head).optimizer_step == STEPS
    finally:
        client.delete_head(head)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]

    reference = TinyCausalLM(seed=21)
    opt = torch.optim.AdamW(reference.parameters(), foreach=False, **ADAMW)
    norms, heads, trunks = [], [], []
    for step in range(STEPS):
        tokens = _tokens(step)
        for rank_batches in _micro_batches(step):
            for input_ids, mask, labels in rank_batches:
                reference(input_ids, attention_mask=mask, labels=labels,
                          num_items_in_batch=tokens).loss.backward()
        heads.append(float(reference.lm_head.weight.grad.norm()))
        trunks.append(float(torch.stack([p.grad.norm() for p in reference.model.parameters()]
                                        ).norm()))
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(reference.parameters()),
                                                          MAX_NORM)))
        opt.step()
        opt.zero_grad()
    assert all(n > MAX_NORM for n in norms), "the clip never engaged"
    for rank in ranks:
        # The head's and the trunk's parts apart first: which one is off, if one is.
        assert rank["heads"] == pytest.approx(heads, rel=REL), (rank["heads"], heads)
        assert rank["trunks"] == pytest.approx(trunks, rel=REL), (rank["trunks"], trunks)
        assert rank["norms"] == pytest.approx(norms, rel=REL)
        w = reference.lm_head.weight.detach()
        assert float((rank["w"] - w).abs().max()) <= REL * float(w.abs().max())
        for name, value in copy.deepcopy(reference.model.state_dict()).items():
            err = float((rank["trunk"][name] - value).abs().max())
            assert err <= REL * max(float(value.abs().max()), 1.0), name
