// Flags of the `losshead` tool, shared by its subcommands.
#ifndef LOSSHEAD_CLIENT_CLI_FLAGS_H_
#define LOSSHEAD_CLIENT_CLI_FLAGS_H_

#include <cstdint>
#include <string>

#include "absl/flags/declare.h"

ABSL_DECLARE_FLAG(std::string, server);
ABSL_DECLARE_FLAG(int64_t, max_message_bytes);
ABSL_DECLARE_FLAG(double, deadline_s);
ABSL_DECLARE_FLAG(std::string, head);
ABSL_DECLARE_FLAG(uint64_t, seed);
ABSL_DECLARE_FLAG(std::string, token_file);
ABSL_DECLARE_FLAG(std::string, tls_ca);
ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(std::string, tls_server_name);

// demo, create
ABSL_DECLARE_FLAG(int64_t, vocab);
ABSL_DECLARE_FLAG(int64_t, hidden);
// demo
ABSL_DECLARE_FLAG(int, steps);
ABSL_DECLARE_FLAG(int64_t, tokens_per_step);
ABSL_DECLARE_FLAG(int64_t, microbatch);
ABSL_DECLARE_FLAG(double, lr);
ABSL_DECLARE_FLAG(std::string, optimizer);
ABSL_DECLARE_FLAG(bool, client_optimizer);
ABSL_DECLARE_FLAG(double, teacher_gain);
ABSL_DECLARE_FLAG(int, print_every);
ABSL_DECLARE_FLAG(bool, keep_head);
// create, bench
ABSL_DECLARE_FLAG(std::string, dtype);
ABSL_DECLARE_FLAG(std::string, matmul_precision);
// create
ABSL_DECLARE_FLAG(double, init_std);
ABSL_DECLARE_FLAG(int, replicas);
ABSL_DECLARE_FLAG(int, shards);
// bench
ABSL_DECLARE_FLAG(int64_t, n);
ABSL_DECLARE_FLAG(int64_t, d);
ABSL_DECLARE_FLAG(int64_t, v);
ABSL_DECLARE_FLAG(int, streams);
ABSL_DECLARE_FLAG(double, seconds);
ABSL_DECLARE_FLAG(int64_t, iterations);
ABSL_DECLARE_FLAG(int, pipeline);
ABSL_DECLARE_FLAG(bool, dedicated_connections);
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
