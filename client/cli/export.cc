// `losshead export`: a server checkpoint file to safetensors and a manifest, offline (no server);
// `losshead import`: a head seeded from a safetensors tensor on a running server.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "client/cli/commands.h"
#include "client/cli/flags.h"
#include "client/cli/human_units.h"
#include "client/cli/safetensors.h"
#include "server/durability/checkpoint.h"

namespace losshead::cli {
namespace {

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "error: %s\n", status.ToString().c_str());
  return 1;
}

uint64_t DTypeBytes(v1::DType dtype) { return dtype == v1::DTYPE_FP32 ? 4 : 2; }

// Where a head's output bias b goes beside W named `tensor`: "lm_head.weight" -> "lm_head.bias",
// as nn.Linear's state dict names them; another name gets ".bias" appended.
std::string BiasName(const std::string& tensor) {
  absl::string_view stem = tensor;
  if (absl::ConsumeSuffix(&stem, ".weight")) return absl::StrCat(stem, ".bias");
  return absl::StrCat(tensor, ".bias");
}

// fp32 values of `n` elements of `dtype` (BF16, FP16 or FP32) at `data`: exact, as every bf16
// and fp16 value is an fp32 one.
std::string ToFp32(absl::string_view data, v1::DType dtype) {
  if (dtype == v1::DTYPE_FP32) return std::string(data);
  const size_t n = data.size() / 2;
  std::string out(n * 4, '\0');
  for (size_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, data.data() + 2 * i, 2);
    uint32_t bits;
    if (dtype == v1::DTYPE_BF16) {
      bits = static_cast<uint32_t>(h) << 16;
    } else {  // FP16: sign, 5 exponent bits (bias 15), 10 mantissa bits
      const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
      uint32_t exponent = (h >> 10) & 0x1f;
      uint32_t mantissa = h & 0x3ff;
      if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);  // Inf, NaN
      } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
      } else if (mantissa == 0) {
        bits = sign;  // +-0
      } else {        // subnormal: normalise
        exponent = 113;
        while ((mantissa & 0x400) == 0) {
          mantissa <<= 1;
          --exponent;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
      }
    }
    std::memcpy(out.data() + 4 * i, &bits, 4);
  }
  return out;
}

std::string Lower(const std::string& name, absl::string_view prefix) {
  return absl::AsciiStrToLower(absl::StripPrefix(name, prefix));
}

// The names of an optimizer's state buffers in checkpoint order (StateBufferCount's), as
// torch.optim names them in its state dicts.
std::vector<std::string> StateNames(v1::OptimizerKind kind) {
  switch (kind) {
    case v1::OPTIMIZER_ADAMW:
      return {"exp_avg", "exp_avg_sq"};
    case v1::OPTIMIZER_SGD:
      return {"momentum_buffer"};
    case v1::OPTIMIZER_LION:
      return {"exp_avg"};
    default:
      return {};
  }
}

// --checkpoint names a file, or the server's checkpoint directory with --head.
absl::StatusOr<std::string> CheckpointPath() {
  const std::string path = absl::GetFlag(FLAGS_checkpoint);
  if (path.empty()) {
    return absl::InvalidArgumentError(
        "--checkpoint is required: a <head>.lhck file, or the server's --checkpoint_dir with "
        "--head");
  }
  const std::string tag = absl::GetFlag(FLAGS_tag);
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    const std::string head = absl::GetFlag(FLAGS_head);
    if (head.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--checkpoint=", path, " is a directory: name the head with --head"));
    }
    // A named snapshot lives beside the checkpoints: snapshots/<tag>/<head>.lhck.
    const std::string dir = std::string(absl::StripSuffix(path, "/"));
    return tag.empty()
               ? absl::StrCat(dir, "/", head, server::kCheckpointSuffix)
               : absl::StrCat(dir, "/snapshots/", tag, "/", head, server::kCheckpointSuffix);
  }
  if (!tag.empty()) {
    return absl::InvalidArgumentError(
        "--tag names a snapshot in a checkpoint directory: give --checkpoint the directory");
  }
  return path;
}

// --manifest, or --out with ".safetensors" replaced by ".manifest.json".
std::string ManifestPath(const std::string& out) {
  const std::string manifest = absl::GetFlag(FLAGS_manifest);
  if (!manifest.empty()) return manifest;
  return absl::StrCat(absl::StripSuffix(out, ".safetensors"), ".manifest.json");
}

// Atomic like the safetensors file: a crash leaves the old manifest or the new one.
absl::Status WriteTextFile(const std::string& path, const std::string& text) {
  const std::string tmp = absl::StrCat(path, ".tmp");
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("cannot create ", tmp, ": ", std::strerror(errno)));
  }
  bool ok = true;
  for (size_t done = 0; ok && done < text.size();) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    ok = n > 0;
    if (ok) done += static_cast<size_t>(n);
  }
  ok = ok && ::fsync(fd) == 0;
  ok = (::close(fd) == 0) && ok;
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string error = std::strerror(errno);
    ::unlink(tmp.c_str());
    return absl::InternalError(absl::StrCat("cannot write ", path, ": ", error));
  }
  return absl::OkStatus();
}

std::string JsonShape(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

int RunExport() {
  absl::StatusOr<std::string> path = CheckpointPath();
  if (!path.ok()) return Fail(path.status());
  const std::string out = absl::GetFlag(FLAGS_out);
  const std::string name = absl::GetFlag(FLAGS_tensor);
  if (out.empty())
    return Fail(absl::InvalidArgumentError("--out (the safetensors file) is required"));
  if (name.empty()) return Fail(absl::InvalidArgumentError("--tensor must not be empty"));
  const bool with_optimizer = absl::GetFlag(FLAGS_with_optimizer);
  const bool with_gradient = absl::GetFlag(FLAGS_with_gradient);

  // The server's own reader: the checksum and every section are verified before anything is used.
  absl::StatusOr<server::HeadCheckpointData> data = server::ReadCheckpointFile(*path);
  if (!data.ok()) return Fail(data.status());
  const v1::HeadSpec& spec = data->spec;
  const int64_t v = spec.vocab_size();
  const int64_t d = spec.hidden_size();
  const v1::DType dtype = spec.weight_dtype();
  const uint64_t elements = static_cast<uint64_t>(v) * static_cast<uint64_t>(d);
  const std::vector<int64_t> shape = {v, d};
  if (v < 1 || d < 1 || SafetensorsDType(dtype).empty() ||
      data->weights.size() != elements * DTypeBytes(dtype)) {
    return Fail(
        absl::DataLossError(absl::StrCat(*path, ": W holds ", data->weights.size(), " bytes, not ",
                                         v, " x ", d, " of ", v1::DType_Name(dtype))));
  }
  std::vector<SafetensorsTensor> tensors = {
      {.name = name, .dtype = dtype, .shape = shape, .data = data->weights}};
  const v1::OptimizerKind kind = spec.optimizer().kind();
  const std::string optimizer = Lower(v1::OptimizerKind_Name(kind), "OPTIMIZER_");
  if (with_optimizer) {
    if (kind == v1::OPTIMIZER_NONE) {
      return Fail(absl::FailedPreconditionError(
          absl::StrCat("head '", spec.name(), "' in ", *path,
                       " has no server-side optimizer: there is no optimizer state to export "
                       "(leave out --with_optimizer)")));
    }
    const std::vector<std::string> names = StateNames(kind);
    if (data->optimizer_state.size() > names.size()) {
      return Fail(absl::DataLossError(absl::StrCat(*path, ": ", data->optimizer_state.size(),
                                                   " optimizer buffers for ", optimizer)));
    }
    if (!data->master.empty()) {
      tensors.push_back({.name = absl::StrCat(name, ".optimizer.master_weights"),
                         .dtype = v1::DTYPE_FP32,
                         .shape = shape,
                         .data = data->master});
    }
    for (size_t i = 0; i < data->optimizer_state.size(); ++i) {
      tensors.push_back({.name = absl::StrCat(name, ".optimizer.", names[i]),
                         .dtype = v1::DTYPE_FP32,
                         .shape = shape,
                         .data = data->optimizer_state[i]});
    }
  }
  if (with_gradient) {
    tensors.push_back({.name = absl::StrCat(name, ".grad"),
                       .dtype = v1::DTYPE_FP32,
                       .shape = shape,
                       .data = data->gradient});
  }
  // A head with an output bias: b (fp32, as the server keeps it) beside W, under nn.Linear's
  // name for it, with its optimizer state and db as W's.
  if (spec.bias()) {
    const std::string bias = BiasName(name);
    tensors.push_back({.name = bias, .dtype = v1::DTYPE_FP32, .shape = {v}, .data = data->bias});
    if (with_optimizer) {
      const std::vector<std::string> names = StateNames(kind);
      if (data->bias_optimizer_state.size() > names.size()) {
        return Fail(absl::DataLossError(absl::StrCat(*path, ": ", data->bias_optimizer_state.size(),
                                                     " optimizer buffers of b for ", optimizer)));
      }
      for (size_t i = 0; i < data->bias_optimizer_state.size(); ++i) {
        tensors.push_back({.name = absl::StrCat(bias, ".optimizer.", names[i]),
                           .dtype = v1::DTYPE_FP32,
                           .shape = {v},
                           .data = data->bias_optimizer_state[i]});
      }
    }
    if (with_gradient) {
      tensors.push_back({.name = absl::StrCat(bias, ".grad"),
                         .dtype = v1::DTYPE_FP32,
                         .shape = {v},
                         .data = data->grad_bias});
    }
  }
  for (const SafetensorsTensor& t : tensors) {
    uint64_t count = 1;
    for (int64_t n : t.shape) count *= static_cast<uint64_t>(n);
    if (t.data.size() != count * DTypeBytes(t.dtype)) {
      return Fail(absl::DataLossError(absl::StrCat(*path, ": ", t.name, " holds ", t.data.size(),
                                                   " bytes, not ", JsonShape(t.shape), " of ",
                                                   v1::DType_Name(t.dtype))));
    }
  }

  // The metadata travel inside the file (Hugging Face loaders want "format": "pt"); the manifest
  // beside it repeats them with a digest of every tensor.
  std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {"losshead.head", spec.name()},
      {"losshead.weights_version", absl::StrCat(data->weights_version)},
      {"losshead.optimizer", optimizer},
      {"losshead.optimizer_step", absl::StrCat(data->optimizer_step)},
  };
  if (absl::Status s = WriteSafetensors(out, tensors, metadata); !s.ok()) return Fail(s);

  std::vector<std::string> entries;
  for (const SafetensorsTensor& t : tensors) {
    entries.push_back(absl::StrCat("    {\"name\": ", JsonString(t.name), ", \"dtype\": \"",
                                   SafetensorsDType(t.dtype), "\", \"shape\": ", JsonShape(t.shape),
                                   ", \"bytes\": ", t.data.size(), ", \"sha256\": \"",
                                   Sha256Hex(t.data), "\"}"));
  }
  // What the checkpoint holds of each client id: after a crash, its micro-batches above
  // persisted_sequence were lost (GetClientProgress says the same of a restarted server).
  std::vector<std::string> clients;
  for (const server::ClientCheckpoint& c : data->clients) {
    clients.push_back(
        absl::StrCat("    {\"client_id\": ", JsonString(c.client_id), ", \"persisted_sequence\": ",
                     c.max_applied.has_value() ? absl::StrCat(*c.max_applied) : "null", "}"));
  }
  const std::string slash_free = out.substr(out.rfind('/') + 1);
  const std::string manifest = absl::StrCat(
      "{\n  \"format\": \"losshead-export/1\",\n", "  \"safetensors\": ", JsonString(slash_free),
      ",\n", "  \"checkpoint\": ", JsonString(*path), ",\n",
      "  \"head\": ", JsonString(spec.name()), ",\n", "  \"vocab_size\": ", v,
      ",\n  \"hidden_size\": ", d, ",\n", "  \"dtype\": \"", Lower(v1::DType_Name(dtype), "DTYPE_"),
      "\",\n", "  \"weights_version\": ", data->weights_version, ",\n",
      "  \"optimizer\": ", JsonString(optimizer), ",\n",
      "  \"optimizer_step\": ", data->optimizer_step, ",\n",
      "  \"tokens_total\": ", data->tokens_total, ",\n",
      "  \"tokens_since_pull\": ", data->tokens_since_pull, ",\n", "  \"clients\": [",
      clients.empty() ? "" : "\n", absl::StrJoin(clients, ",\n"), clients.empty() ? "" : "\n  ",
      "],\n", "  \"tensors\": [\n", absl::StrJoin(entries, ",\n"), "\n  ]\n}\n");
  const std::string manifest_path = ManifestPath(out);
  if (absl::Status s = WriteTextFile(manifest_path, manifest); !s.ok()) return Fail(s);
  uint64_t tensor_bytes = 0;
  for (const SafetensorsTensor& t : tensors) tensor_bytes += t.data.size();
  std::printf(
      "exported head '%s' (V=%lld D=%lld %s, version %llu, %s step %llu): %zu tensor%s (%s) to "
      "%s, manifest %s\n",
      spec.name().c_str(), static_cast<long long>(v), static_cast<long long>(d),
      Lower(v1::DType_Name(dtype), "DTYPE_").c_str(),
      static_cast<unsigned long long>(data->weights_version), optimizer.c_str(),
      static_cast<unsigned long long>(data->optimizer_step), tensors.size(),
      tensors.size() == 1 ? "" : "s", ShortBytes(tensor_bytes).c_str(), out.c_str(),
      manifest_path.c_str());
  return 0;
}

int RunImport() {
  const std::string path = absl::GetFlag(FLAGS_safetensors);
  const std::string name = absl::GetFlag(FLAGS_tensor);
  const std::string head = absl::GetFlag(FLAGS_head);
  if (path.empty()) return Fail(absl::InvalidArgumentError("--safetensors is required"));
  if (head.empty()) return Fail(absl::InvalidArgumentError("--head is required"));
  absl::StatusOr<SafetensorsIndex> index = ReadSafetensorsIndex(path);
  if (!index.ok()) return Fail(index.status());
  const auto entry = index->tensors.find(name);
  if (entry == index->tensors.end()) {
    return Fail(ReadSafetensorsTensor(path, *index, name).status());  // names what there is
  }
  v1::DType dtype = v1::DTYPE_UNSPECIFIED;
  for (v1::DType candidate : {v1::DTYPE_BF16, v1::DTYPE_FP16, v1::DTYPE_FP32}) {
    if (SafetensorsDType(candidate) == entry->second.dtype) dtype = candidate;
  }
  if (dtype == v1::DTYPE_UNSPECIFIED || entry->second.shape.size() != 2 ||
      entry->second.shape[0] < 1 || entry->second.shape[1] < 1) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        path, ": tensor '", name, "' is ", entry->second.dtype, " ", JsonShape(entry->second.shape),
        "; a head needs a BF16, F16 or F32 matrix [V, D]")));
  }
  absl::StatusOr<std::string> weights = ReadSafetensorsTensor(path, *index, name);
  if (!weights.ok()) return Fail(weights.status());
  // b beside W (an export of a head with an output bias): the head gets a bias and W and b go
  // in one push, both in fp32 when their dtypes differ (exact: the server rounds W back).
  const std::string bias_name = BiasName(name);
  const auto bias_entry = index->tensors.find(bias_name);
  const bool has_bias = bias_entry != index->tensors.end();
  std::string bias;
  v1::DType wire = dtype;
  if (has_bias) {
    v1::DType bias_dtype = v1::DTYPE_UNSPECIFIED;
    for (v1::DType candidate : {v1::DTYPE_BF16, v1::DTYPE_FP16, v1::DTYPE_FP32}) {
      if (SafetensorsDType(candidate) == bias_entry->second.dtype) bias_dtype = candidate;
    }
    if (bias_dtype == v1::DTYPE_UNSPECIFIED || bias_entry->second.shape.size() != 1 ||
        bias_entry->second.shape[0] != entry->second.shape[0]) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor '", bias_name, "' is ", bias_entry->second.dtype, " ",
                       JsonShape(bias_entry->second.shape), "; the output bias of a head of V = ",
                       entry->second.shape[0], " is a BF16, F16 or F32 vector [V]")));
    }
    absl::StatusOr<std::string> read = ReadSafetensorsTensor(path, *index, bias_name);
    if (!read.ok()) return Fail(read.status());
    bias = *std::move(read);
    if (bias_dtype != dtype) {
      *weights = ToFp32(*weights, dtype);
      bias = ToFp32(bias, bias_dtype);
      wire = v1::DTYPE_FP32;
    }
  }
  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail(client.status());
  if (absl::GetFlag(FLAGS_create)) {
    absl::StatusOr<v1::MatmulPrecision> precision = MatmulPrecisionFromFlags();
    if (!precision.ok()) return Fail(precision.status());
    absl::StatusOr<v1::Placement> placement = PlacementFromFlags();
    if (!placement.ok()) return Fail(placement.status());
    v1::HeadSpec spec;
    spec.set_name(head);
    spec.set_vocab_size(entry->second.shape[0]);
    spec.set_hidden_size(entry->second.shape[1]);
    spec.set_weight_dtype(dtype);
    spec.set_matmul_precision(*precision);
    spec.set_bias(has_bias);
    *spec.mutable_placement() = *placement;
    spec.mutable_init()->set_zeros(true);  // replaced by the push below
    absl::StatusOr<v1::HeadInfo> created = (*client)->CreateHead(spec);
    if (!created.ok()) return Fail(created.status());
  }
  client::PushRequest push;
  push.head = head;
  push.dtype = wire;
  push.data = std::as_bytes(std::span<const char>(weights->data(), weights->size()));
  push.bias = std::as_bytes(std::span<const char>(bias.data(), bias.size()));
  absl::StatusOr<uint64_t> version = (*client)->PushWeights(push);
  if (!version.ok()) {
    // A head created here and refused its weights (NaN, Inf, a shape it does not have) must not
    // stay behind with zeros under the name.
    if (absl::GetFlag(FLAGS_create)) (*client)->DeleteHead(head).IgnoreError();
    return Fail(version.status());
  }
  std::printf("imported '%s'%s of %s (%s [%lld, %lld], %s) into head '%s': weights version %llu\n",
              name.c_str(), has_bias ? absl::StrCat(" and '", bias_name, "'").c_str() : "",
              path.c_str(), entry->second.dtype.c_str(),
              static_cast<long long>(entry->second.shape[0]),
              static_cast<long long>(entry->second.shape[1]), ShortBytes(weights->size()).c_str(),
              head.c_str(), static_cast<unsigned long long>(*version));
  return 0;
}

}  // namespace losshead::cli
