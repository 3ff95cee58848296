"""export_checkpoint / load_safetensors / import_safetensors against a real server's checkpoints.

A bf16 head trained with RemoteAdamW is checkpointed and exported offline: W equals a download of
W bit for bit, and the optimizer's fp32 master weights and moments equal torch.optim.AdamW fed
the same gradients; the manifest's versions and digests match. The export seeds a new head.
Refusals carry the tool's exact status; malformed safetensors files are refused by the reader.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
from pathlib import Path

import grpc
import pytest
import torch

from _servers import on_cuda, server_binary
from losshead import (Client, LossheadError, RemoteAdamW, export_checkpoint, import_safetensors,
                      load_safetensors)

V, D, TOKENS = 37, 16, 24


@pytest.fixture
def cli() -> Path:
    env = os.environ.get("LOSSHEAD_CLI")
    path = Path(env) if env else server_binary().parent.parent / "client" / "losshead"
    if not path.is_file():
        pytest.skip(f"no losshead tool at {path} (set LOSSHEAD_CLI)")
    return path


def _window(client: Client, head: str, step: int) -> torch.Tensor:
    """Two micro-batches into the head; the raw dW (token sums) the next apply will see."""
    g = torch.Generator().manual_seed(500 + step)
    for _ in range(2):
        hidden = torch.randn(TOKENS, D, generator=g)
        targets = torch.randint(0, V, (TOKENS,), generator=g)
        client.step(head, hidden, targets, hidden_dtype=torch.float32, reduction="sum")
    return client.pull_gradient(head, reset=False).grad


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """A few fp32 roundings apart: a CUDA server's fused AdamW orders its multiply-adds unlike
    torch's and lands up to about 1e-6 away."""
    err = (got.double() - want.double()).abs().max().item()
    rel = 1e-5 if on_cuda() else 1e-6
    assert err <= rel * max(want.abs().max().item(), 1e-30), f"max error {err}"


def test_export_is_the_download_and_torch_adamw_state(servers, tmp_path, cli) -> None:
    ckpt = tmp_path / "ckpt"
    server = servers.start(f"--checkpoint_dir={ckpt}", "--checkpoint_interval=0")
    options = dict(lr=0.02, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    with Client(server.address, client_id="exporter") as client:
        client.create_head("lm", V, D, weight_dtype=torch.bfloat16, init_std=0.3, seed=4)
        w0 = client.download_weights("lm").weights
        master = torch.nn.Parameter(w0.float().clone())
        ref = torch.optim.AdamW([master], foreach=False, **options)
        remote = RemoteAdamW(client, "lm", **options)
        for step in range(1, 4):
            master.grad = _window(client, "lm", step) / (2 * TOKENS)
            ref.step()
            remote.step()
        snapshot_w = client.download_weights("lm").weights
        client.snapshot_head("lm", "after-3")
        _window(client, "lm", 4)  # an open window, not stepped
        downloaded = client.download_weights("lm")
        info = client.get_head("lm")
        client.checkpoint("lm")

    out = tmp_path / "lm_head.safetensors"
    manifest = export_checkpoint(ckpt, out, head="lm", optimizer=True, gradient=True, cli=cli)
    tensors = load_safetensors(out)
    w = tensors["lm_head.weight"]
    assert w.dtype == torch.bfloat16 and list(w.shape) == [V, D]
    assert torch.equal(w, downloaded.weights)
    state = ref.state[master]
    _close(tensors["lm_head.weight.optimizer.master_weights"], master.detach())
    _close(tensors["lm_head.weight.optimizer.exp_avg"], state["exp_avg"])
    _close(tensors["lm_head.weight.optimizer.exp_avg_sq"], state["exp_avg_sq"])
    assert torch.equal(tensors["lm_head.weight.optimizer.master_weights"].bfloat16(), w)
    assert tensors["lm_head.weight.grad"].abs().sum() > 0  # the window of step 4
    meta = tensors["__metadata__"]
    assert meta["format"] == "pt" and meta["losshead.head"] == "lm"
    assert meta["losshead.weights_version"] == str(info.weights_version) == \
        str(downloaded.version)
    assert manifest["weights_version"] == info.weights_version
    assert manifest["optimizer"] == "adamw" and manifest["optimizer_step"] == 3
    assert manifest["dtype"] == "bf16" and (manifest["vocab_size"], manifest["hidden_size"]) == (V, D)
    digests = {t["name"]: t["sha256"] for t in manifest["tensors"]}
    assert digests["lm_head.weight"] == hashlib.sha256(
        w.view(torch.int16).numpy().tobytes()).hexdigest()
    assert json.loads((tmp_path / "lm_head.manifest.json").read_text()) == manifest
    # The named snapshot beside the checkpoint: W as it was then, the same step.
    snap = export_checkpoint(ckpt, tmp_path / "snap.safetensors", head="lm", tag="after-3",
                             cli=cli)
    assert snap["optimizer_step"] == 3 and snap["weights_version"] == info.weights_version
    assert torch.equal(load_safetensors(tmp_path / "snap.safetensors")["lm_head.weight"],
                       snapshot_w)
    try:  # the reference reader, where the package is installed
        from safetensors.torch import load_file
    except ImportError:
        pass
    else:
        loaded = load_file(str(out))
        assert sorted(loaded) == sorted(k for k in tensors if k != "__metadata__")
        assert all(torch.equal(loaded[k], tensors[k]) for k in loaded)


def test_import_seeds_a_head_and_refusals_create_nothing(servers, tmp_path, cli) -> None:
    ckpt = tmp_path / "ckpt"
    server = servers.start(f"--checkpoint_dir={ckpt}", "--checkpoint_interval=0")
    with Client(server.address) as client:
        client.create_head("plain", V, D, weight_dtype=torch.float32, init_std=0.5, seed=9)
        client.checkpoint("plain")
        want = client.download_weights("plain").weights
        out = tmp_path / "plain.safetensors"
        export_checkpoint(ckpt / "plain.lhck", out, cli=cli)

        assert import_safetensors(client, "copy", out) == 2
        assert torch.equal(client.download_weights("copy").weights, want)
        with pytest.raises(LossheadError) as e:
            import_safetensors(client, "copy", out)
        assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
        with pytest.raises(LossheadError) as e:
            import_safetensors(client, "other", out, tensor="nope")
        assert e.value.code == grpc.StatusCode.NOT_FOUND

        nan = tmp_path / "nan.safetensors"
        header = json.dumps({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}})
        nan.write_bytes(struct.pack("<Q", len(header)) + header.encode() +
                        struct.pack("<4f", 1.0, float("nan"), 0.0, 2.0))
        with pytest.raises(LossheadError) as e:
            import_safetensors(client, "other", nan, tensor="w")
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert sorted(h.spec.name for h in client.list_heads()) == ["copy", "plain"]

        # Refusals of the export carry the tool's status.
        with pytest.raises(LossheadError) as e:
            export_checkpoint(ckpt / "missing.lhck", tmp_path / "x.safetensors", cli=cli)
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        with pytest.raises(LossheadError) as e:
            export_checkpoint(ckpt / "plain.lhck", tmp_path / "x.safetensors", optimizer=True,
                              cli=cli)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert not (tmp_path / "x.safetensors").exists()


def test_load_safetensors_refuses_malformed_files(tmp_path) -> None:
    def write(name: str, header: dict, data: bytes) -> Path:
        text = json.dumps(header).encode()
        path = tmp_path / name
        path.write_bytes(struct.pack("<Q", len(text)) + text + data)
        return path

    f32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    good = write("good.safetensors", {"a": f32, "__metadata__": {"k": "v"}},
                 struct.pack("<2f", 1.5, -2.0))
    loaded = load_safetensors(good)
    assert loaded["a"].tolist() == [1.5, -2.0] and loaded["__metadata__"] == {"k": "v"}
    bad = {
        "truncated": ({"a": f32}, b"\0" * 4),
        "trailing": ({"a": f32}, b"\0" * 12),
        "gap": ({"a": {**f32, "data_offsets": [4, 12]}}, b"\0" * 12),
        "shape": ({"a": {**f32, "shape": [3]}}, b"\0" * 8),
        "dtype": ({"a": {**f32, "dtype": "Q7"}}, b"\0" * 8),
    }
    for name, (header, data) in bad.items():
        with pytest.raises(ValueError):
            load_safetensors(write(f"{name}.safetensors", header, data))
    (tmp_path / "short").write_bytes(b"\1\0")
    with pytest.raises(ValueError):
        load_safetensors(tmp_path / "short")


def test_a_head_with_an_output_bias_exports_and_imports_it(servers, tmp_path, cli) -> None:
    """b (fp32 beside a bf16 W), its AdamW moments and db go into the export as lm_head.bias*;
    the import (Python and the tool) creates a head with a bias holding W and b bit for bit."""
    ckpt = tmp_path / "ckpt"
    server = servers.start(f"--checkpoint_dir={ckpt}", "--checkpoint_interval=0")
    g = torch.Generator().manual_seed(41)
    with Client(server.address, client_id="bias-exporter") as client:
        client.create_head("biased", V, D, weight_dtype=torch.bfloat16, bias=True)
        b0 = torch.randn(V, generator=g) * 2  # not bf16-exact: the fp32 b must survive
        client.push_weights("biased", (torch.randn(V, D, generator=g) * 0.3).bfloat16(),
                            bias=b0, dtype=torch.float32)
        remote = RemoteAdamW(client, "biased", lr=0.02, weight_decay=0.05)
        _window(client, "biased", 1)
        remote.step()
        _window(client, "biased", 2)  # an open window: db in the export's gradient
        window = client.pull_gradient("biased")
        downloaded = client.download_weights("biased", dtype=torch.float32)
        client.checkpoint("biased")

        out = tmp_path / "biased.safetensors"
        manifest = export_checkpoint(ckpt / "biased.lhck", out, optimizer=True, gradient=True,
                                     cli=cli)
        tensors = load_safetensors(out)
        b = tensors["lm_head.bias"]
        assert b.dtype == torch.float32 and list(b.shape) == [V]
        assert torch.equal(b, downloaded.bias) and not torch.equal(b, b0)  # stepped once
        assert torch.equal(tensors["lm_head.weight"].float(), downloaded.weights)
        assert list(tensors["lm_head.bias.optimizer.exp_avg"].shape) == [V]
        assert tensors["lm_head.bias.optimizer.exp_avg_sq"].abs().sum() > 0
        assert torch.equal(tensors["lm_head.bias.grad"], window.grad_bias)
        assert {t["name"] for t in manifest["tensors"]} >= {
            "lm_head.bias", "lm_head.bias.grad", "lm_head.bias.optimizer.exp_avg"}

        # Back in: a head with a bias, W and b as exported, in one push (version 2).
        assert import_safetensors(client, "copy", out) == 2
        assert client.get_head("copy").spec.bias
        copy = client.download_weights("copy", dtype=torch.float32)
        assert torch.equal(copy.weights, downloaded.weights)
        assert torch.equal(copy.bias, downloaded.bias)
        done = subprocess.run([str(cli), "import", f"--server={server.address}",
                               f"--safetensors={out}", "--head=tool-copy"],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert "'lm_head.bias'" in done.stdout
        tool = client.download_weights("tool-copy", dtype=torch.float32)
        assert client.get_head("tool-copy").spec.bias
        assert torch.equal(tool.weights, downloaded.weights)
        assert torch.equal(tool.bias, downloaded.bias)

        # A bias of the wrong length is refused, nothing created.
        bad = tmp_path / "bad.safetensors"
        w_bytes = torch.zeros(2, 2).numpy().tobytes()
        header = json.dumps({"lm_head.weight": {"dtype": "F32", "shape": [2, 2],
                                                "data_offsets": [0, 16]},
                             "lm_head.bias": {"dtype": "F32", "shape": [3],
                                              "data_offsets": [16, 28]}})
        header += " " * (-len(header) % 8)
        bad.write_bytes(struct.pack("<Q", len(header)) + header.encode() + w_bytes +
                        torch.zeros(3).numpy().tobytes())
        with pytest.raises(LossheadError) as e:
            import_safetensors(client, "bad", bad)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        done = subprocess.run([str(cli), "import", f"--server={server.address}",
                               f"--safetensors={bad}", "--head=bad"],
                              capture_output=True, text=True)
        assert done.returncode == 1 and "INVALID_ARGUMENT" in done.stderr, done.stderr
        assert sorted(h.spec.name for h in client.list_heads()) == ["biased", "copy",
                                                                     "tool-copy"]
