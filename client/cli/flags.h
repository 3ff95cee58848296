// Flags of the `losshead` tool. Which subcommand reads which is the table in command_line.cc: a
// flag given to a subcommand that does not read it is refused there, before anything runs.
#ifndef LOSSHEAD_CLIENT_CLI_FLAGS_H_
#define LOSSHEAD_CLIENT_CLI_FLAGS_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/flags/declare.h"

// Connection: every subcommand that talks to a server.
ABSL_DECLARE_FLAG(std::string, server);
ABSL_DECLARE_FLAG(int64_t, max_message_bytes);
ABSL_DECLARE_FLAG(double, deadline_s);
ABSL_DECLARE_FLAG(std::string, token_file);
ABSL_DECLARE_FLAG(std::string, tls_root_ca);
ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(std::string, tls_server_name);

ABSL_DECLARE_FLAG(std::string, head);
ABSL_DECLARE_FLAG(uint64_t, seed);

// A head's shape and numerics (demo, bench, create, import), named as the Python client's
// Client.create_head names them. Unset sizes take the subcommand's default (commands.h).
ABSL_DECLARE_FLAG(std::optional<int64_t>, vocab_size);
ABSL_DECLARE_FLAG(std::optional<int64_t>, hidden_size);
ABSL_DECLARE_FLAG(std::string, weight_dtype);
ABSL_DECLARE_FLAG(std::string, matmul_precision);
ABSL_DECLARE_FLAG(bool, bias);
ABSL_DECLARE_FLAG(double, init_std);
ABSL_DECLARE_FLAG(int, replicas);
// Unset: not sharded; 0: every device of the server; k: k devices (Client.create_head's shards).
ABSL_DECLARE_FLAG(std::optional<int>, shards);
// With --shards: sharded across every process of a group (Placement.across_processes).
ABSL_DECLARE_FLAG(bool, across_processes);

// Streaming (demo, bench), named as RemoteLMHead names them. Unset: the subcommand's default.
ABSL_DECLARE_FLAG(std::optional<int64_t>, chunk_tokens);
ABSL_DECLARE_FLAG(int, streams);
ABSL_DECLARE_FLAG(int, depth);

// demo
ABSL_DECLARE_FLAG(int, steps);
ABSL_DECLARE_FLAG(int64_t, tokens_per_step);
ABSL_DECLARE_FLAG(double, lr);
ABSL_DECLARE_FLAG(std::string, optimizer);
ABSL_DECLARE_FLAG(bool, client_optimizer);
ABSL_DECLARE_FLAG(double, teacher_gain);
ABSL_DECLARE_FLAG(int, print_every);
ABSL_DECLARE_FLAG(bool, keep_head);

// bench
ABSL_DECLARE_FLAG(double, seconds);
ABSL_DECLARE_FLAG(int64_t, iterations);
ABSL_DECLARE_FLAG(bool, dedicated_connections);
ABSL_DECLARE_FLAG(bool, same_node);
ABSL_DECLARE_FLAG(bool, fresh_results);
ABSL_DECLARE_FLAG(bool, zero_head);

// progress
ABSL_DECLARE_FLAG(std::string, client_id);

// export, import
ABSL_DECLARE_FLAG(std::string, checkpoint);
ABSL_DECLARE_FLAG(std::string, tag);
ABSL_DECLARE_FLAG(std::string, out);
ABSL_DECLARE_FLAG(std::string, manifest);
ABSL_DECLARE_FLAG(std::string, tensor);
ABSL_DECLARE_FLAG(bool, with_optimizer);
ABSL_DECLARE_FLAG(bool, with_gradient);
ABSL_DECLARE_FLAG(std::string, safetensors);
ABSL_DECLARE_FLAG(bool, create);

#endif  // LOSSHEAD_CLIENT_CLI_FLAGS_H_
