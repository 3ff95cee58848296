"""`losshead export` and `losshead import` against real checkpoint files and a real server.

A server (CPU backend) with --checkpoint_dir trains a head with server-side AdamW (`losshead
demo --keep_head`) and holds a bf16 head with random W; SIGTERM writes their checkpoints. Then,
offline, `losshead export` must write a safetensors file that a reader written here from the
format's specification accepts (8-byte little-endian header length, JSON header padded to 8
bytes, tensors covering the data exactly), whose tensors are the bytes of the checkpoint file's
sections (parsed here from the layout documented in server/durability/checkpoint.h, not with the
server's reader) and whose manifest matches (SHA-256 by hashlib, versions, shape, dtype). Bad
input (a missing or corrupted checkpoint, --with_optimizer without an optimizer, a directory
without --head) exits 1 with the exact status and leaves any earlier output as it was.
`losshead import` seeds a head on a running server from the export; checkpointed and exported
again, its W is the same bytes. Refusals (an existing head, a missing tensor, a truncated file,
NaN weights) create nothing. A restarted server answers SERVING only with every head restored.

    export_test.py LOSSHEAD_SERVER LOSSHEAD
"""

import hashlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4}


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_safetensors(path):
    """(header dict, {name: bytes}) of a safetensors file, checked against the format's rules."""
    raw = Path(path).read_bytes()
    assert len(raw) >= 8, f"{path}: shorter than the header length"
    (n,) = struct.unpack("<Q", raw[:8])
    assert 8 + n <= len(raw), f"{path}: header length {n} exceeds the file"
    text = raw[8:8 + n].decode("utf-8")
    assert text.startswith("{"), f"{path}: header does not start with '{{'"
    assert n % 8 == 0, f"{path}: header of {n} bytes is not padded to a multiple of 8"
    header = json.loads(text)
    data = raw[8 + n:]
    spans, tensors = [], {}
    for name, info in header.items():
        if name == "__metadata__":
            assert all(isinstance(k, str) and isinstance(v, str) for k, v in info.items())
            continue
        begin, end = info["data_offsets"]
        elements = 1
        for dim in info["shape"]:
            elements *= dim
        assert end - begin == elements * DTYPE_BYTES[info["dtype"]], f"{name}: size vs shape"
        spans.append((begin, end))
        tensors[name] = data[begin:end]
    covered = 0
    for begin, end in sorted(spans):
        assert begin == covered, f"{path}: gap or overlap at byte {begin}"
        covered = end
    assert covered == len(data), f"{path}: {len(data) - covered} bytes after the last tensor"
    return header, tensors


def checkpoint_sections(path):
    """The sections of a checkpoint file by the layout of server/durability/checkpoint.h."""
    raw = Path(path).read_bytes()
    assert raw[:8] == b"LHCKPT\r\n", f"{path}: bad magic"
    version, _reserved, meta, weights, gradient, _checksum, optimizer, piece = struct.unpack(
        "<IIQQQQQQ", raw[8:64])
    # Versions 3 and later share this header and the meta's first fields (later ones only
    # remember more of each answer further on).
    assert version >= 3, version
    at = 64
    meta_bytes = raw[at:at + meta]
    at += meta
    w = raw[at:at + weights]
    at += weights
    g = raw[at:at + gradient]
    at += gradient
    pieces = [raw[at + i:at + i + piece] for i in range(0, optimizer, piece)] if piece else []
    (spec_len,) = struct.unpack("<Q", meta_bytes[:8])
    (weights_version,) = struct.unpack("<Q", meta_bytes[8 + spec_len:16 + spec_len])
    return {"weights": w, "gradient": g, "optimizer": pieces, "weights_version": weights_version}


class Server:
    def __init__(self, binary, ckpt_dir, log):
        self.target = f"127.0.0.1:{free_port()}"
        args = [binary, f"--listen={self.target}", "--metrics_listen=", "--backend=cpu",
                "--checkpoint_interval=0"]
        if ckpt_dir:
            args.append(f"--checkpoint_dir={ckpt_dir}")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=60) == 0, "the server did not exit cleanly on SIGTERM"


def main(server_bin, cli_bin):
    tmp = Path(tempfile.mkdtemp(prefix="losshead-export-"))
    log = open(tmp / "server.log", "w")
    failures = []

    def expect(ok, what):
        if not ok:
            failures.append(what)

    def cli(*args, server=None):
        argv = [cli_bin, *args] + ([f"--server={server.target}"] if server else [])
        return subprocess.run(argv, capture_output=True, text=True, timeout=120)

    def wait_serving(server):
        deadline = time.monotonic() + 30
        while cli("health", server=server).returncode != 0:
            assert server.proc.poll() is None, "the server exited"
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)

    def refused(args, code, text, server=None):
        r = cli(*args, server=server)
        expect(r.returncode == 1 and f"{code}: " in r.stderr and text in r.stderr,
               f"{' '.join(args)}: exit {r.returncode}, {r.stderr.strip()!r}; expected {code} "
               f"with {text!r}")

    ckpt = tmp / "ckpt"
    server = Server(server_bin, ckpt, log)
    try:
        wait_serving(server)
        r = cli("demo", "--head=trained", "--keep_head", "--steps=4", "--vocab_size=96",
                "--hidden_size=24", "--tokens_per_step=384", "--chunk_tokens=128", server=server)
        assert r.returncode == 0, r.stderr
        r = cli("create", "--head=plain", "--vocab_size=50", "--hidden_size=12",
                "--weight_dtype=bf16",
                "--init_std=0.3", server=server)
        assert r.returncode == 0, r.stderr
    finally:
        server.stop()  # the final checkpoint

    # The trained head: W, AdamW's two moments (an fp32 head is its own master) and dW.
    out = tmp / "trained.safetensors"
    r = cli("export", f"--checkpoint={ckpt}", "--head=trained", f"--out={out}",
            "--with_optimizer", "--with_gradient")
    assert r.returncode == 0, r.stderr
    header, tensors = read_safetensors(out)
    sections = checkpoint_sections(ckpt / "trained.lhck")
    names = ["lm_head.weight", "lm_head.weight.optimizer.exp_avg",
             "lm_head.weight.optimizer.exp_avg_sq", "lm_head.weight.grad"]
    expect(sorted(tensors) == sorted(names), f"tensors {sorted(tensors)}")
    expect(tensors["lm_head.weight"] == sections["weights"], "W differs from the checkpoint's")
    expect([tensors[n] for n in names[1:3]] == sections["optimizer"],
           "the optimizer state differs from the checkpoint's")
    expect(tensors["lm_head.weight.grad"] == sections["gradient"], "dW differs")
    expect(any(b != 0 for b in tensors["lm_head.weight"]), "W is all zeros: nothing was trained")
    for name in names:
        expect(header[name]["dtype"] == "F32" and header[name]["shape"] == [96, 24],
               f"{name}: {header[name]}")
    meta = header["__metadata__"]
    expect(meta.get("format") == "pt" and meta.get("losshead.head") == "trained" and
           meta.get("losshead.optimizer") == "adamw" and meta.get("losshead.optimizer_step") == "4"
           and meta.get("losshead.weights_version") == str(sections["weights_version"]),
           f"metadata {meta}")
    manifest = json.loads((tmp / "trained.manifest.json").read_text())
    expect(manifest["head"] == "trained" and manifest["weights_version"] == 5 and
           sections["weights_version"] == 5 and manifest["optimizer_step"] == 4 and
           manifest["vocab_size"] == 96 and manifest["hidden_size"] == 24 and
           manifest["dtype"] == "fp32" and manifest["safetensors"] == "trained.safetensors",
           f"manifest {manifest}")
    expect({t["name"]: t["sha256"] for t in manifest["tensors"]} ==
           {n: hashlib.sha256(tensors[n]).hexdigest() for n in names}, "manifest digests")
    # The demo's client id, with every one of its 4 x 3 micro-batches in the checkpoint.
    clients = manifest.get("clients", [])
    expect(len(clients) == 1 and clients[0]["client_id"].startswith("demo-") and
           clients[0]["persisted_sequence"] == 12, f"manifest clients {clients}")

    # A bf16 head without optimizer, under another name and manifest path.
    plain = tmp / "plain.safetensors"
    r = cli("export", f"--checkpoint={ckpt / 'plain.lhck'}", f"--out={plain}",
            "--tensor=model.lm_head.weight", f"--manifest={tmp / 'plain.json'}")
    assert r.returncode == 0, r.stderr
    header, tensors = read_safetensors(plain)
    expect(list(tensors) == ["model.lm_head.weight"] and
           header["model.lm_head.weight"]["dtype"] == "BF16" and
           header["model.lm_head.weight"]["shape"] == [50, 12] and
           tensors["model.lm_head.weight"] == checkpoint_sections(ckpt / "plain.lhck")["weights"],
           f"bf16 export: {header}")
    expect(json.loads((tmp / "plain.json").read_text())["dtype"] == "bf16", "bf16 manifest")

    # Bad input: exact status, and the earlier output stays as it was.
    before = out.read_bytes()
    refused(["export", f"--checkpoint={ckpt / 'nothing.lhck'}", f"--out={out}"], "NOT_FOUND",
            "nothing.lhck")
    corrupt = tmp / "corrupt.lhck"
    raw = bytearray((ckpt / "trained.lhck").read_bytes())
    raw[len(raw) // 2] ^= 0x01
    corrupt.write_bytes(bytes(raw))
    refused(["export", f"--checkpoint={corrupt}", f"--out={out}"], "DATA_LOSS",
            "checksum mismatch")
    refused(["export", f"--checkpoint={ckpt / 'plain.lhck'}", f"--out={out}",
             "--with_optimizer"], "FAILED_PRECONDITION", "has no server-side optimizer")
    refused(["export", f"--checkpoint={ckpt}", f"--out={out}"], "INVALID_ARGUMENT",
            "name the head with --head")
    refused(["export", f"--checkpoint={ckpt / 'plain.lhck'}"], "INVALID_ARGUMENT", "--out")
    expect(out.read_bytes() == before, "a refused export changed the earlier output")
    expect(not list(tmp.glob("*.tmp")), "a refused export left a temporary file")

    # A restarted server is SERVING only once every checkpointed head is back.
    server = Server(server_bin, ckpt, log)
    try:
        wait_serving(server)
        listed = cli("list", server=server)
        expect(listed.returncode == 0 and "plain " in listed.stdout and
               "trained " in listed.stdout and "version=5 " in listed.stdout,
               f"SERVING before the heads were restored: {listed.stdout!r}")
        # What the restarted server holds of the demo's micro-batches: the checkpoint's record.
        if clients:
            r = cli("progress", "--head=trained", f"--client_id={clients[0]['client_id']}",
                    server=server)
            expect(r.returncode == 0 and "acknowledged=12 persisted=12" in r.stdout,
                   f"progress: {r.stdout!r} {r.stderr!r}")
        refused(["progress", "--head=trained"], "INVALID_ARGUMENT", "--client_id",
                server=server)
    finally:
        server.stop()

    # Import into a fresh server, checkpoint it, export it again: the same W.
    ckpt2 = tmp / "ckpt2"
    server = Server(server_bin, ckpt2, log)
    try:
        wait_serving(server)
        r = cli("import", f"--safetensors={out}", "--head=copy", server=server)
        expect(r.returncode == 0 and "weights version 2" in r.stdout, f"import: {r.stderr}")
        refused(["import", f"--safetensors={out}", "--head=copy"], "ALREADY_EXISTS", "copy",
                server=server)
        refused(["import", f"--safetensors={out}", "--head=other", "--tensor=nope"], "NOT_FOUND",
                "lm_head.weight.grad", server=server)
        truncated = tmp / "truncated.safetensors"
        truncated.write_bytes(out.read_bytes()[:-10])
        refused(["import", f"--safetensors={truncated}", "--head=other"], "INVALID_ARGUMENT",
                "not a valid safetensors file", server=server)
        # A tensor the server refuses (NaN) leaves no head behind.
        nan = tmp / "nan.safetensors"
        body = json.dumps({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}})
        body += " " * (-len(body) % 8)
        nan.write_bytes(struct.pack("<Q", len(body)) + body.encode() +
                        struct.pack("<4f", 1.0, float("nan"), 0.0, 2.0))
        refused(["import", f"--safetensors={nan}", "--head=other", "--tensor=w"],
                "INVALID_ARGUMENT", "NaN", server=server)
        listed = cli("list", server=server).stdout
        expect("other" not in listed and "copy " in listed, f"heads after refusals: {listed!r}")
        # Into an existing head of the same shape.
        r = cli("create", "--head=seeded", "--vocab_size=96", "--hidden_size=24",
                "--weight_dtype=fp32",
                server=server)
        assert r.returncode == 0, r.stderr
        r = cli("import", f"--safetensors={out}", "--head=seeded", "--create=false",
                server=server)
        expect(r.returncode == 0, f"import --create=false: {r.stderr}")
    finally:
        server.stop()
    for head in ("copy", "seeded"):
        again = tmp / f"{head}.safetensors"
        r = cli("export", f"--checkpoint={ckpt2 / (head + '.lhck')}", f"--out={again}")
        expect(r.returncode == 0, r.stderr)
        if r.returncode == 0:
            expect(read_safetensors(again)[1]["lm_head.weight"] ==
                   read_safetensors(out)[1]["lm_head.weight"], f"{head}: W changed on the way")

    log.close()
    for f in failures:
        print(f"FAIL: {f}", file=sys.stderr)
    if failures:
        print((tmp / "server.log").read_text()[-3000:], file=sys.stderr)
        sys.exit(1)
    print("OK: export (fp32 + AdamW + dW, bf16), its refusals, import and the round trip")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
