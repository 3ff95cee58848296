#include "client/cli/flags.h"

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, server, "localhost:50051", "host:port of losshead-server");
ABSL_FLAG(int64_t, max_message_bytes, int64_t{4} << 20,
          "largest gRPC message; set it to the server's limit");
ABSL_FLAG(double, deadline_s, 60, "deadline of each unary call, pull and push, in seconds");
ABSL_FLAG(std::string, head, "", "head name (demo, create, delete, bench: default generated)");
ABSL_FLAG(uint64_t, seed, 1, "random seed");
ABSL_FLAG(std::string, token_file, "",
          "file holding the bearer token sent on every call (its first non-comment line)");
ABSL_FLAG(std::string, tls_ca, "", "PEM root CA of the server's certificate: speak TLS");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate (mTLS, with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_server_name, "",
          "name to verify in the server's certificate instead of --server's host");

ABSL_FLAG(int64_t, vocab, 512, "vocabulary size V (demo, create)");
ABSL_FLAG(int64_t, hidden, 64, "hidden size D (demo, create)");

ABSL_FLAG(int, steps, 80, "demo: optimizer steps");
ABSL_FLAG(int64_t, tokens_per_step, 2048, "demo: tokens per optimizer step");
ABSL_FLAG(int64_t, microbatch, 512, "demo: tokens per micro-batch (pipelined on one stream)");
ABSL_FLAG(double, lr, 0.03, "demo: learning rate");
ABSL_FLAG(std::string, optimizer, "adam", "demo: adam | sgd");
ABSL_FLAG(bool, client_optimizer, false,
          "demo: run the optimizer here (pull dW, step a host copy of W, push it) instead of on "
          "the server (ApplyOptimizer); the slow path, for optimizers the server lacks");
ABSL_FLAG(double, teacher_gain, 2.5,
          "demo: teacher weights ~ N(0, (gain / sqrt(D))^2); larger means lower entropy");
ABSL_FLAG(int, print_every, 5, "demo: print the loss every this many steps");
ABSL_FLAG(bool, keep_head, false,
          "demo: leave the trained head on the server (and in its checkpoints) instead of "
          "deleting it at the end");

ABSL_FLAG(std::string, dtype, "bf16",
          "create, bench: weight dtype bf16 | fp16 | fp32 (bench: of the head it creates; the "
          "hidden states it sends are bf16 whatever the head's dtype, converted by the server)");
ABSL_FLAG(std::string, matmul_precision, "",
          "create, bench: what an fp32 head's GEMMs may round their inputs to, as "
          "torch.set_float32_matmul_precision: highest (IEEE fp32) | high (TF32) | medium "
          "(bf16); empty leaves it unset (highest). bf16 and fp16 heads take highest only");
ABSL_FLAG(double, init_std, 0, "create: normal init std; 0 means zeros");
ABSL_FLAG(int, replicas, 1,
          "create, bench: devices the head is replicated over (1: one device; 0: every device "
          "of the server)");
ABSL_FLAG(int, shards, 0,
          "create, bench: devices the head is sharded over by vocabulary rows, each holding "
          "V / shards of them (0: not sharded; -1: every device of the server); not with "
          "--replicas");

ABSL_FLAG(int64_t, n, 1024, "bench: tokens per micro-batch");
ABSL_FLAG(int64_t, d, 512, "bench: hidden size");
ABSL_FLAG(int64_t, v, 8192, "bench: vocabulary size");
ABSL_FLAG(int, streams, 2, "bench: concurrent Step streams");
ABSL_FLAG(double, seconds, 5, "bench: run time when --iterations is 0");
ABSL_FLAG(int64_t, iterations, 0, "bench: micro-batches per stream; 0 runs for --seconds");
ABSL_FLAG(int, pipeline, 2, "bench: micro-batches in flight per stream");
ABSL_FLAG(bool, dedicated_connections, true, "bench: one TCP connection per stream");
ABSL_FLAG(bool, fresh_results, false,
          "bench: receive each dH into fresh memory (StepResult::grad_hidden) instead of into "
          "buffers each stream keeps, one per micro-batch in flight, as a trainer's own dH "
          "tensors would be");
ABSL_FLAG(bool, zero_head, false,
          "bench: create a zero head instead of one drawn from N(0, 0.02) (GEMMs on zeros run "
          "faster than on real weights: for comparisons only)");

ABSL_FLAG(std::string, checkpoint, "",
          "export: a server checkpoint file (<head>.lhck), or the server's --checkpoint_dir "
          "with --head; read offline, no server needed");
ABSL_FLAG(std::string, tag, "",
          "export: a named snapshot of --head instead of its checkpoint (the file "
          "<--checkpoint>/snapshots/<tag>/<head>.lhck)");
ABSL_FLAG(std::string, out, "", "export: the safetensors file to write");
ABSL_FLAG(std::string, manifest, "",
          "export: the manifest JSON to write (head, versions, shape, dtype, sha256 of each "
          "tensor); default: --out with .safetensors replaced by .manifest.json");
ABSL_FLAG(std::string, tensor, "lm_head.weight",
          "export, import: the name of W in the safetensors file (optimizer tensors are "
          "<tensor>.optimizer.*, dW <tensor>.grad)");
ABSL_FLAG(bool, with_optimizer, false,
          "export: add the server-side optimizer's fp32 master weights (bf16/fp16 heads) and "
          "state (exp_avg, exp_avg_sq, momentum_buffer)");
ABSL_FLAG(bool, with_gradient, false, "export: add the open gradient window dW (fp32)");
ABSL_FLAG(std::string, safetensors, "", "import: the safetensors file holding --tensor");
ABSL_FLAG(bool, create, true,
          "import: create --head (V x D and dtype of the tensor, --replicas/--shards, "
          "--matmul_precision) before pushing W; false pushes into an existing head");
ABSL_FLAG(std::string, client_id, "",
          "progress: the client id whose acknowledged (applied) and persisted (checkpointed) "
          "sequences to print; after a crash, micro-batches above persisted were lost");
