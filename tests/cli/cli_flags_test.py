"""The `losshead` tool's flags against a real server (CPU backend on two devices).

A flag outside its range exits 1 with INVALID_ARGUMENT and the exact reason, and leaves the
server's heads as they were: in particular no --init_std below 0 or NaN quietly becomes a zero
head, and no negative --replicas or --shards quietly means every device. The valid edges still
work: --init_std=0 (zeros), --shards=-1 and --replicas=0 (every device). --shards=0 means every
device too, as in the Python client; the deprecated spellings of renamed flags still work, but not
together with the new name.

    cli_flags_test.py LOSSHEAD_SERVER LOSSHEAD
"""

import re
import socket
import subprocess
import sys
import time


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(server_bin, cli_bin):
    target = f"127.0.0.1:{free_port()}"
    server = subprocess.Popen(
        [server_bin, f"--listen={target}", "--metrics_listen=127.0.0.1:0", "--backend=cpu",
         "--devices=0,1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    failures = []

    def cli(*args):
        return subprocess.run([cli_bin, *args, f"--server={target}"], capture_output=True,
                              text=True, timeout=60)

    def heads():
        listed = cli("list")
        assert listed.returncode == 0, listed.stderr
        return sorted(line.split()[0] for line in listed.stdout.splitlines()
                      if line and not line.startswith(" "))

    def refused(args, reason):
        before = heads()
        result = cli(*args)
        expected = f"INVALID_ARGUMENT: {reason}"
        if result.returncode != 1 or expected not in result.stderr:
            failures.append(f"{' '.join(args)}: exit {result.returncode}, stderr "
                            f"{result.stderr.strip()!r}; expected exit 1 and {expected!r}")
        if heads() != before:
            failures.append(f"{' '.join(args)}: heads {before} became {heads()}")

    def created(args, name, check):
        result = cli("create", f"--head={name}", "--vocab_size=10", "--hidden_size=8", *args)
        if result.returncode != 0 or not check(result.stdout):
            failures.append(f"create {' '.join(args)}: exit {result.returncode}, "
                            f"{result.stdout.strip()!r} {result.stderr.strip()!r}")

    try:
        deadline = time.monotonic() + 30
        while cli("health").returncode != 0:
            if server.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the server did not start: {server.stderr.read()}")
            time.sleep(0.1)

        head = ["create", "--head=x", "--vocab_size=10", "--hidden_size=8"]
        refused(head + ["--init_std=-1"], "--init_std must be finite and >= 0 (0: zeros), got -1")
        refused(head + ["--init_std=nan"], "--init_std must be finite and >= 0 (0: zeros), got nan")
        refused(head + ["--replicas=-1"], "--replicas must be >= 0 (0: every device), got -1")
        refused(head + ["--shards=-2"],
                "--shards must be >= 0 (0: every device; unset: not sharded), got -2")
        refused(head + ["--shards=2", "--replicas=2"],
                "--shards and --replicas cannot both be given")
        refused(head + ["--weight_dtype=int8"], "--weight_dtype must be bf16, fp16 or fp32")
        refused(head + ["--replicas=3"], "placement asks for 3 devices but the server has 2")
        refused(head + ["--weight_dtype=fp32", "--matmul_precision=tf32"],
                "--matmul_precision must be highest, high or medium (or empty: unset), got 'tf32'")
        # The server's refusal: a bf16 head's products are exact in fp32 already.
        refused(head + ["--weight_dtype=bf16", "--matmul_precision=high"],
                "matmul_precision MATMUL_PRECISION_HIGH applies to DTYPE_FP32 heads only")
        refused(head + ["--weight_dtype=fp16", "--matmul_precision=medium"],
                "matmul_precision MATMUL_PRECISION_MEDIUM applies to DTYPE_FP32 heads only")

        bench = ["bench", "--vocab_size=64", "--hidden_size=16", "--chunk_tokens=32"]
        range_reason = "--iterations must be >= 0 and, when it is 0, --seconds finite and > 0; got"
        refused(bench + ["--seconds=-1"], f"{range_reason} 0 and -1")
        refused(bench + ["--seconds=0"], f"{range_reason} 0 and 0")
        refused(bench + ["--iterations=-3"], f"{range_reason} -3 and 5")
        refused(bench + ["--seconds=1", "--replicas=-1"],
                "--replicas must be >= 0 (0: every device), got -1")
        refused(bench + ["--seconds=1", "--shards=-5"],
                "--shards must be >= 0 (0: every device; unset: not sharded), got -5")
        refused(bench + ["--streams=0"],
                "--chunk_tokens --hidden_size --vocab_size --streams --depth must be >= 1")

        # The valid edges.
        created(["--init_std=0"], "zeros", lambda out: out.startswith("zeros "))
        created(["--init_std=0.5"], "normal", lambda out: out.startswith("normal "))
        created(["--shards=-1"], "sharded_all",
                lambda out: "shard 0 on" in out and "shard 1 on" in out)
        created(["--replicas=0"], "replicated_all",
                lambda out: "replica 0 on" in out and "replica 1 on" in out)
        created(["--weight_dtype=fp32", "--matmul_precision=high"], "tf32",
                lambda out: out.startswith("tf32 ") and "FP32 matmul_precision=high" in out)
        if heads() != ["normal", "replicated_all", "sharded_all", "tf32", "zeros"]:
            failures.append(f"heads after the valid creates: {heads()}")

        # --shards=0 shards over every device, as Client.create_head(shards=0) does.
        created(["--shards=0"], "sharded_zero",
                lambda out: "shard 0 on" in out and "shard 1 on" in out)
        # The deprecated spellings land on their flags; one with its new name is refused (exit 2)
        # before anything is created.
        result = cli("create", "--head=old_names", "--vocab=12", "--hidden=6", "--dtype=fp32")
        if result.returncode != 0 or not re.match(r"old_names +V=12 +D=6 +FP32 ", result.stdout):
            failures.append(f"create with deprecated spellings: exit {result.returncode}, "
                            f"{result.stdout.strip()!r} {result.stderr.strip()!r}")
        before = heads()
        result = cli("create", "--head=both", "--vocab=12", "--vocab_size=12", "--hidden_size=6")
        expected = "--vocab and --vocab_size both given; --vocab is a deprecated spelling of"
        if result.returncode != 2 or expected not in result.stderr or heads() != before:
            failures.append(f"create --vocab --vocab_size: exit {result.returncode}, "
                            f"{result.stderr.strip()!r}, heads {heads()}")
    finally:
        server.terminate()
        server.wait(timeout=30)

    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    if failures:
        sys.exit(1)
    print("cli flags: every case as expected")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
