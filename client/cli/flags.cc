#include "client/cli/flags.h"

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, server, "localhost:50051", "host:port of losshead-server");
ABSL_FLAG(int64_t, max_message_bytes, int64_t{4} << 20,
          "largest gRPC message; set it to the server's limit");
ABSL_FLAG(double, deadline_s, 60, "deadline of each unary call, pull and push, in seconds");
ABSL_FLAG(std::string, token_file, "",
          "file holding the bearer token sent on every call (its first non-comment line)");
ABSL_FLAG(std::string, tls_root_ca, "", "PEM root CA of the server's certificate: speak TLS");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate (mTLS, with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_server_name, "",
          "name to verify in the server's certificate instead of --server's host");

ABSL_FLAG(std::string, head, "",
          "head name (demo, bench: default a generated one, deleted at the end)");
ABSL_FLAG(uint64_t, seed, 1, "random seed");

ABSL_FLAG(std::optional<int64_t>, vocab_size, std::nullopt, "vocabulary size V of the head");
ABSL_FLAG(std::optional<int64_t>, hidden_size, std::nullopt, "hidden size D of the head");
ABSL_FLAG(
    std::string, weight_dtype, "bf16",
    "the head's weight dtype: bf16 | fp16 | fp32 (bench's hidden states are bf16 whatever it is)");
ABSL_FLAG(
    std::string, matmul_precision, "",
    "what an fp32 head's GEMMs may round to: highest | high (TF32) | medium (bf16); empty: unset");
ABSL_FLAG(double, init_std, 0, "normal init std of W; 0 means zeros");
ABSL_FLAG(
    bool, bias, false,
    "the head has an output bias b (V values, fp32, zeros at creation): nn.Linear(bias=True)");
ABSL_FLAG(int, replicas, 1,
          "devices the head is replicated over (1: one device; 0: every device of the server)");
ABSL_FLAG(
    std::optional<int>, shards, std::nullopt,
    "devices the head is sharded over by vocabulary rows (unset: not sharded; 0: every device)");
ABSL_FLAG(bool, across_processes, false,
          "with --shards: the head sharded across every process of a server group, --shards "
          "devices on each (docs/multi-process.md)");

ABSL_FLAG(std::optional<int64_t>, chunk_tokens, std::nullopt, "tokens per micro-batch");
ABSL_FLAG(int, streams, 2, "concurrent Step streams");
ABSL_FLAG(int, depth, 2, "micro-batches in flight per stream");

ABSL_FLAG(int, steps, 80, "optimizer steps");
ABSL_FLAG(int64_t, tokens_per_step, 2048,
          "tokens per optimizer step, sent in micro-batches of --chunk_tokens pipelined on one "
          "stream");
ABSL_FLAG(double, lr, 0.03, "learning rate (cosine decay to a tenth of it)");
ABSL_FLAG(std::string, optimizer, "adam", "adam | sgd");
ABSL_FLAG(bool, client_optimizer, false,
          "step W here (pull dW, update a host copy, push W) instead of with ApplyOptimizer");
ABSL_FLAG(double, teacher_gain, 2.5,
          "teacher weights ~ N(0, (gain / sqrt(D))^2); larger means lower entropy");
ABSL_FLAG(int, print_every, 5, "print the loss every this many steps");
ABSL_FLAG(bool, keep_head, false,
          "leave the head the command created on the server (and in its checkpoints) instead of "
          "deleting it at the end");

ABSL_FLAG(double, seconds, 5, "run time when --iterations is 0");
ABSL_FLAG(int64_t, iterations, 0, "micro-batches per stream; 0 runs for --seconds");
ABSL_FLAG(bool, dedicated_connections, true, "one TCP connection per stream");
ABSL_FLAG(bool, same_node, true,
          "take the same-node path (shared memory) when the server is on this host and offers "
          "it; false: the network path");
ABSL_FLAG(
    bool, fresh_results, false,
    "receive each dH into fresh memory, not into per-stream buffers reused as a trainer's are");
ABSL_FLAG(bool, zero_head, false,
          "create a zero head, not N(0, 0.02) W (GEMMs on zeros run faster: for comparisons only)");

ABSL_FLAG(
    std::string, checkpoint, "",
    "a checkpoint file (<head>.lhck), or the server's --checkpoint_dir with --head; read offline");
ABSL_FLAG(std::string, tag, "",
          "a named snapshot of --head instead of its checkpoint (<--checkpoint>/snapshots/<tag>/)");
ABSL_FLAG(std::string, out, "", "the safetensors file to write");
ABSL_FLAG(
    std::string, manifest, "",
    "the manifest JSON to write; default: --out with .safetensors replaced by .manifest.json");
ABSL_FLAG(std::string, tensor, "lm_head.weight",
          "the name of W in the safetensors file (optimizer state <tensor>.optimizer.*, dW "
          "<tensor>.grad)");
ABSL_FLAG(bool, with_optimizer, false,
          "add the server-side optimizer's state and fp32 master weights (bf16/fp16 heads)");
ABSL_FLAG(bool, with_gradient, false, "add the open gradient window dW (fp32)");
ABSL_FLAG(std::string, safetensors, "", "the safetensors file holding --tensor");
ABSL_FLAG(bool, create, true,
          "create --head (the tensor's shape and dtype) first; false pushes into an existing head");
ABSL_FLAG(std::string, client_id, "",
          "the client id whose acknowledged and persisted (checkpointed) sequences to print");

// Deprecated spellings, kept because scripts that drive older builds of this tool beside newer
// ones (scripts/run-bench-ab.sh) and health probes of deployed manifests pass them. The command
// line copies each onto its flag (command_line.cc); nothing reads them directly.
ABSL_FLAG(std::optional<int64_t>, vocab, std::nullopt, "deprecated: --vocab_size");
ABSL_FLAG(std::optional<int64_t>, v, std::nullopt, "deprecated: --vocab_size");
ABSL_FLAG(std::optional<int64_t>, hidden, std::nullopt, "deprecated: --hidden_size");
ABSL_FLAG(std::optional<int64_t>, d, std::nullopt, "deprecated: --hidden_size");
ABSL_FLAG(std::optional<int64_t>, n, std::nullopt, "deprecated: --chunk_tokens");
ABSL_FLAG(std::optional<int64_t>, microbatch, std::nullopt, "deprecated: --chunk_tokens");
ABSL_FLAG(std::optional<int>, pipeline, std::nullopt, "deprecated: --depth");
ABSL_FLAG(std::optional<std::string>, dtype, std::nullopt, "deprecated: --weight_dtype");
ABSL_FLAG(std::optional<std::string>, tls_ca, std::nullopt, "deprecated: --tls_root_ca");
