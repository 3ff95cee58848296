// The optimizer's part of a checkpoint file (format versions 2 and 3; see checkpoint.h): its record
// at the end of the meta section and the optimizer section after dW.
#ifndef LOSSHEAD_SERVER_DURABILITY_CHECKPOINT_OPTIMIZER_H_
#define LOSSHEAD_SERVER_DURABILITY_CHECKPOINT_OPTIMIZER_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/durability/checkpoint_codec.h"
#include "server/engine/head_checkpoint.h"

namespace losshead::server {

// Appends the record: step count, momentum bit, master version, the lengths of the master copy
// and of each state buffer, then per client id the remembered applies (key, response, and from
// format 3 on the fingerprint).
void EncodeOptimizerMeta(std::string& out, const HeadCheckpointData& data);
// Reads the record of a file of format `version` (>= 2) into `data`; the tensors' lengths go to
// `lengths` (master first) for SplitOptimizerSection. DATA_LOSS names what is wrong.
absl::Status DecodeOptimizerMeta(checkpoint_codec::Reader& r, uint32_t version,
                                 HeadCheckpointData* data, std::vector<uint64_t>* lengths);

// The optimizer section's pieces in file order: the master copy when there is one, then each
// state buffer; all of one length (V x D fp32), which the file's header records.
std::vector<absl::string_view> OptimizerSection(const HeadCheckpointData& data);
// Moves `pieces` (as OptimizerSection made them) into data->master and data->optimizer_state by
// the record's `lengths`; DATA_LOSS when they do not match.
absl::Status AssignOptimizerSection(std::vector<std::string> pieces,
                                    const std::vector<uint64_t>& lengths, HeadCheckpointData* data);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_DURABILITY_CHECKPOINT_OPTIMIZER_H_
