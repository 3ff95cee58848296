// The subcommands of the `losshead` tool. Each returns the process exit code.
#ifndef LOSSHEAD_CLIENT_CLI_COMMANDS_H_
#define LOSSHEAD_CLIENT_CLI_COMMANDS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "losshead/client/client.h"
#include "losshead/v1/losshead.pb.h"

namespace losshead::cli {

// --weight_dtype as a head's weight dtype; INVALID_ARGUMENT unless bf16, fp16 or fp32.
absl::StatusOr<v1::DType> WeightDTypeFromFlags();

// --matmul_precision: UNSPECIFIED when empty; INVALID_ARGUMENT unless highest, high or medium.
// Whether the head's dtype allows it is the server's to say.
absl::StatusOr<v1::MatmulPrecision> MatmulPrecisionFromFlags();

// A head's weight dtype, and for an fp32 head its matmul precision: "bf16", "fp32 (matmul
// precision high)".
std::string DescribeNumerics(const v1::HeadSpec& spec);

// A client for --server with --max_message_bytes, --deadline_s, --token_file and the TLS flags.
// `same_node`: ClientOptions::same_node (docs/same-node.md).
absl::StatusOr<std::unique_ptr<client::Client>> ConnectFromFlags(bool dedicated_connection = false,
                                                                 bool same_node = true);

// The placement --replicas and --shards ask for: one device for --replicas=1 without --shards,
// replicated or sharded otherwise (--shards=0: over every device, as Client.create_head's
// shards=0 and the proto's devices=0). INVALID_ARGUMENT for both at once.
absl::StatusOr<v1::Placement> PlacementFromFlags();

int RunDemo();
int RunBench();
int RunCreate();
int RunList();
int RunDelete();
int RunStats();
int RunHealth();
int RunExport();
int RunProgress();
int RunImport();

}  // namespace losshead::cli

#endif  // LOSSHEAD_CLIENT_CLI_COMMANDS_H_
